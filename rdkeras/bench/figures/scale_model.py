"""The scale model's part of the report: its calibration, its predictions of every run measured here, and
its projection to the seed's testbed and to larger clusters (docs/scale-model.md)."""

from __future__ import annotations

from pathlib import Path

from rdkeras.bench.figures.at_scale import at_scale
from rdkeras.bench.figures.common import (
    Section,
    Target,
    fmt_x,
    markdown_table,
    pyplot,
    save_png,
    size_table,
    step_parts,
)
from rdkeras.bench.labels import LABEL


def _calibration(cal: dict) -> list[str]:
    """Each transport's per-message and per-byte cost, its exchange against one transfer, and what one
    collective cost beyond its transfers, by size."""
    lines = [
        "## Scale model",
        "",
        "Calibrated on this run's Send/Recv (per transport: the time of a transfer at each measured size, "
        "interpolated between them; summarised below as a per-message cost a and a per-byte cost b, which the "
        "projection uses), its exchange (both ways at once) and the Local runs' compute times; see "
        "docs/scale-model.md.",
        "",
    ]
    rows: list[list[str | None]] = [
        [LABEL.get(t, t), f"{c['latency_us']:.1f} µs", f"{c['GBps']:.2f} GB/s"]
        for t, c in sorted(cal["transports"].items())
    ]
    rows.append(["memcpy (reduction, assignment)", None, f"{1 / cal['memcpy_per_byte'] / 1e9:.2f} GB/s"])
    lines += markdown_table(["transport", "a (per message)", "1/b (per byte)"], rows)
    exchanges = []
    for t, c in sorted(cal["transports"].items()):
        one, two = dict(c["points"]), dict(c.get("exchange_points", []))
        row = {x: f"{two[x] * 1e3:.2f} ms ({two[x] / one[x]:.2f}× one way)" for x in two if x in one}
        if row:
            exchanges.append(([LABEL.get(t, t)], row))
    lines += size_table(
        "What the predictions here use: an exchange, both ranks sending x bytes to each other at once (as in "
        "every ring step and parameter-server push or pull), against one transfer of x bytes:",
        ["transport"],
        exchanges,
    )
    beyond = [
        ([LABEL.get(t, t), "ring" if kind == "ring" else "PS"], {x: f"{y * 1e3:+.1f} ms" for x, y in points})
        for t, c in sorted(cal["transports"].items())
        for kind, points in c.get("beyond_transfers", {}).items()
    ]
    lines += size_table(
        "What one collective between two workers took beyond its transfers and sums (measured, minus what the "
        "exchange curve predicts for them: an RPC ring's concatenations and fresh arrays, the servers' copies); "
        "the predictions add it, interpolated by gradient bytes (never below 0):",
        ["transport", "collective"],
        beyond,
    )
    return lines + _compute(cal)


def _compute(cal: dict) -> list[str]:
    computes = {m: c for m, c in cal.get("compute_seconds", {}).items() if c.get("all_cores") and m != "probe"}
    if not computes:
        return []
    lines = [
        "",
        "Compute per step, one process alone and one per core at once (no communication). The predictions use "
        "the compute each distributed run's own processes measured undistributed before and after it (the "
        "validation's compute column), this table's second column where a run has none:",
        "",
    ]
    rows = []
    for m, c in computes.items():
        alone, every = c["alone"], c["all_cores"]
        rows.append([m, f"{alone * 1e3:.1f} ms", f"{every * 1e3:.1f} ms", f"{every / alone:.2f}×"])
    return lines + markdown_table(["model", "alone", "every core at once", None], rows)


def _validation(validation: list[dict]) -> list[str]:
    if not validation:
        return []
    lines = [
        "",
        "Validation: every run measured here, predicted from the calibration alone.",
        "",
    ]
    rows = [
        [
            v["model"],
            v["mode"],
            LABEL.get(v["transport"], v["transport"]),
            str(v["workers"]),
            f"{v['compute_s'] * 1e3:.1f} ms" if v.get("compute_s") else "–",
            f"{v['measured_s'] * 1e3:.1f} ms",
            f"{v['predicted_s'] * 1e3:.1f} ms",
            f"{v['error'] * 100:+.0f}%",
        ]
        for v in validation
    ]
    header = ["model", "mode", "transport", "workers", "compute", "measured s/step", "predicted", "error"]
    return lines + markdown_table(header, rows)


def _projection(sm: dict) -> list[str]:
    if not sm.get("projections"):
        return []
    tb = sm["testbed"]
    lines = [
        "",
        f"Projection to the seed's testbed: {tb['workers']} workers, {tb['gpu_tflops']} TFLOP/s GPUs at "
        f"{tb['gpu_efficiency'] * 100:.0f}% of peak, {tb['link_gbps']:g} Gb/s RDMA, TCP at {tb['tcp_gbps']:g} "
        f"Gb/s, {tb['memcpy_gb_per_s']:g} GB/s memcpy per core; the paper's model sizes. rdkeras pays the PCIe "
        f"copies of its numpy_function hops ({tb['pcie_gb_per_s']:g} GB/s): the gradients off the GPU with the "
        "exchange and the averages back after it, which overlap does not hide. Per-worker mini-batches/s, exchange "
        "after backprop (and overlapped):",
        "",
    ]
    rows = []
    for p in sm["projections"]:
        r, o = p["rates"], p["rates_overlap"]
        seed = "up to 21× / about 2× (over the three models)" if p["model"] in ("vgg16", "lstm", "fcn5") else ""
        cells = [f"{r[t]:.2f} ({o[t]:.2f})" if t in r else "–" for t in ("rdkeras", "rpc_rdma", "grpc_tcp")]
        xg = r["rdkeras"] / r["grpc_tcp"] if "grpc_tcp" in r else None
        xr = r["rdkeras"] / r["rpc_rdma"] if "rpc_rdma" in r else None
        compute = f"{p['compute_s'] * 1e3:.0f} ms"
        rows.append(
            [p["model"], p["mode"], compute, *cells, fmt_x(xg), fmt_x(xr, 2), seed if p["mode"] == "ps" else ""]
        )
    header = [
        "model",
        "mode",
        "compute/step",
        "rdkeras",
        "RPC over RDMA",
        "gRPC.TCP",
        "rdkeras ÷ gRPC.TCP",
        "rdkeras ÷ RPC over RDMA",
        "seed",
    ]
    return lines + markdown_table(header, rows)


def _sweep(sweeps: dict | None) -> list[str]:
    if not sweeps:
        return []
    lines = [
        "",
        "Sweep (allreduce, exchange after backprop): per-worker mini-batches/s, rdkeras / RPC over RDMA / gRPC.TCP.",
        "",
    ]
    header = ["model", *(f"{r['workers']} workers" for r in next(iter(sweeps.values())))]
    rows = [
        [
            m,
            *(
                " / ".join(f"{r['rates'].get(t, float('nan')):.2f}" for t in ("rdkeras", "rpc_rdma", "grpc_tcp"))
                for r in runs
            ),
        ]
        for m, runs in sweeps.items()
    ]
    return [*lines, *markdown_table(header, rows), ""]


def tables(sm: dict) -> list[str]:
    """The scale model's section: calibration, compute, validation, projection and sweep tables."""
    return _calibration(sm["calibration"]) + _validation(sm["validation"]) + _projection(sm) + _sweep(sm.get("sweeps"))


def plot(sm: dict, path: Path) -> None:
    plt = pyplot()
    sweeps = sm.get("sweeps", {})
    fig, axes = plt.subplots(1, max(1, len(sweeps)), figsize=(4.2 * max(1, len(sweeps)), 3.8), squeeze=False)
    for ax, (m, rows) in zip(axes[0], sweeps.items(), strict=False):
        for t, label, color in (
            ("rdkeras", "rdkeras (RDMA)", "tab:blue"),
            ("rpc_rdma", "RPC over RDMA", "tab:purple"),
            ("grpc_tcp", "gRPC.TCP", "tab:red"),
        ):
            pts = [(r["workers"], r["rates"][t]) for r in rows if t in r["rates"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers (P100 + 100 Gb/s IB each)")
        ax.set_ylabel("mini-batches/s per worker")
        ax.set_title(f"{m} (paper size), allreduce, projected", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    save_png(fig, path)


def why_scale_model(validation: list[dict], within: float) -> list[str]:
    """Each run predicted outside `within`: its step as its own compute plus the rest, measured and predicted,
    beside the spread of the same model's compute measured before its other groups of this run."""
    out = []
    for v in sorted(validation, key=lambda v: -abs(v["error"])):
        if abs(v["error"]) <= within:
            continue
        # One compute a group of processes (a group's modes share it; rounds are groups of their own).
        same = {w["compute_s"] for w in validation if (w["model"], w["workers"]) == (v["model"], v["workers"])}
        parts = step_parts(v, ("blocked on peers", "RPC copies", "frames"), lambda x: f"{x * 1e3:.1f} ms")
        out.append(
            f"{v['model']} {v['mode']} {LABEL.get(v['transport'], v['transport'])}, {v['workers']} workers "
            f"({v['error'] * 100:+.0f}%): measured {v['measured_s'] * 1e3:.1f} ms a step = "
            f"{v['compute_s'] * 1e3:.1f} ms compute + {(v['measured_s'] - v['compute_s']) * 1e3:.1f} ms beyond it"
            f"{f' ({parts})' if parts else ''}; "
            f"predicted {(v['predicted_s'] - v['compute_s']) * 1e3:.1f} ms beyond it; this model's compute, "
            f"measured so before each of its {len(same)} groups of {v['workers']} workers in this run: "
            f"{min(same) * 1e3:.1f}-{max(same) * 1e3:.1f} ms."
        )
    return out


def _target(validation: list[dict]) -> Target:
    """The runs measured here predicted within 25%: the worst run and the median error."""
    worst_run = max(validation, key=lambda v: abs(v["error"]))
    worst = abs(worst_run["error"])
    median = sorted(abs(v["error"]) for v in validation)[len(validation) // 2]
    return Target(
        "scale model predicts the runs measured here within 25%",
        worst <= 0.25,
        f"worst {worst * 100:.0f}% ({worst_run['model']} {worst_run['mode']} "
        f"{LABEL.get(worst_run['transport'], worst_run['transport'])}, {worst_run['workers']} workers), "
        f"median {median * 100:.0f}%",
        why_scale_model(validation, 0.25),
    )


def _step_target(validation: list[dict]) -> list[Target]:
    """rdkeras's data-parallel step over shm costs at most its compute + the exchange the scale model predicts
    + 5%, for every model measured; where not, its measured parts name the rest."""
    runs = [v for v in validation if v["transport"] == "shm" and "fixed_s" in v]
    if not runs:
        return []
    bound = {id(v): 1.05 * (v["predicted_s"] - v["fixed_s"]) for v in runs}  # compute + exchange, + 5%
    over = [v for v in runs if v["measured_s"] > bound[id(v)]]
    why = []
    for v in over:
        exchange = v["predicted_s"] - v["fixed_s"] - v["compute_s"]  # this rank's work and its waits
        blocked = v.get("wait_seconds_per_step") or 0.0  # measured: waits only, the slower peer's compute too
        inside = v.get("exchange_seconds_per_step")  # measured inside the exchange ops: work and waits
        spent = inside if inside is not None else max(exchange, blocked)
        how = "measured inside the exchange ops" if inside is not None else "the larger of the two"
        why.append(
            f"{v['model']} {v['mode']}: {v['measured_s'] * 1e3:.1f} ms a step = {v['compute_s'] * 1e3:.1f} ms "
            f"compute + {spent * 1e3:.1f} ms exchanging ({how}; predicted {exchange * 1e3:.1f} ms; blocked on "
            f"the peer {blocked * 1e3:.1f} ms, waits for the slower worker's compute included) + "
            f"{(v['measured_s'] - v['compute_s'] - spent) * 1e3:.1f} ms beyond both (the hops into and out of "
            f"TensorFlow's ops, the assignments, Keras); a distributed step's fixed cost measured with a "
            f"300-parameter model: {v['fixed_s'] * 1e3:.1f} ms"
        )
    return [
        Target(
            "fit: every model's data-parallel step over shm ≤ its compute + the predicted exchange + 5%",
            not over,
            "step ÷ (compute + exchange): "
            + ", ".join(f"{v['model']} {v['mode']} {v['measured_s'] / bound[id(v)] * 1.05:.2f}" for v in runs),
            why,
        )
    ]


def render(results: dict, out: Path) -> Section:
    """The section (and scale.png where it swept cluster sizes) where the scale model was calibrated, and the
    at-scale section where it was projected to clusters of GPU servers."""
    sm = results.get("scale_model") or {}
    lines: list[str] = []
    targets: list[Target] = []
    if "validation" in sm:
        lines = tables(sm)
        if sm.get("sweeps"):
            plot(sm, out / "scale.png")
            lines += ["![Scale model](scale.png)", ""]
        targets = [_target(sm["validation"]), *_step_target(sm["validation"])] if sm["validation"] else []
    if sm.get("at_scale"):
        more, met = at_scale(sm["at_scale"])
        lines, targets = lines + more, targets + met
    return lines, targets
