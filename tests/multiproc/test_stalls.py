"""A stalled worker (SIGSTOP: a stopped, hung or swapped-out process) is found and named within seconds:
every other rank fails within heartbeat_timeout + 10 s naming it -- rank 0 (which hosts the store) included,
with and without a launcher hosting the store. The default run does one trial per transport; ``-m slow`` does
20 per transport."""

from __future__ import annotations

import os
import random
import signal

import pytest

from tests.conftest import run_ranks
from tests.ranks.supervisor import Trial, run_trial

HEARTBEAT_S = 3.0
TRANSPORTS = ["shm", "tcp", "shm+tcp"]


def _names_the_stalled_rank(error: list | None, victim: int) -> bool:
    if not error or error[0] != "PeerError":
        return False
    _, message, rank = error
    return rank == victim and "stalled" in message


def _problems(trial: Trial) -> list[str]:
    out = []
    for w, seconds in zip(trial.survivors(), trial.exit_seconds(), strict=True):
        if w.returncode != 0 or w.value is None:
            out.append(f"rank {w.rank} did not end cleanly ({w.returncode}):\n{w.output[-1500:]}")
        elif not _names_the_stalled_rank(w.value["error"], trial.victim):
            out.append(f"rank {w.rank} did not name the stalled rank {trial.victim}: {w.value['error']}")
        elif seconds >= HEARTBEAT_S + 10:
            out.append(f"rank {w.rank} took {seconds:.1f} s to fail")
    return out


def _stall(transport: str, victim: int, kind: str, host_store: bool, rng: random.Random) -> Trial:
    return run_trial(
        "workload_until_failure",
        3,
        victim,
        rng.uniform(1.5, 4.0),
        transport=transport,
        kwargs={"kind": kind, "seconds": 60},
        timeout=60,
        stop_signal=signal.SIGSTOP,
        host_store=host_store,
        extra_env={"RDKERAS_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)},
    )


# One trial per transport, the launcher alternating (shm here, the others with -m extended; the slow run does every
# combination 20 times).
@pytest.mark.parametrize(
    ("transport", "host_store"),
    [
        pytest.param("shm", True, id="shm-launcher"),
        pytest.param("tcp", False, id="tcp-no-launcher", marks=pytest.mark.extended),
        pytest.param("shm+tcp", True, id="shm+tcp-launcher", marks=pytest.mark.extended),
    ],
)
def test_a_stalled_rank_is_named_by_every_other_rank(transport, host_store):
    rng = random.Random(f"{transport}/{host_store}")
    victim = 0 if not host_store else rng.randrange(3)  # rank 0 hosts the store without a launcher
    trial = _stall(transport, victim, rng.choice(["channels", "ring", "ps"]), host_store, rng)
    problems = _problems(trial)
    assert not problems, f"victim {trial.victim}:\n" + "\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_stall_trials(transport):
    """20 trials: every rank stalled in turn (rank 0 included), with and without a launcher."""
    rng = random.Random(os.environ.get("RDKERAS_TRIAL_SEED", f"stalls/{transport}"))
    failures, worst = [], 0.0
    for i in range(20):
        kind, host_store = ["channels", "ring", "ps"][i % 3], i % 2 == 0
        trial = _stall(transport, i % 3, kind, host_store, rng)
        worst = max(worst, *trial.exit_seconds())
        if problems := _problems(trial):
            failures.append(f"trial {i} ({kind}, victim {trial.victim}, launcher {host_store}): {problems}")
    print(f"{transport}: 20 stall trials, worst exit {worst:.1f} s after the stop, {len(failures)} failed")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("transport", ["tcp"])  # tcp: its heartbeat also counts what was received
def test_a_long_step_holding_the_gil_is_not_a_stall(transport):
    received, busy = run_ranks(
        "busy_then_send",
        module="tests.ranks.stall_workers",
        transport=transport,
        env={"RDKERAS_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)},
        busy_seconds=2 * HEARTBEAT_S,  # twice the time that declares a silent peer stalled
    )
    assert received.value == {"received": [0.0, 1.0, 2.0, 3.0]} and busy.value["spins"] > 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_closing_the_engine_ends_another_threads_wait_at_once(transport):
    waiter, _ = run_ranks("close_while_another_thread_waits", module="tests.ranks.stall_workers", transport=transport)
    kind, message = waiter.value["error"]
    assert kind == "EngineError" and "the engine was closed while this thread waited for rank 1" in message
    assert waiter.value["seconds"] < 5  # not the operation timeout
