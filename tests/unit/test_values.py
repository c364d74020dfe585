"""The training config's numbers are checked at load, from one table (rdkeras.train.values): a value no run can use
is one line naming the setting, the value and what is allowed (issue 48)."""

from __future__ import annotations

import numpy as np
import pytest

from rdkeras.data.base import Data
from rdkeras.train import ConfigError, compose
from rdkeras.train.config import validate
from rdkeras.train.values import MAX_BATCH, RULES, SettingError, check


def _config(**settings: object) -> dict:
    """A plain config with `settings` ("trainer.threads": -2) set."""
    out: dict = {}
    for key, value in settings.items():
        node = out
        *path, last = key.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("trainer__optimizer__learning_rate", float("nan"),
         "trainer.optimizer.learning_rate must be a finite number > 0, got nan"),
        ("trainer__optimizer__learning_rate", float("inf"),
         "trainer.optimizer.learning_rate must be a finite number > 0, got inf"),
        ("trainer__optimizer__learning_rate", 0, "trainer.optimizer.learning_rate must be a finite number > 0, got 0"),
        ("trainer__threads", -2, "trainer.threads must be a whole number >= 1 or null (cores / local workers), got -2"),
        ("trainer__threads", 0, "trainer.threads must be a whole number >= 1 or null (cores / local workers), got 0"),
        ("cluster__timeout", -1, "cluster.timeout must be a finite number of seconds > 0 or null (no limit), got -1"),
        ("cluster__timeout", float("inf"),
         "cluster.timeout must be a finite number of seconds > 0 or null (no limit), got inf"),
        ("data__samples", -1, "data.samples must be a whole number >= 1 or null "
         "(trainer.steps_per_epoch x trainer.batch_size), got -1"),
        ("trainer__batch_size", 10**12,
         "trainer.batch_size must be at most 16,777,216 (the global batch, in rows), got 1000000000000"),
        ("trainer__batch_size", 0, "trainer.batch_size must be a whole number >= 1, got 0"),
        ("trainer__batch_size", 32.5, "trainer.batch_size must be a whole number >= 1, got 32.5"),
        ("trainer__epochs", True, "trainer.epochs must be a whole number >= 1, got True"),
        ("trainer__seed", -1, "trainer.seed must be a whole number from 0 to 4,294,967,295, got -1"),
        ("transport__timeout", 0, "transport.timeout must be a finite number of seconds > 0 or null "
         "(RDKERAS_TIMEOUT or 300), got 0"),
        ("transport__heartbeat_timeout", 0.5, "transport.heartbeat_timeout must be 0 (no heartbeat) or a finite "
         "number of seconds >= 1 or null (RDKERAS_HEARTBEAT_TIMEOUT or 30), got 0.5"),
        ("data__validation_fraction", 1.0, "data.validation_fraction must be a number > 0 and < 1, got 1.0"),
        ("model__dropout", -0.1, "model.dropout must be a number >= 0 and < 1, got -0.1"),
        ("model__hidden", -3, "model.hidden must be a whole number >= 1 or null "
         "(the model's default, or the data's size), got -3"),
        ("logger__update_freq", "often", "logger.update_freq must be a whole number >= 1, 'batch' or 'epoch', "
         "got 'often'"),
        # A NaN is refused in any setting, named by the table or not.
        ("trainer__optimizer__momentum", float("nan"),
         "trainer.optimizer.momentum must be a number, got nan (no setting takes nan)"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_the_setting_the_value_and_what_is_allowed(key, value, message):
    with pytest.raises(SettingError) as e:
        check(_config(**{key: value}))
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("trainer__threads", None),
        ("cluster__timeout", 0.5),
        ("transport__heartbeat_timeout", 0),
        ("trainer__batch_size", MAX_BATCH),
        ("trainer__seed", 0),
        ("logger__update_freq", "epoch"),
        ("data__samples", None),
        # A schedule's config is the optimizer's to check.
        ("trainer__optimizer__learning_rate", {"class_name": "ExponentialDecay", "config": {"decay_steps": 10}}),
    ],
)
def test_values_a_run_can_use_pass(key, value):
    check(_config(**{key: value}))


def test_every_rule_names_a_setting_of_a_group_and_a_missing_setting_is_skipped():
    groups = {"cluster", "transport", "trainer", "data", "logger", "model"}
    assert all(key.split(".")[0] in groups for key in RULES)
    check({"model": {"_target_": "some.model"}, "trainer": {}})  # (each model has its own sizes)


def test_the_app_checks_the_values_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"^trainer\.threads must be a whole number >= 1 or null"):
        validate(compose(["trainer.threads=-2"]))
    validate(compose([]))  # the default recipe passes


def test_a_global_batch_larger_than_the_data_is_refused_when_the_data_are_loaded():
    from rdkeras.train.worker import check_batch_size

    data = Data(np.zeros((1347, 64), np.float32), np.zeros(1347, np.int32), description="the digits")
    check_batch_size(1347, data)
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.batch_size=2048 is more than the 1,347 training examples of this data \(the digits\): "
        r"choose at most 1347$",
    ):
        check_batch_size(2048, data)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.remat.mode=fast"], "trainer.remat.mode must be one of none, full, activations, larger_than, "
         "list_of_layers or null (no rematerialization), got 'fast'"),
        (["trainer.remat=fast"], "trainer.remat must be a mapping (mode, output_size_threshold, layer_names) or one "
         "of none, full, activations, larger_than, list_of_layers or null (no rematerialization), got 'fast'"),
        (["trainer.remat.mode=larger_than", "trainer.remat.output_size_threshold=-1"],
         "trainer.remat.output_size_threshold must be a whole number >= 0, got -1"),
        (["trainer.remat.layer_names=dense"], "trainer.remat.layer_names must be a list of layer names, got 'dense'"),
        (["trainer.remat.mode=list_of_layers"], "trainer.remat.mode=list_of_layers recomputes the layers "
         "trainer.remat.layer_names names: name them"),
    ],
)  # fmt: skip
def test_a_bad_remat_setting_names_the_setting_and_the_modes(overrides, message):
    with pytest.raises(ConfigError) as caught:
        validate(compose(overrides))
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("overrides", "scope"),
    [
        ([], None),
        (["trainer.remat.mode=none"], None),
        (["trainer.remat=full"], ("full", 1024, [])),
        (["trainer.remat.mode=larger_than", "trainer.remat.output_size_threshold=4096"], ("larger_than", 4096, [])),
        (["trainer.remat.mode=list_of_layers", "trainer.remat.layer_names=[fc1,fc2]"],
         ("list_of_layers", 1024, ["fc1", "fc2"])),
    ],
)  # fmt: skip
def test_the_remat_setting_gives_the_model_a_remat_scope(overrides, scope):
    from rdkeras.train.worker import remat_scope

    cfg = compose(overrides)
    validate(cfg)
    made = remat_scope(cfg.trainer.remat)
    got = None if scope is None and not hasattr(made, "mode") else (made.mode, made.output_size_threshold,
                                                                     made.layer_names)  # fmt: skip
    assert got == scope
