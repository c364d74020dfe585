"""The Parallelism interface (rdkeras/parallel/base.py): what every parallelism shares, without an engine."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import keras
import pytest

from rdkeras.parallel.base import Parallelism
from rdkeras.parallel.data_parallel import DataParallel
from rdkeras.parallel.model_parallel import ModelParallel


class _Partial(Parallelism):
    """A parallelism whose workers hold parts of the state between epochs (as PS and pipelines do)."""

    engine = SimpleNamespace(rank=1, world_size=2)  # type: ignore[assignment]
    replicas = reporter_rank = 0  # type: ignore[assignment]
    models = plan = None  # type: ignore[assignment]
    attach = shard_fit = shard_evaluate = shard_predict = step_overrides = None  # type: ignore[assignment]
    sync_state = gather_state = share_logs = None  # type: ignore[assignment]

    @property
    def _partial_state_between_epochs(self) -> str:
        return "mode='ps'"


def test_data_and_model_parallelism_implement_the_whole_interface():
    abstract = Parallelism.__abstractmethods__
    assert {"attach", "shard_fit", "sync_state", "gather_state", "share_logs", "plan"} <= abstract
    for cls in (DataParallel, ModelParallel):
        assert issubclass(cls, Parallelism) and not inspect.isabstract(cls), cls.__abstractmethods__


def test_a_mid_epoch_checkpoint_is_refused_where_workers_hold_parts_of_the_state():
    partial = _Partial()
    assert not partial.is_reporter and partial.num_workers == 2
    with pytest.raises(ValueError, match=r"save_freq=5\) with mode='ps'.*use save_freq='epoch'"):
        partial.check_callbacks([keras.callbacks.ModelCheckpoint("m.keras", save_freq=5)])
    partial.check_callbacks([keras.callbacks.ModelCheckpoint("m.keras")])  # at epoch ends: allowed
    partial.check_callbacks([keras.callbacks.BackupAndRestore("backup", save_freq=5)])  # gathers first


def test_plan_text_is_empty_before_there_is_a_plan():
    assert _Partial().plan_text() == ""
