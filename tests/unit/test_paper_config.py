"""The paper suite's model configurations: recipe sizes, the paper's sizes, per-model step counts."""

from __future__ import annotations

import pytest

from rdkeras.bench import paper


def test_a_model_at_its_published_size_takes_the_papers_config():
    cfgs = paper._model_cfgs(["fcn5", "fcn5@published"], "recipe")
    assert cfgs["fcn5@published"]["input_dim"] == 26752 and cfgs["fcn5@published"]["hidden"] == 2048
    assert cfgs["fcn5"]["input_dim"] != 26752  # the recipe's own size
    assert cfgs["fcn5"]["_target_"] == cfgs["fcn5@published"]["_target_"]
    with pytest.raises(SystemExit, match="@published"):
        paper._model_cfgs(["fcn5@huge"], "recipe")


def test_slow_models_get_their_own_step_counts():
    cfgs = paper._model_cfgs(["lstm", "fcn5@published"], "recipe")
    runs = paper._runs(["lstm", "fcn5@published"], cfgs, ["ps", "allreduce"], 32, 0, {"fcn5@published": (2, 6)})
    assert [(r["mode"], r["model"]) for r in runs] == [
        ("ps", "lstm"), ("ps", "fcn5@published"), ("allreduce", "lstm"), ("allreduce", "fcn5@published")
    ]  # fmt: skip
    assert all((r.get("warmup"), r.get("steps")) == ((2, 6) if "@" in r["model"] else (None, None)) for r in runs)
    assert paper.PRESETS["full"]["models"][-1] == "fcn5@published"  # last: its memory stays out of the others' runs
