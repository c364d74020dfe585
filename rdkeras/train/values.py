"""The training config's numbers, checked at load: a table of setting -> rule.

A value no run can use (a negative count, a NaN learning rate, a timeout of -1) fails before any worker starts,
in one line that names the setting, the value and what is allowed, instead of later as a worker's abort, a raw
NumPy error or a run that trains on NaN. A setting a config does not have is skipped (each model has its own
sizes); a NaN is refused in any setting, whether the table names it or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The largest global batch taken (2**24 rows): far past any real one, and a typo'd 1000000000000 fails at once
# instead of after the data are loaded (the data's own size bounds it again when they are: worker.load_data).
MAX_BATCH = 1 << 24


class SettingError(ValueError):
    """A setting's value no run can use; the message says which, the value and what is allowed."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Rule:
    """What a setting may hold: `allowed` says it in the error, `ok` checks it; ``null`` (None) is allowed where
    `null` says what it means."""

    allowed: str
    ok: Callable[[Any], bool]
    null: str | None = None

    def check(self, key: str, value: Any) -> None:
        if value is None and self.null is not None:
            return
        if not self.ok(value):
            also = f" or null ({self.null})" if self.null is not None else ""
            raise SettingError(f"{key} must be {self.allowed}{also}, got {value!r}")


def whole(low: int, high: int | None = None, null: str | None = None) -> Rule:
    if high is None:
        return Rule(f"a whole number >= {low}", lambda v: _whole(v) and v >= low, null)
    return Rule(f"a whole number from {low} to {high:,}", lambda v: _whole(v) and low <= v <= high, null)


def positive(what: str = "number", null: str | None = None) -> Rule:
    return Rule(f"a finite {what} > 0", lambda v: _number(v) and v > 0, null)


def fraction(low_included: bool) -> Rule:
    if low_included:
        return Rule("a number >= 0 and < 1", lambda v: _number(v) and 0 <= v < 1)
    return Rule("a number > 0 and < 1", lambda v: _number(v) and 0 < v < 1)


def at_most(high: int, why: str) -> Rule:
    return Rule(f"at most {high:,} ({why})", lambda v: not _number(v) or v <= high)


SIZE = whole(1, null="the model's default, or the data's size")
MODEL_SIZES = ("input_dim", "hidden", "num_classes", "image_size", "seq_len", "vocab_size", "embed_dim", "filters",
               "dense", "num_layers", "fc_units")  # fmt: skip
HEARTBEAT = Rule(
    "0 (no heartbeat) or a finite number of seconds >= 1",
    lambda v: v == 0 or (_number(v) and v >= 1),
    null="RDKERAS_HEARTBEAT_TIMEOUT or 30",
)
UPDATE_FREQ = Rule(
    "a whole number >= 1, 'batch' or 'epoch'", lambda v: v in ("batch", "epoch") or (_whole(v) and v >= 1)
)
# keras.RematScope's modes (trainer.remat.mode; "none" and null: no rematerialization).
REMAT_MODES = ("none", "full", "activations", "larger_than", "list_of_layers")
REMAT_MODE = Rule(f"one of {', '.join(REMAT_MODES)}", lambda v: v in REMAT_MODES, null="no rematerialization")
REMAT = Rule(  # trainer.remat=full on the command line: the mode alone
    f"a mapping (mode, output_size_threshold, layer_names) or one of {', '.join(REMAT_MODES)}",
    lambda v: isinstance(v, Mapping) or v in REMAT_MODES,
    null="no rematerialization",
)
LAYER_NAMES = Rule(
    "a list of layer names", lambda v: isinstance(v, (list, tuple)) and all(isinstance(n, str) for n in v)
)
# Setting -> its rules, checked in order (the first that fails is the error).
RULES: dict[str, tuple[Rule, ...]] = {
    "cluster.num_workers": (whole(1),),
    "cluster.timeout": (positive("number of seconds", null="no limit"),),
    "transport.timeout": (positive("number of seconds", null="RDKERAS_TIMEOUT or 300"),),
    "transport.heartbeat_timeout": (HEARTBEAT,),
    "trainer.epochs": (whole(1),),
    "trainer.batch_size": (whole(1), at_most(MAX_BATCH, "the global batch, in rows")),
    "trainer.steps_per_epoch": (whole(1, null="the whole data set"),),
    "trainer.validation_steps": (whole(1, null="the whole validation set"),),
    "trainer.threads": (whole(1, null="cores / local workers"),),
    "trainer.seed": (whole(0, 2**32 - 1),),
    "trainer.verbose": (whole(0, 2),),
    "trainer.remat": (REMAT,),
    "trainer.remat.mode": (REMAT_MODE,),
    "trainer.remat.output_size_threshold": (whole(0),),
    "trainer.remat.layer_names": (LAYER_NAMES,),
    # A schedule's config (a mapping) is the optimizer's to check.
    "trainer.optimizer.learning_rate": (
        Rule("a finite number > 0", lambda v: isinstance(v, Mapping) or (_number(v) and v > 0)),
    ),
    "data.samples": (whole(1, null="trainer.steps_per_epoch x trainer.batch_size"),),
    "data.limit": (whole(1, null="all of them"),),
    "data.test_limit": (whole(1, null="all of them"),),
    "data.validation_fraction": (fraction(low_included=False),),
    "logger.update_freq": (UPDATE_FREQ,),
    **{f"model.{k}": (SIZE,) for k in MODEL_SIZES},
    "model.width": (positive(),),
    "model.dropout": (fraction(low_included=True),),
}


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check(settings: Mapping[str, Any], rules: Mapping[str, tuple[Rule, ...]] = RULES) -> None:
    """Checks a config (a plain nested mapping, its interpolations resolved) against `rules`; raises SettingError
    for the first setting that breaks one, then for the first NaN anywhere."""
    for key, key_rules in rules.items():
        value = _get(settings, key)
        if value is not _ABSENT:
            for rule in key_rules:
                rule.check(key, value)
    for key, value in _flat(settings).items():
        if isinstance(value, float) and math.isnan(value):
            raise SettingError(f"{key} must be a number, got nan (no setting takes nan)")


_ABSENT = object()


def _get(settings: Mapping[str, Any], key: str) -> Any:
    node: Any = settings
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node
