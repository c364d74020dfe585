"""A parallelism's options as data (rdkeras.parallel.options): frozen, checked once when made, the same whether
given as objects, as RDMAStrategy's keywords or as the train app's Hydra config."""

from __future__ import annotations

import dataclasses

import pytest

from rdkeras.parallel.options import DataParallelOptions, ParallelOptions, PipelineOptions, from_flat


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DataParallelOptions(mode="sgd"), "mode (the data-parallel gradient exchange) must be allreduce or ps"),
        (lambda: DataParallelOptions(algorithm="tree"), "algorithm must be one of auto, ring, hierarchical, doubling"),
        (lambda: DataParallelOptions(compression="int8"), "compression must be None, 'fp16' or 'bf16'"),
        (lambda: DataParallelOptions(overlap_bytes=-1), "overlap_bytes must be a whole number >= 0, got -1"),
        (lambda: DataParallelOptions(sparse_as_dense="yes"), "sparse_as_dense must be True or False"),
        (lambda: DataParallelOptions(shard="params"), "shard must be one of none, optimizer, gradients, parameters"),
        (lambda: DataParallelOptions(mode="ps", shard="optimizer"), "shard='optimizer' needs mode='allreduce'"),
        (lambda: DataParallelOptions(shard="gradients", compression="bf16"), "shard='gradients' reduce-scatters"),
        (lambda: from_flat("hybrid", shard="optimizer", stages=2), "shard: parallelism='data' only"),
        (lambda: PipelineOptions(micro_batches=0), "micro_batches must be a whole number >= 1, got 0"),
        (lambda: PipelineOptions(micro_batches=2.0), "micro_batches must be a whole number >= 1, got 2.0"),
        (lambda: PipelineOptions(schedule="zb"), "schedule must be '1f1b' (the default) or 'gpipe'"),
        (lambda: PipelineOptions(stages=True), "stages must be a whole number >= 1, got True"),
        (lambda: PipelineOptions(placement="balanced"), "placement must be layer-name globs -> pipeline stages"),
        (lambda: PipelineOptions(placement={"fc*": -1}), "placement['fc*'] must be a stage index >= 0, got -1"),
        (lambda: ParallelOptions("ring"), "parallelism must be data, pipeline (or model) or hybrid"),
        (lambda: ParallelOptions(bucket_bytes=0), "bucket_bytes must be a whole number >= 1, got 0"),
        (
            lambda: ParallelOptions("data", pipeline=PipelineOptions(placement={"a": 0})),
            "a placement is for parallelism model or hybrid",
        ),
        (lambda: ParallelOptions("data", pipeline=PipelineOptions(micro_batches=4)), "pipeline options are for"),
        (
            lambda: ParallelOptions("model", data=DataParallelOptions(overlap_bytes=0)),
            "data-parallel options (mode, algorithm, compression, overlap_bytes, ...) need parallelism 'data'",
        ),
        (
            lambda: ParallelOptions(
                "hybrid", data=DataParallelOptions(algorithm="ring"), pipeline=PipelineOptions(stages=2)
            ),
            "algorithm: parallelism='data' only",
        ),
        (lambda: ParallelOptions("hybrid"), "parallelism=hybrid needs a placement"),
        (lambda: from_flat("data", micro_batch=4), "unknown parallel option(s) micro_batch"),
    ],
)
def test_a_value_no_model_can_run_with_is_refused_when_the_options_are_made(make, message):
    with pytest.raises(ValueError) as raised:
        make()
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("options", "workers", "fits", "message"),
    [
        (ParallelOptions("model", pipeline=PipelineOptions(placement={"a": 0, "b": 2})), 2, 3, "placement['b'] = 2"),
        (ParallelOptions("model", pipeline=PipelineOptions(stages=3)), 2, 3, "stages=3 does not fit 2 workers"),
        (ParallelOptions("hybrid", pipeline=PipelineOptions(stages=2)), 3, 4, "use a multiple of 2 workers"),
        (ParallelOptions("hybrid", pipeline=PipelineOptions(placement={"a": 0, "b": 2})), 4, 6, "a 3-stage pipeline"),
    ],
)
def test_what_depends_on_the_job_is_checked_against_its_workers(options, workers, fits, message):
    with pytest.raises(ValueError) as raised:
        options.check_workers(workers)
    assert message in str(raised.value)
    options.check_workers(fits)


def test_options_are_frozen_and_resolved_with_the_defaults_of_the_parts_a_parallelism_runs():
    options = ParallelOptions("pipeline", pipeline=PipelineOptions(placement={"a": 0, "b": 1}, micro_batches=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.bucket_bytes = 1  # type: ignore[misc]
    resolved = options.resolved()
    assert resolved.parallelism == "model" and resolved.data is None and resolved.stages == 2
    assert ParallelOptions().resolved() == ParallelOptions(data=DataParallelOptions())
    assert ParallelOptions("hybrid", pipeline=PipelineOptions(stages=2)).resolved().data == DataParallelOptions()


def test_flat_settings_make_the_same_options_as_objects():
    flat = from_flat("hybrid", mode="ps", bucket_bytes=1 << 20, placement={"a": 0, "b": 1}, micro_batches=2,
                     schedule="gpipe", algorithm="auto", compression=None)  # fmt: skip
    assert flat == ParallelOptions(
        "hybrid",
        bucket_bytes=1 << 20,
        data=DataParallelOptions(mode="ps"),
        pipeline=PipelineOptions(placement={"a": 0, "b": 1}, micro_batches=2, schedule="gpipe"),
    )
    assert from_flat("data", sparse_as_dense=True).data == DataParallelOptions(sparse_as_dense=True)
    with pytest.raises(ValueError, match="is for parallelism model or hybrid"):
        from_flat("data", placement={"a": 0})  # given to the wrong parallelism: refused, not ignored


@pytest.mark.parametrize("group", ["data", "model", "hybrid"])
def test_the_train_apps_parallel_group_instantiates_its_options(group):
    from hydra.utils import instantiate

    from rdkeras.train.config import compose

    overrides = [f"parallel={group}"] + (["parallel.stages=2"] if group == "hybrid" else [])
    cfg = compose(overrides)
    options = instantiate(cfg.parallel, _convert_="all")
    assert isinstance(options, ParallelOptions) and options.parallelism == group
    assert (options.resolved().data is None) == (group == "model")
    assert (options.resolved().pipeline is None) == (group == "data")
    if group != "data":
        assert options.resolved().pipeline.micro_batches == cfg.parallel.micro_batches


def test_rdma_strategy_takes_the_options_or_its_keywords_not_both():
    import rdkeras

    by_keywords = rdkeras.RDMAStrategy(algorithm="ring", overlap_bytes=0)
    try:
        assert by_keywords.options == ParallelOptions(data=DataParallelOptions(algorithm="ring", overlap_bytes=0))
        assert by_keywords.overlap_bytes == 0
    finally:
        by_keywords.close()
    by_options = rdkeras.RDMAStrategy(options=ParallelOptions(data=DataParallelOptions(algorithm="ring")))
    by_options.close()
    with pytest.raises(ValueError, match="either as options=ParallelOptions"):
        rdkeras.RDMAStrategy(algorithm="ring", options=ParallelOptions())
    with pytest.raises(ValueError, match="pipeline options are for parallelism model or hybrid"):
        rdkeras.RDMAStrategy(micro_batches=4)  # a pipeline's keyword for data parallelism: refused, not ignored
