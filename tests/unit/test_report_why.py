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


def test_recurrent_models_are_held_to_their_own_undistributed_compute_and_a_miss_is_split():
    gru = {**_run("shm", "allreduce", 0.0508, 0.0443, wait_seconds_per_step=0.0069), "model": "gru"}
    lstm = {**_run("shm", "ps", 0.0459, 0.0532, wait_seconds_per_step=0.0031), "model": "lstm"}
    other = {**_run("rpc+shm", "ps", 0.2, 0.05), "model": "lstm"}  # not rdkeras: not held to it
    (target,) = throughput._recurrent_target({"runs": [gru, lstm, other]})
    assert target.met is False and target.measured == "gru allreduce 0.87×, lstm ps 1.16×"
    # 50.8 ms = 44.3 compute + 6.9 blocked - 0.4 the rest; the LSTM, above 0.9x, gets no line.
    assert target.why == [
        "gru allreduce: 50.8 ms a step = 44.3 ms compute + 6.9 ms blocked on the peer (the exchange and the wait "
        "for the slower worker's compute) + -0.4 ms the rest"
    ]
    assert throughput._recurrent_target({"runs": [other]}) == []
    # Where the exchange ops timed themselves, their work and waits are what the step spent exchanging.
    gru["exchange_seconds_per_step"] = 0.0045
    (target,) = throughput._recurrent_target({"runs": [gru, lstm]})
    assert "+ 4.5 ms inside the exchange ops (" in target.why[0] and "+ 2.0 ms the rest" in target.why[0]


def test_the_data_parallel_step_is_bounded_by_compute_and_the_predicted_exchange():
    def v(model, measured, wait):  # compute 40 ms, exchange 2 ms, fixed cost 1 ms: the bound is 1.05 x 42 ms
        shm = {"model": model, "mode": "allreduce", "transport": "shm", "workers": 2, "compute_s": 0.040}
        return {**shm, "measured_s": measured, "predicted_s": 0.043, "fixed_s": 0.001, "wait_seconds_per_step": wait}

    (target,) = scale_model._step_target([v("a", 0.044, 0.002), v("b", 0.0462, 0.004)])
    assert target.met is False and target.measured == "step ÷ (compute + exchange): a allreduce 1.05, b allreduce 1.10"
    (why,) = target.why
    # Blocked (4 ms, the slower peer included) outlasts the predicted exchange (2 ms): 46.2 = 40 + 4 + 2.2.
    assert why.startswith("b allreduce: 46.2 ms a step = 40.0 ms compute + 4.0 ms exchanging (the larger of")
    assert "predicted 2.0 ms; blocked on the peer 4.0 ms" in why and "+ 2.2 ms beyond both" in why
    (why,) = scale_model._step_target([v("c", 0.0462, 0.0005)])[0].why  # the exchange's own work, not blocked
    assert "= 40.0 ms compute + 2.0 ms exchanging" in why and "+ 4.2 ms beyond both" in why
    # Measured inside the exchange ops (work and waits), that is what it spent exchanging.
    (why,) = scale_model._step_target([{**v("d", 0.0462, 0.0005), "exchange_seconds_per_step": 0.005}])[0].why
    assert "+ 5.0 ms exchanging (measured inside the exchange ops;" in why and "+ 1.2 ms beyond both" in why
    assert scale_model._step_target([v("a", 0.044, 0.002)])[0].met is True
