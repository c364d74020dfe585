"""The throughput figure: per-worker mini-batches/s of each model over each transport, where each step's
time went, and the same table over the emulated network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdkeras.bench.figures.common import (
    Section,
    Target,
    fmt_ms,
    fmt_x,
    load_note,
    markdown_table,
    pyplot,
    rate_of,
    save_png,
    section,
    step_parts,
)
from rdkeras.bench.labels import LABEL, SEED


def table(th: dict) -> tuple[list[str], dict[str, Any]]:
    """The rates and, per (model, mode), rdkeras's ratio to gRPC (``x_grpc``) and to RPC (``x_rpc``)."""
    runs = [r for r in th["runs"] if r["model"] != "probe"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    transports = [t for t in ("grpc", "rpc+shm", "shm", "tcp", "rpc+tcp") if any(r["transport"] == t for r in runs)]
    rows = []
    facts: dict[str, Any] = {"x_grpc": {}, "x_rpc": {}}
    for m in models:
        first = next(r for r in runs if r["model"] == m)
        for mode in [x for x in ("ps", "allreduce") if any(r["mode"] == x for r in runs)]:
            local = rate_of(runs, m, "local", "none")
            rates = {t: rate_of(runs, m, mode, t) for t in transports}
            rd = rates.get("shm") or rates.get("tcp")
            grpc, rpc = rates.get("grpc"), rates.get(f"rpc+{'shm' if rates.get('shm') else 'tcp'}")
            xg = rd / grpc if rd and grpc else None
            xr = rd / rpc if rd and rpc else None
            facts["x_grpc"][(m, mode)], facts["x_rpc"][(m, mode)] = xg, xr
            model_size = [f"{first['params'] / 1e6:.1f} M", f"{first['gradient_bytes'] / 1e6:.1f} MB"]
            cells = [f"{rates[t]:.2f}" if rates[t] else "–" for t in transports]
            rows.append([m, *model_size, mode, f"{local:.2f}" if local else "–", *cells, fmt_x(xg), fmt_x(xr, 2)])
    header = ["model", "params", "gradients/step", "mode", "Local", *(LABEL[t] for t in transports)]
    return markdown_table([*header, "rdkeras ÷ gRPC", "rdkeras ÷ RPC"], rows), facts


def breakdown_table(th: dict, models: list[str]) -> list[str]:
    """Where each step's time went (rank 0, per step): the compute its own processes measured undistributed just
    before it (older results: Local on every core at once), and what the transports measured: time blocked on
    peers, and for RPC its (de)serialization copies and frame writes."""
    runs = th["runs"]
    rows = []
    loaded = {r["model"]: r["step_seconds"] for r in th.get("loaded", [])}
    for m in models:
        local = next((r["step_seconds"] for r in runs if r["model"] == m and r["transport"] == "none"), None)
        local = loaded.get(m, local)  # the compute of a step while the other workers compute too
        for r in runs:
            if r["model"] != m or r["transport"] == "none" or local is None:
                continue
            compute = r.get("compute_s", local)  # measured in the run's own processes before and after it
            wait = r.get("wait_seconds_per_step", 0.0)
            copy, wire = r.get("copy_seconds_per_step"), r.get("wire_seconds_per_step")
            rest = r["step_seconds"] - compute - wait - (copy or 0) - (wire or 0)
            ms = lambda v: f"{v * 1e3:.1f} ms" if v is not None else "–"  # noqa: E731
            transport = LABEL.get(r["transport"], r["transport"])
            rows.append([m, r["mode"], transport, *map(ms, (r["step_seconds"], compute, wait, copy, wire, rest))])
    header = [
        "model",
        "mode",
        "transport",
        "step",
        "compute (the same processes, undistributed, before and after)",
        "blocked on peers",
        "RPC copies",
        "RPC frames (wire)",
        "rest (Keras/TF hops, reductions, assignments)",
    ]
    return markdown_table(header, rows)


def plot(th: dict, path: Path) -> None:
    plt = pyplot()
    runs = [r for r in th["runs"] if r["model"] != "probe"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    modes = [x for x in ("ps", "allreduce") if any(r["mode"] == x for r in runs)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 4.4), squeeze=False)
    bars = [
        ("grpc", "gRPC.TCP", "tab:red"),
        ("rpc+shm", "RPC over shm (≈ gRPC.RDMA)", "tab:purple"),
        ("shm", "rdkeras (shm)", "tab:blue"),
    ]
    for ax, mode in zip(axes[0], modes, strict=True):
        for i, (t, label, color) in enumerate(bars):
            vals = [rate_of(runs, m, mode, t) or 0 for m in models]
            xs = [j + (i - 1) * 0.27 for j in range(len(models))]
            ax.bar(xs, vals, 0.27, label=label, color=color)
            if t == "shm":
                for j, m in enumerate(models):
                    g = rate_of(runs, m, mode, "grpc")
                    if g and vals[j]:
                        ax.annotate(f"{vals[j] / g:.1f}×", (xs[j], vals[j]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(models)), models, rotation=25, ha="right")  # long names (fcn5@published) overlap
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.set_ylabel("mini-batches/s per worker")
        ax.set_title(
            f"{th['workers']} workers, batch 32 per worker, {'parameter servers' if mode == 'ps' else 'allreduce'}",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper left", ncol=3)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Throughput (seed: {SEED['throughput']})", fontsize=8)
    save_png(fig, path)


def why_fit_vs_rpc(th: dict, model: str, goal: float) -> list[str]:
    """rdkeras against RPC over the same transport for `model`, per mode: each step as compute (measured in the
    run's own processes before and after it) plus what it spent beyond it, and what those give at equal compute."""
    out = []
    for mode in ("ps", "allreduce"):
        runs = {r["transport"]: r for r in th["runs"] if (r["model"], r["mode"]) == (model, mode)}
        rd = runs.get("shm") or runs.get("tcp")
        rpc = rd and runs.get(f"rpc+{rd['transport']}")
        if not rd or not rpc or not rd.get("compute_s") or not rpc.get("compute_s"):
            continue
        beyond_rd = max(0.0, rd["step_seconds"] - rd["compute_s"])
        beyond_rpc = rpc["step_seconds"] - rpc["compute_s"]
        mean = (rd["compute_s"] + rpc["compute_s"]) / 2
        parts = step_parts(rpc, ("blocked", "copies", "frames"), fmt_ms)
        text = (
            f"{mode}: rdkeras {fmt_ms(rd['step_seconds'])} a step = {fmt_ms(rd['compute_s'])} compute + "
            f"{fmt_ms(beyond_rd)} beyond it ({fmt_ms(rd.get('wait_seconds_per_step') or 0.0)} blocked); "
            f"{LABEL.get(rpc['transport'], rpc['transport'])} {fmt_ms(rpc['step_seconds'])} = "
            f"{fmt_ms(rpc['compute_s'])} compute + {fmt_ms(beyond_rpc)} beyond it{f' ({parts})' if parts else ''}. "
            "At equal compute "
            f"({fmt_ms(mean)}, the two runs' mean): {(mean + beyond_rpc) / (mean + beyond_rd):.2f}×"
        )
        free = (mean + beyond_rpc) / mean  # rdkeras spending nothing beyond its compute
        if free < goal:
            text += (
                f"; an rdkeras step spending nothing beyond its compute would make {free:.2f}×: {goal:g}× needs "
                f"RPC to spend {fmt_ms((goal - 1) * mean + goal * beyond_rd)} a step beyond this compute, it spends "
                f"{fmt_ms(beyond_rpc)} (the compute bounds the ratio here, not the exchange)"
            )
        out.append(text + ".")
    return out


def _rounds_note(th: dict) -> list[str]:
    """The configurations measured in several rounds, each round's step time."""
    repeated = [r for r in th["runs"] if r.get("rounds")]
    if not repeated:
        return []
    return [
        "Measured in rounds on fresh processes, interleaved with the other transports' (the table counts "
        "each configuration's median round): "
        + "; ".join(
            f"{r['model']} {r['mode']} {LABEL.get(r['transport'], r['transport'])} "
            + " / ".join(f"{x * 1e3:.0f}" for x in r["rounds"])
            + " ms a step"
            for r in repeated
        )
        + ".",
        "",
    ]


def _targets(th: dict, facts: dict[str, Any], biggest: str | None) -> list[Target]:
    """FCN-5 against gRPC (at its published size where that ran; the recipe's reported), and the model with
    the largest gradients against RPC over the same transport."""
    by_mode = lambda d, model: {mode: v for (m, mode), v in d.items() if m == model and v}  # noqa: E731
    each = lambda d: ", ".join(f"{mode} {v:.2f}×" for mode, v in sorted(d.items()))  # noqa: E731
    targets = []
    fcn5 = [("fcn5@published", "at its published size"), ("fcn5", "at the recipe's size")]
    fcn5 = [(m, what) for m, what in fcn5 if by_mode(facts["x_grpc"], m)]
    for k, (m, what) in enumerate(fcn5):
        fc = by_mode(facts["x_grpc"], m)
        ok = min(fc.values()) >= 5 if k == 0 else None
        targets.append(Target(f"fit: FCN-5 {what} ≥ 5× gRPC.TCP (every mode)", ok, each(fc), []))
    xr = by_mode(facts["x_rpc"], biggest)
    if xr:
        targets.append(
            Target(
                f"fit: {biggest} (largest gradients) ≥ 1.5× RPC over the fast transport (every mode)",
                min(xr.values()) >= 1.5,
                each(xr),
                why_fit_vs_rpc(th, str(biggest), 1.5),
            )
        )
    return targets


def render(results: dict, out: Path) -> Section:
    """The section (and throughput.png) where throughput was measured, with where each step went."""
    th = results.get("throughput")
    if not th or not th.get("runs"):
        return [], []
    rates, facts = table(th)
    plot(th, out / "throughput.png")
    lines = section(
        "Throughput",
        f"Seed: {SEED['throughput']}. Per-worker mini-batches/s at batch 32 per worker "
        f"(global batch 32 × {th['workers']}), {th['workers']} workers, each pinned to its own core; the "
        "recipes' model sizes (conf/model/*.yaml); NAME@published: the paper's size. "
        + load_note(results, "throughput"),
        rates,
        "throughput.png",
    )
    lines += [f"- {err}" for err in th.get("errors", [])]
    lines += _rounds_note(th)
    grads = {r["model"]: r["gradient_bytes"] for r in th["runs"] if r["model"] != "probe"}
    biggest = max(grads, key=lambda m: grads[m]) if grads else None
    lines += [
        "Where the step goes (rank 0; the RPC columns are what `rpc+shm` timed itself; blocked time "
        "includes the peer's share of the work):",
        "",
        *breakdown_table(th, list(grads)),
        "",
    ]
    return lines, [*_targets(th, facts, biggest), *_recurrent_target(th)]


RECURRENT = ("gru", "lstm")


def _recurrent_target(th: dict) -> list[Target]:
    """GRU and LSTM on rdkeras (every mode) at >= 0.9x the throughput of the same processes undistributed,
    every rank computing at once (the run's compute_s, measured before and after it)."""
    rdkeras = ("shm", "tcp")
    runs = [r for r in th["runs"] if r["model"] in RECURRENT and r["transport"] in rdkeras and r.get("compute_s")]
    if not runs:
        return []
    ratio = {(r["model"], r["mode"]): r["compute_s"] / r["step_seconds"] for r in runs}
    why = []
    for r in runs:
        if ratio[(r["model"], r["mode"])] >= 0.9:
            continue
        inside = r.get("exchange_seconds_per_step")  # the exchange ops' work and waits, where measured
        spent = inside if inside is not None else r.get("wait_seconds_per_step") or 0.0
        what = "inside the exchange ops" if inside is not None else "blocked on the peer"
        why.append(
            f"{r['model']} {r['mode']}: {r['step_seconds'] * 1e3:.1f} ms a step = {r['compute_s'] * 1e3:.1f} ms "
            f"compute + {spent * 1e3:.1f} ms {what} (the exchange and the wait for the slower worker's compute) + "
            f"{(r['step_seconds'] - r['compute_s'] - spent) * 1e3:.1f} ms the rest"
        )
    return [
        Target(
            "fit: GRU and LSTM per worker ≥ 0.9× the same processes undistributed, every core computing",
            min(ratio.values()) >= 0.9,
            ", ".join(f"{m} {mode} {v:.2f}×" for (m, mode), v in sorted(ratio.items())),
            why,
        )
    ]


def render_emulated(results: dict, out: Path) -> Section:
    """The throughput table over the emulated network, where that ran (no plot, no targets)."""
    em = results.get("emulated")
    if not em:
        return [], []
    lines = ["## Throughput over the emulated network", ""]
    if "skipped" in em:
        lines.append(f"Not measured: {em['skipped']}")
    elif em.get("runs"):
        rates, _ = table({"runs": em["runs"], "workers": 2})
        lines += [f"Two workers in two namespaces, link {em['rate']}.", "", *rates, ""]
    return lines, []
