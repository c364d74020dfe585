"""The paper suite's model configurations: recipe sizes, the paper's sizes, per-model step counts."""

from __future__ import annotations

import pytest

from rdkeras.bench import measure, paper


def test_a_model_at_its_published_size_takes_the_papers_config():
    cfgs = measure.model_cfgs(["fcn5", "fcn5@published"], "recipe")
    assert cfgs["fcn5@published"]["input_dim"] == 26752 and cfgs["fcn5@published"]["hidden"] == 2048
    assert cfgs["fcn5"]["input_dim"] != 26752  # the recipe's own size
    assert cfgs["fcn5"]["_target_"] == cfgs["fcn5@published"]["_target_"]
    with pytest.raises(SystemExit, match="@published"):
        measure.model_cfgs(["fcn5@huge"], "recipe")


def test_slow_models_get_their_own_step_counts():
    cfgs = measure.model_cfgs(["lstm", "fcn5@published"], "recipe")
    runs = measure.fit_runs(["lstm", "fcn5@published"], cfgs, ["ps", "allreduce"], 32, 0, {"fcn5@published": (2, 6)})
    assert [(r["mode"], r["model"]) for r in runs] == [
        ("ps", "lstm"), ("ps", "fcn5@published"), ("allreduce", "lstm"), ("allreduce", "fcn5@published")
    ]  # fmt: skip
    assert all((r.get("warmup"), r.get("steps")) == ((2, 6) if "@" in r["model"] else (None, None)) for r in runs)
    assert paper.PRESETS["full"]["models"][-1] == "fcn5@published"  # last: its memory stays out of the others' runs


def test_a_configuration_measured_in_rounds_counts_its_median_round():
    def run(transport, seconds, compute):
        return {"model": "fcn5", "mode": "ps", "transport": transport, "workers": 2, "step_seconds": seconds,
                "compute_s": compute}  # fmt: skip

    measured = [run("shm", 0.7, 0.50), run("grpc", 9.0, 0.45), run("shm", 0.6, 0.47), run("shm", 0.65, 0.48)]
    merged = measure.median_rounds(measured)
    assert [r["transport"] for r in merged] == ["shm", "grpc"]  # in the order first measured
    shm = merged[0]
    assert shm["step_seconds"] == 0.65 and shm["compute_s"] == 0.48  # the median round, whole
    assert shm["rounds"] == [0.7, 0.6, 0.65]
    assert "rounds" not in merged[1]
    assert measure.median_rounds(measured[:1] + measured[2:3])[0]["step_seconds"] == 0.6  # even: the lower
    rounds, again = paper.PRESETS["full"]["rounds"]["fcn5@published"]
    assert rounds >= 3 and set(again) == {"shm", "rpc+shm"}  # the RPC target's model, both sides of it
