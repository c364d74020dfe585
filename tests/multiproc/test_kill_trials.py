"""Kill a random rank of 3 or 4 at a random moment, start-up included: every survivor must
exit within 10 s with an error naming the rank that died -- not a neighbour that exited
because of it. The default run does a few trials; ``-m slow`` does many and prints figures
(docs/reliability.md reports them).
"""

from __future__ import annotations

import json
import os
import random
import statistics

import pytest

from tests.conftest import VERBS
from tests.ranks.supervisor import Trial, run_trial

KINDS = ["channels", "ring", "ps"]


def _names_the_victim(error: list | None, victim: int) -> bool:
    if not error or error[0] not in ("PeerError", "AuthenticationError", "TimeoutError"):
        return False
    kind, message, rank = error
    return kind == "PeerError" and (rank == victim or message.startswith(f"rank {victim} "))


def _problems(trial: Trial) -> list[str]:
    """What went wrong in one trial (empty: every survivor named the victim within 10 s)."""
    out = []
    victim = trial.workers[trial.victim]
    if victim.returncode != -9:
        out.append(f"the victim rank {trial.victim} ended with {victim.returncode} before it was killed")
    for w, seconds in zip(trial.survivors(), trial.exit_seconds(), strict=True):
        if w.returncode != 0 or w.value is None:
            out.append(f"rank {w.rank} did not end cleanly ({w.returncode}):\n{w.output[-1500:]}")
        elif not _names_the_victim(w.value["error"], trial.victim):
            out.append(f"rank {w.rank} blamed the wrong rank or nobody: {w.value['error']}")
        elif seconds >= 10:
            out.append(f"rank {w.rank} took {seconds:.1f} s to exit")
    return out


def _trial(transport: str, world: int, kind: str, rng: random.Random, startup: bool) -> Trial:
    victim = rng.randrange(world)
    kill_after = rng.uniform(0.05, 1.5) if startup else rng.uniform(1.5, 5.0)
    return run_trial(
        "workload_until_failure", world, victim, kill_after, transport=transport, kwargs={"kind": kind, "seconds": 30}
    )


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_survivors_name_a_rank_killed_at_a_random_moment(transport, world):
    rng = random.Random(os.environ.get("RDKERAS_TRIAL_SEED", f"{transport}/{world}"))
    for startup in (True, False):
        kind = rng.choice(KINDS)
        trial = _trial(transport, world, kind, rng, startup)
        problems = _problems(trial)
        assert not problems, f"{kind}, victim {trial.victim} at {trial.killed_at:.2f} s: " + "\n".join(problems)


RENDEZVOUS_S = 5.0


def _startup_trial(transport: str, rng: random.Random) -> Trial:
    """A rank of 3 killed during start-up with nobody to report it (no launcher: srun, TF_CONFIG, torchrun)."""
    return run_trial(
        "workload_until_failure",
        3,
        rng.randrange(3),
        rng.uniform(0.05, 1.5),
        transport=transport,
        kwargs={"kind": rng.choice(KINDS), "seconds": 30},
        host_store=False,
        extra_env={"RDKERAS_RENDEZVOUS_TIMEOUT": str(RENDEZVOUS_S)},
    )


def _startup_problems(trial: Trial) -> list[str]:
    """Every survivor named the victim within the rendezvous timeout (+ 10 s to see and exit)."""
    out = []
    for w, seconds in zip(trial.survivors(), trial.exit_seconds(), strict=True):
        if w.returncode != 0 or w.value is None:
            out.append(f"rank {w.rank} did not end cleanly ({w.returncode}):\n{w.output[-1500:]}")
        elif not _names_the_victim(w.value["error"], trial.victim):
            out.append(f"rank {w.rank} blamed the wrong rank or nobody: {w.value['error']}")
        elif seconds >= RENDEZVOUS_S + 10:
            out.append(f"rank {w.rank} took {seconds:.1f} s to exit")
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_killed_during_start_up_without_a_launcher_is_named(transport):
    rng = random.Random(os.environ.get("RDKERAS_TRIAL_SEED", f"startup/{transport}"))
    trial = _startup_trial(transport, rng)
    problems = _startup_problems(trial)
    assert not problems, f"victim {trial.victim} at {trial.killed_at:.2f} s: " + "\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_many_start_up_deaths_without_a_launcher(transport):
    """20 start-up deaths with no launcher to report them: each survivor names the victim in time."""
    rng = random.Random(os.environ.get("RDKERAS_TRIAL_SEED", f"many-startup/{transport}"))
    failures, worst = [], 0.0
    for i in range(20):
        trial = _startup_trial(transport, rng)
        worst = max(worst, *trial.exit_seconds())
        if problems := _startup_problems(trial):
            failures.append(f"trial {i}, victim {trial.victim} at {trial.killed_at:.2f} s: {problems}")
    print(f"{transport}: 20 start-up deaths without a launcher, worst exit {worst:.1f} s after the death")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc", VERBS])
def test_many_kill_trials(transport):
    """20 trials per world size (3 and 4), all kinds, a quarter of them in start-up; prints figures."""
    rng = random.Random(os.environ.get("RDKERAS_TRIAL_SEED", f"many/{transport}"))
    figures, failures = [], []
    for world in (3, 4):
        for i in range(20):
            kind, startup = KINDS[i % 3], i % 4 == 0
            trial = _trial(transport, world, kind, rng, startup)
            problems = _problems(trial)
            worst = max(trial.exit_seconds())
            figures.append(
                {"world": world, "kind": kind, "startup": startup, "worst_exit_s": worst, "ok": not problems}
            )
            if problems:
                failures.append(f"{world} ranks, {kind}, victim {trial.victim} at {trial.killed_at:.2f} s: {problems}")
    worst = [f["worst_exit_s"] for f in figures]
    print(
        f"\nkill trials over {transport}: {len(figures)} trials, {len(failures)} failed; survivor exit after the "
        f"death: median {statistics.median(worst):.2f} s, worst {max(worst):.2f} s"
    )
    print(json.dumps({"transport": transport, "trials": figures}))
    assert not failures, "\n".join(failures)
