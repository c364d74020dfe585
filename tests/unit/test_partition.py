"""The automatic pipeline cut: layer costs given (no timing), the balanced cut chosen, impossible requests refused."""

from __future__ import annotations

import dataclasses

import pytest

from rdkeras.parallel import check_settings
from rdkeras.pipeline.cut.partition import balanced_cut, evaluate_cut

NAMES = ["a", "b", "c", "d", "e", "f"]


def test_two_stages_balance_the_compute():
    p = balanced_cut(NAMES, [1, 1, 1, 1, 1, 3], [0] * 5, 2, seconds_per_byte=0)
    assert p.cuts == (4,)  # a..d (4 s) | e, f (4 s)
    assert p.compute == (4.0, 4.0)
    assert p.speedup == pytest.approx(2.0)
    assert p.gpipe_speedup(4) == pytest.approx(2.0 * 4 / 5)
    assert p.stage_of() == {"a": 0, "b": 0, "c": 0, "d": 0, "e": 1, "f": 1}


def test_three_stages_minimise_the_slowest():
    p = balanced_cut(NAMES, [4, 1, 1, 1, 1, 4], [0] * 5, 3, seconds_per_byte=0)
    assert p.slowest == pytest.approx(4.0)
    assert p.stage_costs == (4.0, 4.0, 4.0)
    assert p.cuts == (1, 5)


def test_one_stage_is_the_whole_model():
    p = balanced_cut(NAMES, [1] * 6, [5] * 5, 1)
    assert p.bounds == (0, 6) and p.cuts == () and p.transfer == (0.0,)
    assert p.speedup == pytest.approx(1.0)


def test_transfer_bytes_move_the_cut_to_a_narrow_place():
    # Equal compute: the middle cut would balance it, but 100 s of bytes cross there.
    costs = [1, 1, 1, 1]
    assert balanced_cut(NAMES[:4], costs, [0, 0, 0], 2, seconds_per_byte=1).cuts == (2,)
    p = balanced_cut(NAMES[:4], costs, [0, 100, 0], 2, seconds_per_byte=1)
    assert p.cuts == (1,)
    assert p.transfer == (0.0, 0.0) and p.cut_bytes == (0,)


def test_a_skip_connection_makes_the_cuts_it_spans_expensive():
    # a -> b -> c -> d with a skip a -> d: the skip's bytes cross cuts 2 and 3 (after b and c), not cut 1
    # (a's output crosses it anyway). The compute alone would cut after b.
    names = ["a", "b", "c", "d"]
    costs = [1.0, 1.0, 1.0, 1.0]
    chain = 10
    skip = 1000
    p = balanced_cut(names, costs, [chain, chain + skip, chain + skip], 2, seconds_per_byte=1e-3)
    assert p.cuts == (1,)
    assert p.cut_bytes == (chain,)
    assert p.transfer == pytest.approx((0.01, 0.01))
    without = balanced_cut(names, costs, [chain, chain, chain], 2, seconds_per_byte=1e-3)
    assert without.cuts == (2,)


def test_ties_go_to_the_earlier_cut():
    assert balanced_cut(["a", "b", "c"], [1, 1, 1], [0, 0], 2, seconds_per_byte=0).cuts == (1,)


def test_cuts_avoid_gaps_inside_a_shared_layer():
    # None: no cut may go there; the balanced place (2) is not allowed.
    p = balanced_cut(NAMES[:4], [1, 1, 1, 1], [0, None, 0], 2, seconds_per_byte=0)
    assert p.cuts in ((1,), (3,))
    assert 2 not in p.cuts


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"cannot cut 3 layers into 4 stages: .* at most 3 stages are possible"):
        balanced_cut(["a", "b", "c"], [1, 1, 1], [0, 0], 4)


def test_more_stages_than_places_to_cut_is_refused():
    with pytest.raises(
        ValueError,
        match=r"cannot cut 4 layers into 3 stages: only 2 stages are possible, with a cut at each of the 1 places "
        r"a cut may go \(2 of the 3 gaps lie inside layers that cannot be split\)",
    ):
        balanced_cut(["a", "b", "c", "d"], [1, 1, 1, 1], [None, 0, None], 3)


@pytest.mark.parametrize(
    ("stages", "message"),
    [(0, "a whole number of stages >= 1, got 0"), (-2, "got -2"), (True, "got True"), (1.5, "got 1.5")],
)
def test_a_stage_count_below_one_is_refused(stages, message):
    with pytest.raises(ValueError, match=message):
        balanced_cut(["a", "b"], [1, 1], [0], stages)


def test_malformed_inputs_are_refused():
    with pytest.raises(ValueError, match="2 costs for 3 layers"):
        balanced_cut(["a", "b", "c"], [1, 1], [0, 0], 2)
    with pytest.raises(ValueError, match=r"1 cut sizes for 3 layers: give one per gap between layers \(2\)"):
        balanced_cut(["a", "b", "c"], [1, 1, 1], [0], 2)
    with pytest.raises(ValueError, match="costs must be seconds >= 0; got -1 for 'b'"):
        balanced_cut(["a", "b"], [1, -1], [0], 2)
    with pytest.raises(ValueError, match="no layers"):
        balanced_cut([], [], [], 1)


def test_a_given_cut_is_costed_and_checked():
    p = evaluate_cut(NAMES, [1] * 6, [8] * 5, [2, 4], seconds_per_byte=0.5)
    assert p.compute == (2.0, 2.0, 2.0)
    assert p.transfer == (4.0, 8.0, 4.0)
    assert p.slowest == pytest.approx(10.0)
    with pytest.raises(ValueError, match=r"cuts \[3, 3\] leave stage 1 empty"):
        evaluate_cut(NAMES, [1] * 6, [0] * 5, [3, 3])
    with pytest.raises(ValueError, match=r"cuts \[6\] leave stage 1 empty"):
        evaluate_cut(NAMES, [1] * 6, [0] * 5, [6])
    with pytest.raises(ValueError, match=r"a cut at 2, between 'b' and 'c', falls inside a layer that cannot be split"):
        evaluate_cut(NAMES, [1] * 6, [0, None, 0, 0, 0], [2])


def test_the_plan_text_names_the_cut_the_costs_and_the_speedup():
    text = balanced_cut(NAMES, [1, 1, 1, 1, 1, 3], [0, 0, 0, 64, 0], 2, seconds_per_byte=0).text(micro_batches=4)
    assert "2 stages balanced by measured cost; expected speed-up 2.00x" in text
    assert "1.60x with 4" in text
    assert "stage 0: a .. d (4 layers): 4000.000 ms compute" in text
    assert "stage 1: e .. f (2 layers)" in text
    assert "cut 0: after d, before e: 64 bytes cross it per measured batch" in text


def test_hybrid_settings_without_a_placement_need_stages():
    check_settings("model", placement=None)  # model parallelism: as many stages as workers
    check_settings("model", placement="auto", workers=3)
    with pytest.raises(ValueError, match=r"or stages=N \(workers per pipeline\)"):
        check_settings("hybrid", placement="auto")
    check_settings("model", placement=None, stages=2, workers=2)
    check_settings("model", placement="auto", stages=2, workers=2)
    check_settings("hybrid", placement="auto", stages=2, workers=4)
    with pytest.raises(ValueError, match="stages=2 does not fit 3 workers: model parallelism runs one pipeline"):
        check_settings("model", placement="auto", stages=2, workers=3)
    with pytest.raises(ValueError, match="stages=2 does not fit 3 workers: hybrid runs replicas"):
        check_settings("hybrid", placement="auto", stages=2, workers=3)
    with pytest.raises(ValueError, match=r"placement must be layer-name globs .* or 'auto'; got 'balanced'"):
        check_settings("model", placement="balanced", stages=2)
    check_settings("model", placement={"a*": 0, "b*": 1}, workers=2)  # a user placement needs no stages


def test_an_expensive_layer_at_the_balance_point_alternates():
    # Between layers the best cut is 7 | 3 (or 3 | 7); c on stage 1 for 4 of 8 micro-batches: 5 | 5.
    costs = [2, 1, 4, 1, 2]
    p = balanced_cut(NAMES[:5], costs, [0] * 4, 2, seconds_per_byte=0, alternable=[0] * 5, micro_batches=8)
    assert p.cuts == (3,) and p.shares == (4,) and p.micro_batches == 8
    assert p.compute == (5.0, 5.0)
    assert p.alternates == {"c": (0, 1)}
    assert [m for m in range(8) if p.moved(m)] == [1, 3, 5, 7]  # the stages take turns
    assert p.stage_of() == {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1}
    assert p.stage_of(p.moved(1)) == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}
    assert "c alternates: stage 1 runs it for 4 of 8 micro-batches, stage 0 for the rest" in p.text()
    # Layers that may not alternate (None), one micro-batch, or no alternation asked for: a cut between layers.
    assert balanced_cut(NAMES[:5], costs, [0] * 4, 2, 0, [0, 0, None, 0, 0], micro_batches=8).slowest == 7.0
    assert balanced_cut(NAMES[:5], costs, [0] * 4, 2, 0, [0] * 5, micro_batches=1).shares == ()
    assert balanced_cut(NAMES[:5], costs, [0] * 4, 2, seconds_per_byte=0).shares == ()


def test_alternating_pays_each_cut_by_its_share_and_the_gradient_sum():
    # c on stage 1 for half the micro-batches: those send c's input (30 bytes each way), the others its output
    # (10): 20 on average; both stages also send c's 4 bytes of weight gradients once a step (2 micro-batches).
    costs, sizes = [2, 1, 4, 1, 2], [0, 30, 10, 0]
    p = balanced_cut(NAMES[:5], costs, sizes, 2, seconds_per_byte=0.01, alternable=[0, 0, 4, 0, 0], micro_batches=2)
    assert p.shares == (1,)
    assert p.transfer == pytest.approx((0.22, 0.22))


def test_a_small_gain_keeps_the_cut_between_layers():
    # Alternating b would balance 2.9 | 3.1 into 3 | 3: under ALTERNATION_GAIN, not worth it.
    p = balanced_cut(["a", "b", "c"], [2.7, 0.4, 2.9], [0, 0], 2, 0, alternable=[0, 0, 0], micro_batches=8)
    assert p.shares == () and p.cuts == (2,)


def test_three_stages_may_alternate_at_each_cut():
    # Between layers: a b | c d | e f = 2 | 5 | 6; c and e each on their later stage for half the micro-batches:
    # a b + c/2 | c/2 d + e/2 | e/2 f = 4 | 5 | 4.
    p = balanced_cut(NAMES, [1, 1, 4, 1, 4, 2], [0] * 5, 3, seconds_per_byte=0, alternable=[0] * 6, micro_batches=2)
    assert p.shares == (1, 1)
    assert p.alternates == {"c": (0, 1), "e": (1, 2)}
    assert p.compute == pytest.approx((4.0, 5.0, 4.0))
    assert p.stage_of(p.moved(1)) == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 2, "f": 2}


def test_an_expensive_layer_at_the_balance_point_is_split_by_rows():
    # Between layers 7 | 3 (or 3 | 7); c on stage 1 for 4 of every 8 rows of each micro-batch: 5 | 5. Each part of
    # the rows sends what crosses where it cuts: half c's output (8 bytes), half its input (16).
    costs, sizes = [2, 1, 4, 1, 2], [0, 16, 8, 0]
    p = balanced_cut(NAMES[:5], costs, sizes, 2, 0.01, alternable=[0, 0, 4, 0, 0], micro_batches=2, split_rows=8)
    assert p.cuts == (3,) and p.splits == (4,) and p.shares == () and p.rows == 8
    assert p.transfer == pytest.approx(((4 + 8 + 2) * 0.01,) * 2)  # (and c's 4 bytes of weight gradients a step)
    assert p.alternates == {"c": (0, 1)} and p.split_layers == {"c": (4, 8)}
    assert p.stage_of() == {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1}  # (the user's model: c on the earlier stage)
    assert p.split_placement() == {**p.stage_of(), "c__rows": 0, "c__twin": 1, "c__join": 1}
    assert p.moved(1) == ()  # every micro-batch follows the one (split) plan
    assert "c split by rows: stage 1 runs it for 4 of every 8 rows of each micro-batch, stage 0 for" in p.text()
    assert (
        "\n  tried: c split by rows measured 5 | 5 ms"
        in dataclasses.replace(p, trial="c split by rows measured 5 | 5 ms").text()
    )
    # A finer share where the neighbours are uneven: a b + 5/8 c | 3/8 c d e = 5.5 | 5.5.
    q = balanced_cut(NAMES[:5], [2, 1, 4, 2, 2], [0] * 4, 2, 0, alternable=[0, 0, 4, 0, 0], split_rows=8)
    assert q.splits == (3,) and q.compute == pytest.approx((5.5, 5.5))
    # A layer that may not be split: the cut between layers.
    assert balanced_cut(NAMES[:5], costs, sizes, 2, 0.01, [0, 0, None, 0, 0], split_rows=8).splits == ()
