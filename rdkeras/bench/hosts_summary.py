"""The hosts benchmark's rounds summarized: each configuration's median seconds per allreduce and per step, its
speed-up over the flat ring, and where a step's time went (``python -m rdkeras.bench hosts``)."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

# (label, algorithm, compression, transport; None: auto), the flat ring first: the others' speed-ups are over it.
CONFIGS = (
    ("flat ring", "ring", None, None),
    ("auto", "auto", None, None),
    ("auto + bf16", "auto", "bf16", None),
    ("RPC over tcp", "ring", None, "rpc+tcp"),
    ("gRPC", "ring", None, "grpc"),
)
BASELINES = ("RPC over tcp", "gRPC")
BOUNDS = {"auto": 1.5, "auto + bf16": 3.0}  # over the flat ring at a saturated link, 2 hosts x 2

_PER_STEP = ("allreduce", "step", "inside", "cpu", "compute", "compute_cpu", "buckets_one_lane", "buckets_lanes")


def _add_round(row: dict[str, Any], value: dict[str, Any]) -> None:
    """One round of a configuration into its row: the per-step lists extended, the rest (plan, weights)
    replaced, and the round's medians kept for the speed-ups."""
    row["rounds"].append({k: statistics.median(value[k]) for k in ("allreduce", "step") if value.get(k)})
    for key, v in value.items():
        if key in _PER_STEP:
            row.setdefault(key, []).extend(v)
        else:
            row[key] = v


def _speedups(by: dict[str, Any], labels: list[str], what: str, seconds: dict[str, float]) -> dict[str, float]:
    """Each configuration's speed-up over the first: over several rounds, the median of each round's ratio (the
    machine's speed drifts between rounds, less within one); else the ratio of the medians."""
    rounds = min(len(by[label].get("rounds", [])) for label in labels)
    if rounds < 2 or not all(what in r for label in labels for r in by[label]["rounds"]):
        return {label: seconds[labels[0]] / seconds[label] for label in labels}
    first = by[labels[0]]["rounds"]
    return {
        label: statistics.median(first[i][what] / by[label]["rounds"][i][what] for i in range(rounds))
        for label in labels
    }


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Per link and part ("allreduce", "step"): each configuration's median seconds and speed-up over the flat
    ring (:func:`_speedups`); per link and configuration: the largest weight difference from one process."""
    summary: dict[str, Any] = {}
    one = measured.get("one_process")
    for link, by in measured.get("rows", {}).items():
        labels = [c[0] for c in CONFIGS if c[0] in by]
        for what in ("allreduce", "step"):
            if what not in by[labels[0]]:
                continue
            seconds = {label: statistics.median(by[label][what]) for label in labels}
            speedup = _speedups(by, labels, what, seconds)
            summary[f"{link}/{what}"] = {"seconds": seconds, "speedup": speedup}
        if all("compute" in by[label] and "step" in by[label] for label in labels):
            # Where each step goes: its allreduce, the same model's compute alone (every worker at once), and
            # what is left beyond the larger of the two (the exchange not hidden, hops, the update's wait).
            parts = {}
            for label in labels:
                step, exchange, compute = (statistics.median(by[label][k]) for k in ("step", "allreduce", "compute"))
                parts[label] = {"step": step, "allreduce": exchange, "compute": compute,
                                "beyond_sum": step - exchange - compute}  # fmt: skip
                if by[label].get("inside"):  # the step's own exchange ops, timed in the step
                    parts[label]["inside"] = statistics.median(by[label]["inside"])
                for key, cpu in (("step_cpu", by[label].get("cpu")), ("compute_cpu", by[label].get("compute_cpu"))):
                    if cpu:  # the machine's CPU seconds per step, by kind
                        parts[label][key] = {k: statistics.median(c[k] for c in cpu) for k in cpu[0]}
            summary[f"{link}/parts"] = parts
        if one is not None:
            reference = np.asarray(one["weights"])
            summary[f"{link}/weights"] = {
                label: float(np.max(np.abs(np.asarray(by[label]["weights"]) - reference)))
                for label in labels
                if "weights" in by[label]
            }
    return summary


def describe_parts(p: dict[str, Any]) -> str:
    """Where one configuration's step goes (a `summarize` parts entry), in seconds: the step = its allreduce alone
    + the model's compute alone + the rest; then, measured in the step, its exchange ops' time and everything
    else, and the machine's CPU seconds by kind per step against compute alone's."""
    text = (f"step {p['step']:.3f} s = allreduce {p['allreduce']:.3f} + compute {p['compute']:.3f} "
            f"{'+' if p['beyond_sum'] >= 0 else '-'} the rest {abs(p['beyond_sum']):.3f}")  # fmt: skip
    if "inside" in p:
        text += f"; in the step: exchange ops {p['inside']:.3f}, everything else {p['step'] - p['inside']:.3f}"
    for key, what in (("step_cpu", "a step"), ("compute_cpu", "compute alone")):
        if key in p:
            text += f"; {what} kept the cores busy for " + ", ".join(f"{v:.2f} s {k}" for k, v in p[key].items())
    return text
