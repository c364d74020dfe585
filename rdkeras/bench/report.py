"""The paper suite's report: Markdown tables beside the seed's claims, and one PNG per figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rdkeras.bench.labels import LABEL, MB, SEED, STEP_PARTS


def _size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // 1024} KB" if n >= 1024 else f"{n} B"


def _x(v: float | None, digits: int = 1) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{digits}f}×"


def _load(results: dict, part: str) -> str:
    load = results.get("loads", {}).get(part)
    if not load:
        return ""
    b, a = load["before"], load["after"]
    settle = load.get("settle")
    waited = (
        f" It started after {settle['waited_s']:.0f} s waiting for the CPUs to settle ({settle['busy']:.0%} busy then)."
        if settle
        else ""
    )
    return (
        f"Load average (1/5/15 min) {b[0]:.1f}/{b[1]:.1f}/{b[2]:.1f} before, {a[0]:.1f}/{a[1]:.1f}/{a[2]:.1f} "
        f"after, on {results['machine']['cores']} cores; {load['others_before']} other Python/QEMU processes "
        f"running at the start; {load['seconds']:.0f} s.{waited}"
    )


# -- Send/Recv ----------------------------------------------------------------------------------------------


def _section(title: str, intro: str, table: list[str], png: str) -> list[str]:
    """A figure's section of the report: heading, what was measured, its table, its plot."""
    return [f"## {title}", "", intro, "", *table, "", f"![{title}]({png})", ""]


def sendrecv_table(sr: dict) -> tuple[list[str], dict[str, Any]]:
    rows = sr["rows"]
    series = [
        ("grpc", "rpc"),
        ("rpc+tcp", "rpc"),
        ("tcp", "static"),
        ("rpc+shm", "rpc"),
        ("shm", "dynamic"),
        ("shm", "static"),
        ("memcpy", "glibc"),
    ]
    series = [s for s in series if any((r["transport"], r["mode"]) == s for r in rows)]
    sizes = sorted({r["bytes"] for r in rows})
    at = {(r["transport"], r["mode"], r["bytes"]): r for r in rows}
    name = {
        ("shm", "static"): "rdkeras shm static",
        ("shm", "dynamic"): "rdkeras shm dynamic",
        ("tcp", "static"): "rdkeras tcp static",
        ("memcpy", "glibc"): "memcpy (1 core)",
    }
    lines = [
        "| size | " + " | ".join(name.get(s, LABEL.get(s[0], s[0])) for s in series) + " |",
        "|---|" + "---|" * len(series),
    ]
    for size in sizes:
        cells = []
        for s in series:
            r = at.get((*s, size))
            cells.append(f"{r['seconds'] * 1e3:.2f} ms ({r['GBps']:.2f} GB/s)" if r else "–")
        lines.append(f"| {_size(size)} | " + " | ".join(cells) + " |")
    facts: dict[str, Any] = {}
    big = 64 * MB if 64 * MB in sizes else max(sizes)  # the targets are stated at 64 MB
    shm, grpc = at.get(("shm", "static", big)), at.get(("grpc", "rpc", big))
    rpc, tcp, rpct = at.get(("rpc+shm", "rpc", big)), at.get(("tcp", "static", big)), at.get(("rpc+tcp", "rpc", big))
    facts["size"] = big
    if shm and grpc:
        facts["shm_x_grpc"] = grpc["seconds"] / shm["seconds"]
    if shm and rpc:
        facts["shm_x_rpc"] = rpc["seconds"] / shm["seconds"]
    if tcp and rpct:
        facts["tcp_x_rpc"] = rpct["seconds"] / tcp["seconds"]
    if tcp and grpc:
        facts["tcp_x_grpc"] = grpc["seconds"] / tcp["seconds"]
    lat = sr.get("latency", {})
    if lat:
        lsizes = sorted({s for v in lat.values() for s, _ in v})
        lines += [
            "",
            "One-way latency (ping-pong / 2, static channels):",
            "",
            "| transport | " + " | ".join(_size(s) for s in lsizes) + " |",
            "|---|" + "---|" * len(lsizes),
        ]
        for t, v in lat.items():
            d = dict((s, sec) for s, sec in v)
            lines.append(
                f"| {LABEL.get(t, t)} | " + " | ".join(f"{d[s] * 1e6:.1f} µs" if s in d else "–" for s in lsizes) + " |"
            )
    return lines, facts


def plot_sendrecv(sr: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    style = {
        ("grpc", "rpc"): ("gRPC over TCP", "tab:red", "o-"),
        ("rpc+tcp", "rpc"): ("RPC over tcp", "tab:orange", "s--"),
        ("rpc+shm", "rpc"): ("RPC over shm (≈ gRPC.RDMA)", "tab:purple", "s-"),
        ("tcp", "static"): ("rdkeras tcp static", "tab:cyan", "^--"),
        ("shm", "dynamic"): ("rdkeras shm dynamic", "tab:green", "v-"),
        ("shm", "static"): ("rdkeras shm static", "tab:blue", "^-"),
        ("memcpy", "glibc"): ("memcpy limit (1 core)", "k", ":"),
    }
    for key, (label, color, fmt) in style.items():
        pts = sorted((r["bytes"], r["seconds"]) for r in sr["rows"] if (r["transport"], r["mode"]) == key)
        if pts:
            ax.plot([p[0] / MB for p in pts], [p[1] * 1e3 for p in pts], fmt, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["bytes"] / MB for r in sr["rows"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("message size (MB)")
    ax.set_ylabel("time per transfer (ms)")
    ax.set_title(f"Send/Recv between two processes\nseed: {SEED['sendrecv']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)


# -- throughput --------------------------------------------------------------------------------------------


def _rate(runs: list[dict], model: str, mode: str, transport: str, workers: int | None = None) -> float | None:
    for r in runs:
        if (r["model"], r["mode"], r["transport"]) == (model, mode, transport) and (
            workers is None or r["workers"] == workers
        ):
            return r["rate"]
    return None


def throughput_table(th: dict) -> tuple[list[str], dict[str, Any]]:
    runs = [r for r in th["runs"] if r["model"] != "probe"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    transports = [t for t in ("grpc", "rpc+shm", "shm", "tcp", "rpc+tcp") if any(r["transport"] == t for r in runs)]
    lines = [
        "| model | params | gradients/step | mode | Local | "
        + " | ".join(LABEL[t] for t in transports)
        + " | rdkeras ÷ gRPC | rdkeras ÷ RPC |",
        "|---|---|---|---|---|" + "---|" * (len(transports) + 2),
    ]
    facts: dict[str, Any] = {"x_grpc": {}, "x_rpc": {}}
    for m in models:
        first = next(r for r in runs if r["model"] == m)
        for mode in [x for x in ("ps", "allreduce") if any(r["mode"] == x for r in runs)]:
            local = _rate(runs, m, "local", "none")
            rates = {t: _rate(runs, m, mode, t) for t in transports}
            rd = rates.get("shm") or rates.get("tcp")
            grpc, rpc = rates.get("grpc"), rates.get(f"rpc+{'shm' if rates.get('shm') else 'tcp'}")
            xg = rd / grpc if rd and grpc else None
            xr = rd / rpc if rd and rpc else None
            facts["x_grpc"][(m, mode)], facts["x_rpc"][(m, mode)] = xg, xr
            cells = " | ".join(f"{rates[t]:.2f}" if rates[t] else "–" for t in transports)
            lines.append(
                f"| {m} | {first['params'] / 1e6:.1f} M | {first['gradient_bytes'] / 1e6:.1f} MB | {mode} | "
                f"{local:.2f} | {cells} | {_x(xg)} | {_x(xr, 2)} |"
                if local
                else f"| {m} | {first['params'] / 1e6:.1f} M | {first['gradient_bytes'] / 1e6:.1f} MB | {mode} | "
                f"– | {cells} | {_x(xg)} | {_x(xr, 2)} |"
            )
    return lines, facts


def breakdown_table(th: dict, models: list[str]) -> list[str]:
    """Where each step's time went (rank 0, per step): the compute its own processes measured undistributed just
    before it (older results: Local on every core at once), and what the transports measured: time blocked on
    peers, and for RPC its (de)serialization copies and frame writes."""
    runs = th["runs"]
    lines = [
        "| model | mode | transport | step | compute (the same processes, undistributed, before and after) | "
        "blocked on peers | RPC copies | "
        "RPC frames (wire) | rest (Keras/TF hops, reductions, assignments) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
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
            lines.append(
                f"| {m} | {r['mode']} | {LABEL.get(r['transport'], r['transport'])} | {ms(r['step_seconds'])} | "
                f"{ms(compute)} | {ms(wait)} | {ms(copy)} | {ms(wire)} | {ms(rest)} |"
            )
    return lines


def plot_throughput(th: dict, path: Path) -> None:
    plt = _plt()
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
            vals = [_rate(runs, m, mode, t) or 0 for m in models]
            xs = [j + (i - 1) * 0.27 for j in range(len(models))]
            ax.bar(xs, vals, 0.27, label=label, color=color)
            if t == "shm":
                for j, m in enumerate(models):
                    g = _rate(runs, m, mode, "grpc")
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
    _save(fig, path)


# -- convergence -------------------------------------------------------------------------------------------


def _batch_losses(curve: list) -> list[tuple[float, float]]:
    """Per-batch losses from Keras's running epoch mean, smoothed over a window."""
    out, prev = [], 0.0
    for k, (t, mean) in enumerate(curve, start=1):
        out.append((t, mean * k - prev))
        prev = mean * k
    window = max(1, len(out) // 10)
    return [
        (out[i][0], sum(v for _, v in out[max(0, i - window + 1) : i + 1]) / len(out[max(0, i - window + 1) : i + 1]))
        for i in range(len(out))
    ]


def time_to_target(curves: dict[str, list[tuple[float, float]]]) -> tuple[float | None, dict[str, float]]:
    """The target is the highest of the curves' final smoothed losses (every run reaches it); returns it and
    when each run first reached it."""
    smooth = {t: _batch_losses(c) for t, c in curves.items() if c}
    if not smooth:
        return None, {}
    target = max(s[-1][1] for s in smooth.values())
    return target, {t: next(time for time, v in s if v <= target) for t, s in smooth.items()}


def convergence_table(cv: dict) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "| task | metric | target | "
        + " | ".join(f"time to target, {LABEL[t]}" for t in ("shm", "grpc"))
        + " | speed-up | seconds per step (rdkeras / gRPC) |",
        "|---|---|---|---|---|---|---|",
    ]
    facts = {}
    for task, runs in cv.get("tasks", {}).items():
        curves = {t: r["curve"] for t, r in runs.items()}
        target, times = time_to_target(curves)
        if target is None or len(times) < 2:
            continue
        lm = task == "lstm_lm"
        speed = times["grpc"] / times["shm"] if times["shm"] else None
        facts[task] = speed
        per_step = {t: r["curve"][-1][0] / max(1, len(r["curve"]) - 1) for t, r in runs.items()}
        lines.append(
            f"| {task} | {'perplexity' if lm else 'training loss'} | "
            f"{math.exp(target) if lm else target:.3f} | {times['shm']:.1f} s | {times['grpc']:.1f} s | "
            f"{_x(speed, 2)} | {per_step['shm'] * 1e3:.0f} ms / {per_step['grpc'] * 1e3:.0f} ms |"
        )
    for task, why in cv.get("skipped", {}).items():
        lines.append(f"| {task} | skipped: {why} | | | | | |")
    return lines, facts


def plot_convergence(cv: dict, path: Path) -> None:
    plt = _plt()
    tasks = list(cv.get("tasks", {}))
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(5.2 * max(1, len(tasks)), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=False):
        lm = task == "lstm_lm"
        runs = cv["tasks"][task]
        for t, color in (("shm", "tab:blue"), ("grpc", "tab:red")):
            if t in runs:
                pts = _batch_losses(runs[t]["curve"])
                ax.plot(
                    [p[0] for p in pts],
                    [math.exp(p[1]) if lm else p[1] for p in pts],
                    color=color,
                    label=f"{'rdkeras (shm)' if t == 'shm' else 'gRPC.TCP'}",
                )
        target, times = time_to_target({t: r["curve"] for t, r in runs.items()})
        if target is not None and len(times) == 2:
            ax.axhline(math.exp(target) if lm else target, color="0.5", lw=0.8, ls=":")
            ax.set_title(
                f"{task}: {times['grpc'] / times['shm']:.2f}× faster to the same {'perplexity' if lm else 'loss'}",
                fontsize=9,
            )
        ax.set_xlabel("wall-clock time after the first step (s)")
        ax.set_ylabel("perplexity (per character)" if lm else "training loss")
        seed = "1.5-3.3x (Seq2Seq)" if lm else "1.2-2.6x (CIFAR)"
        ax.text(0.98, 0.97, f"seed: {seed}", transform=ax.transAxes, ha="right", va="top", fontsize=7)
        ax.legend(fontsize=7, loc="center right")
        ax.grid(True, alpha=0.3)
    _save(fig, path)


# -- scalability -------------------------------------------------------------------------------------------


def scalability_table(sc: dict, cores: int) -> tuple[list[str], dict[str, Any]]:
    runs = [r for r in sc["runs"] if r["model"] != "probe"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    lines = [
        "| model | workers | Local (1 process) | rdkeras shm, total | gRPC, total | rdkeras ÷ gRPC | note |",
        "|---|---|---|---|---|---|---|",
    ]
    facts: dict[Any, Any] = {}
    for m in models:
        local = _rate(runs, m, "local", "none")
        for n in sc["workers"]:
            if n == 1:
                lines.append(f"| {m} | 1 | {local:.2f} | – | – | – | |" if local else f"| {m} | 1 | – | – | – | – | |")
                continue
            rd, g = _rate(runs, m, sc["mode"], "shm", n), _rate(runs, m, sc["mode"], "grpc", n)
            x = rd / g if rd and g else None
            facts[(m, n)] = x
            note = f"{n} workers on {cores} cores" if n > cores else ""
            lines.append(
                f"| {m} | {n} | {local:.2f} | {rd * n:.2f} | {g * n:.2f} | {_x(x, 2)} | {note} |"
                if rd and g and local
                else f"| {m} | {n} | – | – | – | – | failed |"
            )
    return lines, facts


def plot_scalability(sc: dict, path: Path) -> None:
    plt = _plt()
    runs = [r for r in sc["runs"] if r["model"] != "probe"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models, strict=False):
        ns = [n for n in sc["workers"] if n > 1]
        for t, label, color in (("shm", "rdkeras (shm)", "tab:blue"), ("grpc", "gRPC.TCP", "tab:red")):
            pts = [(n, _rate(runs, m, sc["mode"], t, n)) for n in ns]
            pts = [(n, r * n) for n, r in pts if r]
            local = _rate(runs, m, "local", "none")
            if local:
                pts = [(1, local), *pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
        local = _rate(runs, m, "local", "none")
        if local:
            ax.axhline(local, color="0.4", ls="--", lw=1, label="Local (1 process)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sc["workers"], [str(n) for n in sc["workers"]])
        ax.set_xlabel("workers")
        ax.set_ylabel("mini-batches/s (all workers)")
        seed = {"vgg16": "2.5-3x", "lstm": "about 2x"}.get(m, "")
        ax.set_title(f"{m}, batch 32 per worker (seed: {seed} over gRPC.TCP)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    _save(fig, path)


# -- overlap and the scale model ---------------------------------------------------------------------------


def plot_overlap(ov: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    names = [
        "compute alone",
        "communication alone",
        "allreduce, after backprop",
        "allreduce, overlapped",
        "PS, after backprop",
        "PS, overlapped",
    ]
    keys = [
        "compute_s",
        "comm_s",
        "allreduce_sequential_s",
        "allreduce_overlapped_s",
        "ps_sequential_s",
        "ps_overlapped_s",
    ]
    vals = [ov[k] * 1e3 for k in keys]
    ax.barh(names[::-1], vals[::-1], color=["0.6", "0.6", "tab:red", "tab:blue", "tab:red", "tab:blue"][::-1])
    ax.axvline(ov["max_s"] * 1e3, color="k", ls=":", lw=1, label="max(compute, communication)")
    ax.axvline(ov["sum_s"] * 1e3, color="tab:red", ls=":", lw=1, label="compute + communication")
    ax.set_xlabel("ms per step")
    ax.set_title(f"Overlap on the emulated network\ntcp over a {ov['rate']} veth link, {ov['model']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)  # off the bars
    _save(fig, path)


def plot_scale(sm: dict, path: Path) -> None:
    plt = _plt()
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
    _save(fig, path)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def write(results: dict, out: Path) -> str:
    """report.md and the PNGs; returns the report's text."""
    cmd = results.get("command", "python -m rdkeras.bench paper")
    lines = [
        f"# rdkeras vs the seed's evaluation ({results.get('preset', '?')} run)",
        "",
        f"Command: `{cmd}` ({results.get('seconds', 0) / 60:.1f} minutes). Machine: "
        f"{results.get('machine', {}).get('cores', '?')} cores, no GPU, no RDMA NIC; every ratio below is "
        "measured side by side in this one run.",
        "",
    ]
    targets: list[tuple[str, bool | None, str, list[str]]] = []  # what, met (None: reported), figures, why
    sr = results.get("sendrecv")
    if sr and "rows" in sr:
        table, f = sendrecv_table(sr)
        plot_sendrecv(sr, out / "sendrecv.png")
        lines += _section(
            "Send/Recv",
            f"Seed: {SEED['sendrecv']}. " + _load(results, "sendrecv"),
            table,
            "sendrecv.png",
        )
        size = _size(f["size"])
        if "shm_x_grpc" in f:
            targets.append(
                (
                    f"Send/Recv at {size}: rdkeras shm ≥ 50× gRPC.TCP",
                    f["shm_x_grpc"] >= 50,
                    f"{f['shm_x_grpc']:.1f}×",
                    [],
                )
            )
        if "shm_x_rpc" in f:
            targets.append(
                (
                    f"Send/Recv at {size}: rdkeras shm ≥ 2× RPC over shm",
                    f["shm_x_rpc"] >= 2,
                    f"{f['shm_x_rpc']:.2f}×",
                    [],
                )
            )
        if "tcp_x_rpc" in f:
            targets.append(
                (f"Send/Recv at {size}: rdkeras tcp vs RPC over tcp (reported)", None, f"{f['tcp_x_rpc']:.2f}×", [])
            )
    th = results.get("throughput")
    if th and th.get("runs"):
        table, f = throughput_table(th)
        plot_throughput(th, out / "throughput.png")
        lines += _section(
            "Throughput",
            f"Seed: {SEED['throughput']}. Per-worker mini-batches/s at batch 32 per worker "
            f"(global batch 32 × {th['workers']}), {th['workers']} workers, each pinned to its own core; the "
            "recipes' model sizes (conf/model/*.yaml); NAME@published: the paper's size. "
            + _load(results, "throughput"),
            table,
            "throughput.png",
        )
        for err in th.get("errors", []):
            lines.append(f"- {err}")
        repeated = [r for r in th["runs"] if r.get("rounds")]
        if repeated:
            lines += [
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
        grads = {r["model"]: r["gradient_bytes"] for r in th["runs"] if r["model"] != "probe"}
        biggest = max(grads, key=lambda m: grads[m]) if grads else None
        lines += [
            "Where the step goes (rank 0; the RPC columns are what `rpc+shm` timed itself; blocked time "
            "includes the peer's share of the work):",
            "",
            *breakdown_table(th, sorted({str(biggest), "fcn5", "inception_v3"} & set(grads))),
            "",
        ]
        by_mode = lambda d, model: {mode: v for (m, mode), v in d.items() if m == model and v}  # noqa: E731
        each = lambda d: ", ".join(f"{mode} {v:.2f}×" for mode, v in sorted(d.items()))  # noqa: E731
        # The seed measured FCN-5 at its published size; where that ran, it is the target, the recipe's reported.
        fcn5 = [("fcn5@published", "at its published size"), ("fcn5", "at the recipe's size")]
        fcn5 = [(m, what) for m, what in fcn5 if by_mode(f["x_grpc"], m)]
        for k, (m, what) in enumerate(fcn5):
            fc = by_mode(f["x_grpc"], m)
            ok = min(fc.values()) >= 5 if k == 0 else None
            targets.append((f"fit: FCN-5 {what} ≥ 5× gRPC.TCP (every mode)", ok, each(fc), []))
        xr = by_mode(f["x_rpc"], biggest)
        if xr:
            targets.append(
                (
                    f"fit: {biggest} (largest gradients) ≥ 1.5× RPC over the fast transport (every mode)",
                    min(xr.values()) >= 1.5,
                    each(xr),
                    why_fit_vs_rpc(th, str(biggest), 1.5),
                )
            )
    cv = results.get("convergence")
    if cv:
        table, f = convergence_table(cv)
        if cv.get("tasks"):
            plot_convergence(cv, out / "convergence.png")
        lines += _section(
            "Convergence",
            f"Seed: {SEED['convergence']}. {cv['workers']} workers, batch 32 per worker, "
            "Adam; the same steps on the same data in both runs (so the same losses), so the speed-up is "
            "the time per step. " + _load(results, "convergence"),
            table,
            "convergence.png",
        )
    sc = results.get("scalability")
    if sc and sc.get("runs"):
        table, f = scalability_table(sc, results.get("machine", {}).get("cores", 2))
        plot_scalability(sc, out / "scalability.png")
        lines += _section(
            "Scalability",
            f"Seed: {SEED['scalability']}. Parameter-server mode (the seed's), batch 32 "
            "per worker; total mini-batches/s of all workers. " + _load(results, "scalability"),
            table,
            "scalability.png",
        )
    ov = results.get("overlap")
    if ov:
        lines += ["## Communication overlapping backprop", ""]
        if "skipped" in ov or "error" in ov:
            lines.append(f"Not measured: {ov.get('skipped') or ov.get('error')}")
        else:
            plot_overlap(ov, out / "overlap.png")
            lines += [
                f"Two workers in two network namespaces, tcp over a veth pair capped at {ov['rate']} (tc tbf; "
                f"delay: {ov.get('delay') or 'none'}), {ov['model']} with batch {ov['per_worker_batch']} per "
                f"worker, {ov['buckets']} gradient buckets. " + _load(results, "overlap"),
                "",
                "| | ms per step | ÷ max(compute, comm) | ÷ (compute + comm) |",
                "|---|---|---|---|",
                f"| compute alone | {ov['compute_s'] * 1e3:.0f} | | |",
                f"| communication alone (the same bucketed allreduces) | {ov['comm_s'] * 1e3:.0f} | | |",
            ]
            for mode in ("allreduce", "ps"):
                for label in ("sequential", "overlapped"):
                    v = ov[f"{mode}_{label}_s"]
                    lines.append(
                        f"| {mode}, {'exchange after backprop' if label == 'sequential' else 'overlapped'} | "
                        f"{v * 1e3:.0f} | {v / ov['max_s']:.2f} | {v / ov['sum_s']:.2f} |"
                    )
            for mode in ("allreduce", "ps"):
                b = ov.get(f"{mode}_breakdown") or {}
                if b:
                    lines.append(
                        f"\n{mode}, overlapped, per step (medians, rank 0): the buckets' communication took "
                        f"{b['comm_work_s'] * 1e3:.0f} ms end to end; the first bucket was handed over "
                        f"{b['first_start_to_wait_s'] * 1e3:.0f} ms before backprop ended (the wait op began); "
                        f"{b['hidden_s'] * 1e3:.0f} ms of communication had finished by then, and the wait op "
                        f"blocked {b['exposed_s'] * 1e3:.0f} ms."
                    )
            lines += ["", "![Overlap](overlap.png)", ""]
            targets.append(
                (
                    "overlap (allreduce) within 1.2× of max(compute, comm)",
                    ov["allreduce_overlapped_x_max"] <= 1.2,
                    f"{ov['allreduce_overlapped_x_max']:.2f}×",
                    why_overlap(ov),
                )
            )
    em = results.get("emulated")
    if em:
        lines += ["## Throughput over the emulated network", ""]
        if "skipped" in em:
            lines.append(f"Not measured: {em['skipped']}")
        elif em.get("runs"):
            table, _ = throughput_table({"runs": em["runs"], "workers": 2})
            lines += [f"Two workers in two namespaces, link {em['rate']}.", "", *table, ""]
    sm = results.get("scale_model")
    if sm and "validation" in sm:
        lines += scale_sections(sm)
        if sm.get("sweeps"):
            plot_scale(sm, out / "scale.png")
            lines += ["![Scale model](scale.png)", ""]
        if sm["validation"]:
            worst_run = max(sm["validation"], key=lambda v: abs(v["error"]))
            worst = abs(worst_run["error"])
            targets.append(
                (
                    "scale model predicts the runs measured here within 25%",
                    worst <= 0.25,
                    f"worst {worst * 100:.0f}% ({worst_run['model']} {worst_run['mode']} "
                    f"{LABEL.get(worst_run['transport'], worst_run['transport'])}, {worst_run['workers']} workers), "
                    "median "
                    f"{sorted(abs(v['error']) for v in sm['validation'])[len(sm['validation']) // 2] * 100:.0f}%",
                    why_scale_model(sm["validation"], 0.25),
                )
            )
    if targets:
        lines += ["## Targets", ""]
        for what, ok, detail, why in targets:
            lines.append(f"- [{'met' if ok else 'reported' if ok is None else 'MISSED'}] {what}: {detail}")
            if ok is False:
                lines += [f"  - {w}" for w in why]
        lines.append("")
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


# -- why a target was missed: each from the step's measured parts -----------------------------------------


def _parts(record: dict, labels: tuple[str, str, str], fmt: Any) -> str:
    """'label value, ...' for each of STEP_PARTS the record has."""
    pairs = zip(labels, STEP_PARTS, strict=True)
    return ", ".join(f"{label} {fmt(record[k])}" for label, k in pairs if record.get(k) is not None)


def _ms(v: float) -> str:
    return f"{v * 1e3:.0f} ms"


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
        parts = _parts(rpc, ("blocked", "copies", "frames"), _ms)
        text = (
            f"{mode}: rdkeras {_ms(rd['step_seconds'])} a step = {_ms(rd['compute_s'])} compute + "
            f"{_ms(beyond_rd)} beyond it ({_ms(rd.get('wait_seconds_per_step') or 0.0)} blocked); "
            f"{LABEL.get(rpc['transport'], rpc['transport'])} {_ms(rpc['step_seconds'])} = "
            f"{_ms(rpc['compute_s'])} compute + {_ms(beyond_rpc)} beyond it{f' ({parts})' if parts else ''}. "
            "At equal compute "
            f"({_ms(mean)}, the two runs' mean): {(mean + beyond_rpc) / (mean + beyond_rd):.2f}×"
        )
        free = (mean + beyond_rpc) / mean  # rdkeras spending nothing beyond its compute
        if free < goal:
            text += (
                f"; an rdkeras step spending nothing beyond its compute would make {free:.2f}×: {goal:g}× needs "
                f"RPC to spend {_ms((goal - 1) * mean + goal * beyond_rd)} a step beyond this compute, it spends "
                f"{_ms(beyond_rpc)} (the compute bounds the ratio here, not the exchange)"
            )
        out.append(text + ".")
    return out


def why_overlap(ov: dict) -> list[str]:
    """The overlapped step as compute alone, time blocked on the last buckets, and the rest: backprop slower
    beside the communication than alone."""
    b = ov.get("allreduce_breakdown") or {}
    step, compute = ov["allreduce_overlapped_s"], ov["compute_s"]
    if "exposed_s" not in b:
        return []
    slowed = step - compute - b["exposed_s"]
    return [
        f"the overlapped step {_ms(step)} = compute alone {_ms(compute)} + {_ms(b['exposed_s'])} blocked on the "
        f"last buckets after backprop + {_ms(slowed)} of backprop running slower beside the communication than "
        f"alone (its {_ms(b['comm_work_s'])} of bucket exchanges, {_ms(b['hidden_s'])} of them done before "
        f"backprop ended, share the cores); max(compute, comm) = {_ms(ov['max_s'])}, comm alone "
        f"{_ms(ov['comm_s'])}, the exchange after backprop {_ms(ov['allreduce_sequential_s'])}."
    ]


def why_scale_model(validation: list[dict], within: float) -> list[str]:
    """Each run predicted outside `within`: its step as its own compute plus the rest, measured and predicted,
    beside the spread of the same model's compute measured before its other groups of this run."""
    out = []
    for v in sorted(validation, key=lambda v: -abs(v["error"])):
        if abs(v["error"]) <= within:
            continue
        # One compute a group of processes (a group's modes share it; rounds are groups of their own).
        same = {w["compute_s"] for w in validation if (w["model"], w["workers"]) == (v["model"], v["workers"])}
        parts = _parts(v, ("blocked on peers", "RPC copies", "frames"), lambda x: f"{x * 1e3:.1f} ms")
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


def _size_table(intro: str, first: list[str], rows: list[tuple[list[str], dict[int, str]]]) -> list[str]:
    """A paragraph and a table with a column per message size: `first` names the leading columns; each row
    gives their cells and its cell per size ("–" where it has none). Nothing without rows."""
    if not rows:
        return []
    sizes = sorted({x for _, cells in rows for x in cells})
    return [
        "",
        intro,
        "",
        "| " + " | ".join([*first, *map(_size, sizes)]) + " |",
        "|" + "---|" * (len(first) + len(sizes)),
        *("| " + " | ".join([*lead, *(cells.get(x, "–") for x in sizes)]) + " |" for lead, cells in rows),
    ]


def scale_sections(sm: dict) -> list[str]:
    cal = sm["calibration"]
    lines = [
        "## Scale model",
        "",
        "Calibrated on this run's Send/Recv (per transport: the time of a transfer at each measured size, "
        "interpolated between them; summarised below as a per-message cost a and a per-byte cost b, which the "
        "projection uses), its exchange (both ways at once) and the Local runs' compute times; see "
        "docs/scale-model.md.",
        "",
        "| transport | a (per message) | 1/b (per byte) |",
        "|---|---|---|",
    ]
    for t, c in sorted(cal["transports"].items()):
        lines.append(f"| {LABEL.get(t, t)} | {c['latency_us']:.1f} µs | {c['GBps']:.2f} GB/s |")
    lines.append(f"| memcpy (reduction, assignment) | | {1 / cal['memcpy_per_byte'] / 1e9:.2f} GB/s |")
    exchanges = []
    for t, c in sorted(cal["transports"].items()):
        one, two = dict(c["points"]), dict(c.get("exchange_points", []))
        row = {x: f"{two[x] * 1e3:.2f} ms ({two[x] / one[x]:.2f}× one way)" for x in two if x in one}
        if row:
            exchanges.append(([LABEL.get(t, t)], row))
    lines += _size_table(
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
    lines += _size_table(
        "What one collective between two workers took beyond its transfers and sums (measured, minus what the "
        "exchange curve predicts for them: an RPC ring's concatenations and fresh arrays, the servers' copies); "
        "the predictions add it, interpolated by gradient bytes (never below 0):",
        ["transport", "collective"],
        beyond,
    )
    computes = {m: c for m, c in cal.get("compute_seconds", {}).items() if c.get("all_cores") and m != "probe"}
    if computes:
        lines += [
            "",
            "Compute per step, one process alone and one per core at once (no communication). The predictions use "
            "the compute each distributed run's own processes measured undistributed before and after it (the "
            "validation's compute column), this table's second column where a run has none:",
            "",
            "| model | alone | every core at once | |",
            "|---|---|---|---|",
        ]
        for m, c in computes.items():
            alone, every = c["alone"], c["all_cores"]
            lines.append(f"| {m} | {alone * 1e3:.1f} ms | {every * 1e3:.1f} ms | {every / alone:.2f}× |")
    if sm["validation"]:
        lines += [
            "",
            "Validation: every run measured here, predicted from the calibration alone.",
            "",
            "| model | mode | transport | workers | compute | measured s/step | predicted | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in sm["validation"]:
            compute = f"{v['compute_s'] * 1e3:.1f} ms" if v.get("compute_s") else "–"
            lines.append(
                f"| {v['model']} | {v['mode']} | {LABEL.get(v['transport'], v['transport'])} | {v['workers']} | "
                f"{compute} | {v['measured_s'] * 1e3:.1f} ms | {v['predicted_s'] * 1e3:.1f} ms | "
                f"{v['error'] * 100:+.0f}% |"
            )
    if sm.get("projections"):
        tb = sm["testbed"]
        lines += [
            "",
            f"Projection to the seed's testbed: {tb['workers']} workers, {tb['gpu_tflops']} TFLOP/s GPUs at "
            f"{tb['gpu_efficiency'] * 100:.0f}% of peak, {tb['link_gbps']:g} Gb/s RDMA, TCP at {tb['tcp_gbps']:g} "
            f"Gb/s, {tb['memcpy_gb_per_s']:g} GB/s memcpy per core; the paper's model sizes. Per-worker "
            "mini-batches/s, exchange after backprop (and overlapped):",
            "",
            "| model | mode | compute/step | rdkeras | RPC over RDMA | gRPC.TCP | rdkeras ÷ gRPC.TCP | "
            "rdkeras ÷ RPC over RDMA | seed |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in sm["projections"]:
            r, o = p["rates"], p["rates_overlap"]
            seed = "up to 21× / about 2× (over the three models)" if p["model"] in ("vgg16", "lstm", "fcn5") else ""
            cells = " | ".join(
                f"{r[t]:.2f} ({o[t]:.2f})" if t in r else "–" for t in ("rdkeras", "rpc_rdma", "grpc_tcp")
            )
            xg = r["rdkeras"] / r["grpc_tcp"] if "grpc_tcp" in r else None
            xr = r["rdkeras"] / r["rpc_rdma"] if "rpc_rdma" in r else None
            lines.append(
                f"| {p['model']} | {p['mode']} | {p['compute_s'] * 1e3:.0f} ms | {cells} | {_x(xg)} | "
                f"{_x(xr, 2)} | {seed if p['mode'] == 'ps' else ''} |"
            )
    if sm.get("sweeps"):
        lines += [
            "",
            "Sweep (allreduce, exchange after backprop): per-worker mini-batches/s, rdkeras / RPC over RDMA / "
            "gRPC.TCP.",
            "",
            "| model | " + " | ".join(f"{r['workers']} workers" for r in next(iter(sm["sweeps"].values()))) + " |",
            "|---|" + "---|" * len(next(iter(sm["sweeps"].values()))),
        ]
        for m, rows in sm["sweeps"].items():
            cells = " | ".join(
                " / ".join(f"{r['rates'].get(t, float('nan')):.2f}" for t in ("rdkeras", "rpc_rdma", "grpc_tcp"))
                for r in rows
            )
            lines.append(f"| {m} | {cells} |")
        lines.append("")
    return lines
