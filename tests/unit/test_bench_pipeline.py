"""The pipeline bench's arithmetic: the ideal step for measured stage computes, and the breakdown it prints."""

from __future__ import annotations

import pytest

from rdkeras.bench import cut_after
from rdkeras.bench.pipeline import _print, _summary, balanced_step, ideal_step, median_round


def test_the_ideal_step_fills_and_drains_with_the_slowest_stage():
    # 2 stages of 80 and 120 ms over 8 micro-batches: 9 micro-batches of the slowest, 15 ms each.
    assert ideal_step([0.080, 0.120], 8) == pytest.approx(9 * 0.015)
    assert ideal_step([0.100, 0.100], 1) == pytest.approx(0.200)  # one micro-batch: no overlap at all
    assert ideal_step([0.05, 0.05, 0.05, 0.05], 4) == pytest.approx(7 * 0.0125)
    # Deferred weight gradients (the tails) come once, after the passes: the largest one ends the step.
    assert ideal_step([0.080, 0.120], 8, [0.024, 0.040]) == pytest.approx(9 * 0.010 + 0.040)
    assert ideal_step([0.080, 0.060], 8, [0.024, 0.0]) == pytest.approx(9 * 0.060 / 8 + 0.024)


def test_the_balanced_step_spreads_the_same_passes_and_tails_evenly():
    # Passes 80 | 120 ms, tails 24 | 40 ms, 8 micro-batches: even stages would run 100 ms of passes and 32 of tail.
    assert balanced_step([0.104, 0.160], 8, [0.024, 0.040]) == pytest.approx(9 * 0.100 / 8 + 0.032)
    assert balanced_step([0.104, 0.160], 8, [0.024, 0.040]) < ideal_step([0.104, 0.160], 8, [0.024, 0.040])
    assert balanced_step([0.1, 0.1], 4) == pytest.approx(ideal_step([0.1, 0.1], 4))  # balanced already


def test_the_breakdown_names_each_stage_s_passes_tail_waiting_and_rest(capsys):
    alone = {"step": 0.180, "compute": {1: 0.170, 8: 0.160}, "params": 307_498}
    stages = [
        {"stage": 0, "step": 0.125, "compute": 0.070, "waiting": 0.045, "layers": ["a", "b", "c"], "stashed": 2},
        {"stage": 1, "step": 0.125, "compute": 0.100, "tail": 0.020, "waiting": 0.010, "layers": ["d", "e"],
         "stashed": 1},
    ]  # fmt: skip
    row = {"cut": "auto", "schedule": "1f1b", "micro": 8, "stages": stages}
    summary = _summary(row, alone)
    assert summary["ideal"] == pytest.approx(9 * 0.080 / 8 + 0.020)
    assert summary["speedup"] == pytest.approx(0.180 / 0.125)
    # Even stages: (70 + 100) / 2 = 85 ms each, 10 of them tail.
    assert summary["balanced_speedup"] == pytest.approx(0.180 / (9 * 0.075 / 8 + 0.010))
    _print("vggstyle", alone, [row], 64)
    out = capsys.readouterr().out
    assert "M=8 160.0 ms (0.94x)" in out  # what micro-batching costs one process
    assert "s0 70.0+0.0/45.0/10.0; 2  s1 80.0+20.0/10.0/15.0; 1" in out  # passes + tail / waiting / rest, stashed
    assert "cut auto, 8 micro-batches: stage 0: a, b, ..., c\n" in out
    stages[0]["alternates"] = ["c"]  # c also runs on stage 1, for half the micro-batches
    _print("vggstyle", alone, [row], 64)
    out = capsys.readouterr().out
    assert "cut auto, 8 micro-batches: stage 0: a, b, ..., c (c alternating with the next stage)" in out


def test_a_configuration_is_compared_with_its_own_one_process_reference():
    alone = {"step": 0.180, "compute": {1: 0.170}, "params": 1}
    stages = [
        {"stage": 0, "alone": 0.150, "step": 0.100, "compute": 0.09, "waiting": 0.0, "layers": ["a"], "stashed": 2},
        {"stage": 1, "alone": None, "step": 0.100, "compute": 0.09, "waiting": 0.0, "layers": ["b"], "stashed": 1},
    ]
    summary = _summary({"cut": "auto", "schedule": "1f1b", "micro": 4, "stages": stages}, alone)
    assert summary["alone"] == 0.150 and summary["speedup"] == pytest.approx(1.5)  # not 0.180 / 0.100


def test_rounds_keep_the_median_round_and_print_their_range(capsys):
    alone = {"step": 0.180, "compute": {1: 0.170}, "params": 1}

    def round_(reference: float, step: float) -> list[dict]:
        return [
            {"stage": s, "alone": reference if s == 0 else None, "step": step, "compute": 0.08, "waiting": 0.0,
             "layers": ["a"], "stashed": 1}
            for s in range(2)
        ]  # fmt: skip

    # Speed-ups 1.5, 1.2, 1.4 (each over its own one-process reference): the row is the 1.4 round's.
    rounds = [round_(0.150, 0.100), round_(0.120, 0.100), round_(0.140, 0.100)]
    row = median_round({"cut": "split", "schedule": "1f1b", "micro": 8, "rounds": rounds}, alone)
    assert row["stages"] is rounds[2] and row["speedups"] == pytest.approx([1.5, 1.2, 1.4])
    assert _summary(row, alone)["speedup"] == pytest.approx(1.4)
    _print("vggstyle", alone, [row], 64)
    assert "rounds 1.20-1.50x (3)" in capsys.readouterr().out
    # An even count takes the lower middle: 1.2, 1.4 of 1.2, 1.4, 1.5, 1.6 -> 1.4.
    rounds.append(round_(0.160, 0.100))
    assert (
        median_round({"cut": "split", "schedule": "1f1b", "micro": 8, "rounds": rounds}, alone)["stages"] is rounds[2]
    )


def test_a_hand_cut_is_a_layer_before_the_last():
    assert cut_after(["a", "b", "c"], "b") == {"a": 0, "b": 0, "c": 1}
    with pytest.raises(SystemExit, match=r"'hand' is not a layer; cut after one of a, b"):
        cut_after(["a", "b", "c"], "hand")
    with pytest.raises(SystemExit, match="'c' is the last layer: stage 1 would be empty"):
        cut_after(["a", "b", "c"], "c")
