"""The launcher's verdict lines: whose error each rank reported, times that are never negative, and when the
launcher stops waiting for workers after a failure."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from rdkeras import reports
from rdkeras._workers import REPORTED_GRACE_S, RankResult, _nothing_to_wait_for
from rdkeras.launch_verdict import verdict


def _report(rank: int, blamed: int, why: str, reporter: int | None = None, **more) -> dict:
    return {"rank": rank, "blamed": blamed, "reporter": rank if reporter is None else reporter, "why": why,
            "time": time.time(), **more}  # fmt: skip


def test_a_report_of_another_ranks_error_names_that_rank():
    stopped = _report(0, 1, "it stopped on an error of its own (see its log)", reporter=1)
    assert reports.sentence(stopped) == "rank 1 stopped on an error of its own (see its log)"
    relayed = _report(2, 0, "it stalled: no heartbeat within the heartbeat timeout", reporter=1)
    assert reports.sentence(relayed) == "rank 0 stalled: no heartbeat within the heartbeat timeout (seen by rank 1)"
    first_hand = _report(1, 0, "rank 0 stalled: no heartbeat for 10 s")
    assert reports.sentence(first_hand) == "rank 0 stalled: no heartbeat for 10 s"
    own = _report(1, 1, "uncaught ValueError: a bug")
    assert reports.sentence(own) == "an error of its own: uncaught ValueError: a bug"


def test_per_rank_lines_say_whose_error_and_no_negative_time():
    # Rank 1 raised and took longer to exit than rank 0, which lost it at once.
    culprit = RankResult(1, 1, "", ended_at=105.0, report=_report(1, 1, "uncaught ValueError: a bug"))
    survivor = RankResult(0, 1, "", ended_at=104.5, report=_report(0, 1, "it stopped on an error of its own",
                                                                   reporter=1))  # fmt: skip
    late = RankResult(2, 1, "", ended_at=106.0, report=_report(2, 1, "it stopped on an error of its own", 1))
    status, lines = verdict([survivor, culprit, late])
    assert status == 1
    assert lines[0].startswith("worker rank 1 failed first (uncaught ValueError: a bug; then exit code 1)")
    assert (
        lines[1] == "rank 0: exit code 1, 0.5 s before rank 1 ended; it reported rank 1 stopped on an error of its own"
    )
    assert lines[2] == "rank 1: exit code 1"
    assert lines[3] == "rank 2: exit code 1, 1.0 s after rank 1; it reported rank 1 stopped on an error of its own"
    assert not any("-" in line.split("(")[0] for line in lines[1:])


def test_a_rank_killed_once_named_hung_is_said_to_be():
    why = "rank 1 has not entered allreduce #4 (ring grads); it finished #3 (allreduce ring grads) 3.0 s ago"
    survivor = RankResult(0, 1, "", ended_at=103.5, report=_report(0, 1, why))
    hung = RankResult(1, -9, "", ended_at=105.5, killed=True, report=_report(1, 1, why, hung=True))
    status, lines = verdict([survivor, hung])
    assert status == 1
    killed = "killed by the launcher once named hung (it would not end by itself; its stacks are in its output)"
    assert lines[0].startswith(f"worker rank 1 failed first ({why}, seen by rank 0; then {killed}); its last output:")
    assert lines[2] == f"rank 1: {killed}"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_launcher_waits_for_no_rank_that_reported_long_enough_ago(tmp_path):
    procs = [_sleeper(), _sleeper()]
    try:
        write = lambda rank, report: (tmp_path / f"failure-{rank}.json").write_text(json.dumps(report))  # noqa: E731
        write(0, _report(0, 1, "rank 1 stalled: no heartbeat for 3 s"))
        # Rank 1 is blamed and silent (stopped): nobody is left to wait for but rank 0, on its way out.
        assert not _nothing_to_wait_for(procs, [0, 1], str(tmp_path))
        write(0, {**_report(0, 1, "rank 1 stalled: no heartbeat for 3 s"), "time": time.time() - REPORTED_GRACE_S})
        assert _nothing_to_wait_for(procs, [0, 1], str(tmp_path))
        # A rank that has said nothing and is not blamed has not noticed yet: it gets the grace.
        assert not _nothing_to_wait_for([*procs, procs[0]], [0, 1, 2], str(tmp_path))
    finally:
        for p in procs:
            p.kill()
            p.wait()
