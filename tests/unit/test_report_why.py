"""The report's reasons for a missed target: each line is arithmetic on the step's measured parts."""

from __future__ import annotations

from rdkeras.bench.figures import overlap, scale_model, throughput


def _run(transport, mode, step, compute, **parts):
    return {"model": "big", "mode": mode, "transport": transport, "step_seconds": step, "compute_s": compute, **parts}


def test_fit_vs_rpc_splits_each_step_into_compute_and_the_rest_and_bounds_the_ratio():
    th = {
        "runs": [
            _run("shm", "allreduce", 0.677, 0.607, wait_seconds_per_step=0.012),
            _run("rpc+shm", "allreduce", 0.917, 0.666, wait_seconds_per_step=0.039, copy_seconds_per_step=0.129),
            _run("shm", "ps", 0.30, 0.10),
            _run("rpc+shm", "ps", 0.60, 0.10),
        ]
    }
    allreduce, ps = throughput.why_fit_vs_rpc(th, "big", 1.5)[::-1]
    # Equal compute: the mean, 636.5 ms; rdkeras 70 ms beyond it, RPC 251 ms: (636.5+251)/(636.5+70) = 1.26.
    assert "607 ms compute + 70 ms beyond it" in allreduce and "666 ms compute + 251 ms beyond it" in allreduce
    assert "blocked 39 ms, copies 129 ms)" in allreduce and ": 1.26×" in allreduce
    # Nothing beyond the compute would give (636.5+251)/636.5 = 1.39x; 1.5x needs 0.5*636.5 + 1.5*70 = 423 ms.
    assert "would make 1.39×" in allreduce and "spend 423 ms a step beyond this compute, it spends 251 ms" in allreduce
    # A configuration whose compute leaves room for the goal gets no bound.
    assert ": 2.00×" in ps and "would make" not in ps and "beyond it." in ps


def test_overlap_step_is_compute_blocked_time_and_compute_slowed_beside_the_exchanges():
    ov = {
        "allreduce_overlapped_s": 2.322,
        "compute_s": 1.856,
        "comm_s": 1.022,
        "max_s": 1.856,
        "allreduce_sequential_s": 3.167,
        "allreduce_breakdown": {"exposed_s": 0.166, "comm_work_s": 1.198, "hidden_s": 1.073},
    }
    (line,) = overlap.why_overlap(ov)
    assert "2322 ms = compute alone 1856 ms + 166 ms blocked" in line and "+ 300 ms of backprop" in line
    assert overlap.why_overlap({**ov, "allreduce_breakdown": {}}) == []


def test_scale_model_names_each_run_beyond_the_bound_with_its_compute_and_that_models_spread():
    def v(transport, mode, measured, predicted, compute, workers=2):
        return {
            "model": "lstm",
            "mode": mode,
            "transport": transport,
            "workers": workers,
            "compute_s": compute,
            "measured_s": measured,
            "predicted_s": predicted,
            "error": predicted / measured - 1,
        }

    validation = [
        {**v("shm", "ps", 0.0711, 0.0509, 0.0497), "wait_seconds_per_step": 0.0035},  # -28%
        v("shm", "allreduce", 0.060, 0.055, 0.0497),  # -8%: within
        v("rpc+shm", "ps", 0.0722, 0.1007, 0.0694),  # +39%
        v("grpc", "ps", 0.20, 0.21, 0.060, workers=4),  # another worker count: not in the spread
    ]
    lines = scale_model.why_scale_model(validation, 0.25)
    assert len(lines) == 2 and lines[0].startswith("lstm ps RPC over shm, 2 workers (+39%)")
    assert "measured 72.2 ms a step = 69.4 ms compute + 2.8 ms beyond it; predicted 31.3 ms beyond it" in lines[0]
    assert "each of its 2 groups of 2 workers in this run: 49.7-69.4 ms" in lines[0]
    assert lines[1].startswith("lstm ps rdkeras shm, 2 workers (-28%)")
    assert "49.7 ms compute + 21.4 ms beyond it (blocked on peers 3.5 ms); predicted 1.2 ms" in lines[1]
