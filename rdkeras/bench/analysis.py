"""The scale model applied to a paper run's results: calibrated on its Send/Recv and compute, checked
against every run it measured, and projected to the seed's testbed and larger clusters."""

from __future__ import annotations

import os
from typing import Any

from rdkeras.bench import scale_model
from rdkeras.bench.labels import STEP_PARTS

SWEEP_WORKERS = [8, 64, 256, 1024]


def analyze(results: dict[str, Any], testbed: scale_model.Testbed | None = None) -> dict[str, Any]:
    """The scale model: calibration, validation against every run measured here, projection, sweep."""
    testbed = testbed or scale_model.Testbed()
    sr = results.get("sendrecv")
    if not sr or "rows" not in sr:
        return {"error": "no Send/Recv measurements to calibrate on"}
    cal = scale_model.calibrate(sr)
    cores = results.get("machine", {}).get("cores", os.cpu_count() or 1)
    runs = [r for part in ("throughput", "scalability") for r in (results.get(part) or {}).get("runs", [])]
    compute = {r["model"]: r["step_seconds"] for r in runs if r["transport"] == "none"}
    # A step's compute where every core computes at once (measured so; older results: one process alone).
    loaded = {r["model"]: r["step_seconds"] for r in (results.get("throughput") or {}).get("loaded", [])}
    cal["compute_seconds"] = {m: {"alone": s, "all_cores": loaded.get(m)} for m, s in compute.items()}
    # The fixed cost of a distributed step, per (transport, mode, workers): the probe's step minus its local one.
    fixed = {
        (r["transport"], r["mode"], r["workers"]): max(0.0, r["step_seconds"] - r.get("compute_s", compute["probe"]))
        for r in runs
        if r["model"] == "probe" and r["transport"] != "none" and "probe" in compute
    }
    cal["fixed_step_seconds"] = {f"{t}/{m}/{n}": v for (t, m, n), v in fixed.items()}
    projections, sweeps = _projections(results.get("published_models") or [], cal, testbed)
    return {
        "calibration": cal,
        "cores": cores,
        "validation": _validation(runs, cal, cores, compute, loaded, fixed),
        "testbed": testbed.__dict__,
        "projections": projections,
        "sweeps": sweeps,
    }


def _validation(
    runs: list[dict], cal: dict, cores: int, compute: dict[str, float], loaded: dict[str, float], fixed: dict
) -> list[dict[str, Any]]:
    """Every distributed run measured here (once a configuration) beside its prediction from the calibration."""
    from rdkeras.introspect import BUCKET_BYTES

    validation, seen = [], set()
    for r in runs:
        key = (r["model"], r["mode"], r["transport"], r["workers"])
        if r["transport"] == "none" or r["model"] in ("probe",) or r["model"] not in compute or key in seen:
            continue
        seen.add(key)
        overhead = fixed.get((r["transport"], r["mode"], r["workers"]), 0.0)
        # The compute measured in the run's own processes before and after it, every rank at once (with more ranks
        # than cores: time-shared); older results: one process per core (or alone), shared out by the model.
        step_compute = r.get("compute_s") or loaded.get(r["model"], compute[r["model"]]) * max(
            1.0, r["workers"] / cores
        )
        predicted = scale_model.predict_here(r, step_compute, overhead, cal, cores, BUCKET_BYTES)
        if predicted is None:
            continue
        validation.append(
            {
                "model": r["model"],
                "mode": r["mode"],
                "transport": r["transport"],
                "workers": r["workers"],
                "compute_s": step_compute,
                "measured_s": r["step_seconds"],
                "predicted_s": predicted,
                "fixed_s": overhead,  # of predicted_s: the rest is compute_s and the exchange
                "error": predicted / r["step_seconds"] - 1,
                # Where the measured step went besides compute (what the transports timed, rank 0's).
                **{k: r[k] for k in (*STEP_PARTS, "exchange_seconds_per_step") if r.get(k) is not None},
            }
        )
    return validation


def _projections(
    published: list[dict], cal: dict, testbed: scale_model.Testbed
) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """Each published model on the testbed in both modes, and swept over cluster sizes (allreduce)."""
    projections, sweeps = [], {}
    for m in published:
        for mode in ("ps", "allreduce"):
            p = scale_model.project(m, mode, cal, testbed)
            projections.append(
                {
                    "model": m["name"],
                    "mode": mode,
                    "compute_s": p.compute_s,
                    "comm_s": p.comm_s,
                    "rates": {t: p.rate(t) for t in p.comm_s},
                    "rates_overlap": {t: p.rate(t, overlap=True) for t in p.comm_s},
                }
            )
        sweeps[m["name"]] = scale_model.sweep(m, "allreduce", cal, testbed, SWEEP_WORKERS)
    return projections, sweeps
