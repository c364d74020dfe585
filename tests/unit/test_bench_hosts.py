"""The hosts bench's arithmetic: where a step goes, from the parts each rank measured."""

from __future__ import annotations

import pytest

from rdkeras.bench.hosts import _add_round, describe_parts, machine_cpu_seconds, summarize


def _row(step: list[float], allreduce: list[float], inside: list[float], busy: float) -> dict:
    cpu = [{"user": busy, "system": 0.1, "interrupts": 0.05}] * len(step)
    alone = [{"user": 0.2, "system": 0.0, "interrupts": 0.0}] * 3
    return {"step": step, "allreduce": allreduce, "compute": [0.08, 0.09, 0.07], "inside": inside, "cpu": cpu,
            "compute_cpu": alone}  # fmt: skip


def test_a_step_splits_into_its_exchange_ops_and_everything_else():
    measured = {"rows": {"1gbit": {
        "flat ring": _row([0.90, 0.95, 0.85], [0.84, 0.85, 0.83], [0.80, 0.82, 0.81], 0.27),
        "auto": _row([0.70, 0.72, 0.80], [0.57, 0.58, 0.60], [0.59, 0.60, 0.66], 0.30),
    }}}  # fmt: skip
    parts = summarize(measured)["1gbit/parts"]
    auto = parts["auto"]
    assert auto["step"] == pytest.approx(0.72) and auto["inside"] == pytest.approx(0.60)  # medians
    assert auto["beyond_sum"] == pytest.approx(0.72 - 0.58 - 0.08)
    assert auto["step_cpu"] == {"user": 0.30, "system": 0.1, "interrupts": 0.05}
    assert summarize(measured)["1gbit/step"]["speedup"]["auto"] == pytest.approx(0.90 / 0.72)
    text = describe_parts(auto)
    assert "step 0.720 s = allreduce 0.580 + compute 0.080 + the rest 0.060" in text
    assert "in the step: exchange ops 0.600, everything else 0.120" in text
    assert "a step kept the cores busy for 0.30 s user, 0.10 s system, 0.05 s interrupts" in text


def test_the_machine_s_cpu_seconds_only_grow():
    before = machine_cpu_seconds()
    sum(i * i for i in range(300_000))  # some user time
    after = machine_cpu_seconds()
    assert set(before) == {"user", "system", "interrupts"}
    assert all(after[k] >= before[k] >= 0 for k in before)


def test_over_rounds_a_speed_up_is_the_median_of_each_round_s_ratio():
    rows: dict = {"flat ring": {"rounds": []}, "auto": {"rounds": []}}
    # The machine slows down in round 2 and the rounds' ratios are ~1.48, 1.48 and 1.18: their median, not the
    # ratio of medians taken over steps from different minutes.
    for flat, auto in ((0.90, 0.60), (1.20, 0.80), (0.84, 0.70)):
        _add_round(rows["flat ring"], {"step": [flat, flat], "allreduce": [flat], "plan": ["ring", ""]})
        _add_round(rows["auto"], {"step": [auto, auto + 0.02], "allreduce": [auto], "plan": ["hierarchical", ""]})
    assert rows["auto"]["step"] == pytest.approx([0.60, 0.62, 0.80, 0.82, 0.70, 0.72])  # every step kept
    assert rows["auto"]["plan"] == ["hierarchical", ""]  # replaced, not appended
    assert [r["step"] for r in rows["auto"]["rounds"]] == pytest.approx([0.61, 0.81, 0.71])
    step = summarize({"rows": {"1gbit": rows}})["1gbit/step"]
    assert step["seconds"]["auto"] == pytest.approx(0.71)  # the median of all steps
    ratios = sorted([0.90 / 0.61, 1.20 / 0.81, 0.84 / 0.71])
    assert step["speedup"]["auto"] == pytest.approx(ratios[1]) and step["speedup"]["flat ring"] == 1.0
