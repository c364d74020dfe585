"""The launcher's root cause from the workers' reports (rdkeras/reports.py): own errors first, then consensus."""

from __future__ import annotations

from rdkeras import reports


def _r(rank: int, blamed: int, t: float, reporter: int | None = None, why: str = "") -> dict:
    return {"rank": rank, "blamed": blamed, "reporter": rank if reporter is None else reporter, "why": why, "time": t}


def test_an_error_of_a_ranks_own_is_the_cause_even_when_it_exits_last():
    found = {0: _r(0, 1, 1.0, reporter=1), 2: _r(2, 1, 1.1, reporter=1), 1: _r(1, 1, 0.9, why="uncaught ValueError")}
    assert reports.cause(found)["why"] == "uncaught ValueError"
    both = {0: _r(0, 0, 5.0, why="late"), 1: _r(1, 1, 2.0, why="early")}
    assert reports.cause(both)["why"] == "early"  # two ranks failed of their own: the earlier one


def test_otherwise_the_rank_most_reports_blame_in_first_hand_words():
    found = {
        0: _r(0, 2, 1.0, reporter=1, why="it stalled (heard from rank 1)"),
        1: _r(1, 2, 1.2, why="rank 2 stalled: no heartbeat for 3 s"),
        3: _r(3, 0, 0.5, why="a neighbour that left because of it"),
    }
    known = reports.cause(found)
    assert known["blamed"] == 2 and known["why"] == "rank 2 stalled: no heartbeat for 3 s"
    assert reports.cause({}) is None


def test_reports_are_written_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("RDKERAS_REPORT_DIR", str(tmp_path))
    monkeypatch.setattr(reports, "_written", set())
    reports.write(3, 1, "rank 1 failed", reporter=2)
    reports.write(3, 3, "a later thought")  # the first report stands
    assert reports.read(tmp_path, [3, 4]) == {
        3: {**_r(3, 1, reports.read(tmp_path, [3])[3]["time"], 2, "rank 1 failed")}
    }


def test_a_rank_named_hung_is_the_cause_in_the_words_of_the_rank_that_named_it():
    named = "rank 1 has not entered allreduce #4 (ring grads); it finished #3 3.0 s ago"
    found = {
        0: {"rank": 0, "blamed": 1, "reporter": 0, "why": named, "time": 10.0},
        1: {"rank": 1, "blamed": 1, "reporter": 1, "why": "rank 1 has not entered collective #4", "time": 10.1,
            "hung": True},
        2: {"rank": 2, "blamed": 1, "reporter": 0, "why": named, "time": 10.2},
    }  # fmt: skip
    verdict = reports.cause(found)
    assert verdict is not None and (verdict["blamed"], verdict["why"]) == (1, named)


def test_a_launcher_leaves_a_rank_named_hung_a_moment_to_write_its_stacks():
    named = {0: {"rank": 0, "blamed": 1, "reporter": 0, "why": "rank 1 has not entered allreduce #4", "time": 100.0}}
    assert reports.waiting_for_stacks(named, {1}, now=100.5)
    assert not reports.waiting_for_stacks(named, {1}, now=100.0 + reports.HUNG_GRACE_S)
    assert not reports.waiting_for_stacks(named, set(), now=100.5)  # it ended
    stalled = {0: {**named[0], "why": "rank 1 stalled: no heartbeat for 3 s"}}
    assert not reports.waiting_for_stacks(stalled, {1}, now=100.5)  # a stopped rank writes nothing: no wait
    spoke = {**named, 1: {"rank": 1, "blamed": 1, "reporter": 1, "why": "named", "time": 100.2, "hung": True}}
    assert not reports.waiting_for_stacks(spoke, {1}, now=100.5)
