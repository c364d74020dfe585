"""A rank that hangs but lives -- stuck in Python, its heartbeat going on -- is named by every other rank, with
the collective it has not entered, within the progress timeout + 10 s; the launcher's verdict names it too, and
its own log has its Python stack, and ``rdkeras postmortem`` over the ranks' flight records names it
(docs/reliability.md, "Hung ranks")."""

from __future__ import annotations

import pytest

from rdkeras import postmortem, reports
from tests.conftest import run_ranks

PROGRESS_S = 3.0
HANG_S = PROGRESS_S + 6  # longer than the others take to name it


def _hang(victim: int, how: str, flight_dir) -> list:
    return run_ranks(
        "hang_in_allreduce",
        3,
        module="tests.ranks.hang_workers",
        check=False,
        timeout=90,
        env={
            "RDKERAS_PROGRESS_TIMEOUT": str(PROGRESS_S),
            "RDKERAS_HEARTBEAT_TIMEOUT": "2",
            "RDKERAS_FLIGHT_DIR": str(flight_dir),
        },
        victim=victim,
        how=how,
        hang_seconds=HANG_S,
    )


def _problems(results: list, victim: int, flight_dir) -> list[str]:
    out = []
    for r in results:
        if r.rank == victim:
            if "was named hung" not in r.output or "Python stacks" not in r.output or "hang_workers.py" not in r.output:
                out.append(f"the hung rank {victim} did not log its stack:\n{r.output[-2000:]}")
            continue
        error = (r.value or {}).get("error")
        if r.returncode != 0 or not error:
            out.append(f"rank {r.rank} did not fail cleanly ({r.returncode}, {r.value}):\n{r.output[-1500:]}")
        elif (
            error[0] != "PeerError" or error[2] != victim or "has not entered allreduce #4 (ring grads)" not in error[1]
        ):
            out.append(f"rank {r.rank} did not name the hung rank {victim} and its op: {error}")
        elif r.value["seconds"] >= PROGRESS_S + 10:
            out.append(f"rank {r.rank} took {r.value['seconds']:.1f} s to fail")
    verdict = reports.cause({r.rank: r.report for r in results if r.report is not None})
    if verdict is None or verdict["blamed"] != victim:
        out.append(f"the launcher's verdict does not name rank {victim}: {verdict}")
    worst = max((r.value or {}).get("seconds", 0.0) for r in results if r.rank != victim)
    print(f"rank {victim} hung: the others failed within {worst:.1f} s")  # (-s shows it: docs/reliability.md)
    dumps = postmortem.load(flight_dir)
    found = postmortem.diverged(dumps)
    if sorted(dumps) != [0, 1, 2] or found is None or (found.rank, found.number) != (victim, 4):
        out.append(f"rdkeras postmortem does not name rank {victim} at #4: {found} (dumps of {sorted(dumps)})")
    return out


# (extended, both: test_hang_launches.py keeps a hang trial in the default run, which is at its 10-minute budget)
@pytest.mark.extended
@pytest.mark.parametrize(("victim", "how"), [(1, "callback"), (0, "lock")])
def test_a_live_rank_that_hangs_is_named_by_every_other_rank(victim, how, tmp_path):
    problems = _problems(_hang(victim, how, tmp_path), victim, tmp_path)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["callback", "lock", "numpy_function"])
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_every_way_of_hanging_at_every_rank(victim, how, tmp_path):
    problems = _problems(_hang(victim, how, tmp_path), victim, tmp_path)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_keras_callback_that_hangs_is_named(victim, tmp_path):
    """The survivors' gradient allreduce inside model.fit names the rank whose callback sleeps."""
    results = run_ranks(
        "hang_in_keras_fit",
        3,
        module="tests.ranks.hang_workers",
        check=False,
        timeout=240,
        env={"RDKERAS_PROGRESS_TIMEOUT": str(PROGRESS_S), "RDKERAS_HEARTBEAT_TIMEOUT": "2"},
        victim=victim,
        hang_seconds=HANG_S,
    )
    for r in results:
        error = (r.value or {}).get("error")
        if r.rank == victim:
            assert "was named hung" in r.output and "on_train_batch_begin" in r.output, r.output[-2000:]
            continue
        assert error and f"rank {victim} has not entered allreduce #" in error[1], f"rank {r.rank}: {r.value}"
