"""The Send/Recv figure: time per transfer by message size for each transport, and one-way latency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdkeras.bench.figures.common import (
    Section,
    Target,
    fmt_size,
    load_note,
    markdown_table,
    pyplot,
    save_png,
    section,
)
from rdkeras.bench.labels import LABEL, MB, SEED


def table(sr: dict) -> tuple[list[str], dict[str, Any]]:
    """The table of transfer times by size, the latency table, and the ratios the targets take (at 64 MB)."""
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
    rows = []
    for size in sizes:
        cells = []
        for s in series:
            r = at.get((*s, size))
            cells.append(f"{r['seconds'] * 1e3:.2f} ms ({r['GBps']:.2f} GB/s)" if r else "–")
        rows.append([fmt_size(size), *cells])
    lines = markdown_table(["size", *(name.get(s, LABEL.get(s[0], s[0])) for s in series)], rows)
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
    return lines + _latency_table(sr.get("latency", {})), facts


def _latency_table(lat: dict[str, list]) -> list[str]:
    if not lat:
        return []
    lsizes = sorted({s for v in lat.values() for s, _ in v})
    lines = [
        "",
        "One-way latency (ping-pong / 2, static channels):",
        "",
    ]
    rows = []
    for t, v in lat.items():
        d = dict((s, sec) for s, sec in v)
        rows.append([LABEL.get(t, t), *(f"{d[s] * 1e6:.1f} µs" if s in d else "–" for s in lsizes)])
    return lines + markdown_table(["transport", *map(fmt_size, lsizes)], rows)


def plot(sr: dict, path: Path) -> None:
    plt = pyplot()
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
    save_png(fig, path)


def plot_rows(rows: list[dict], path: Path) -> None:
    """`bench sendrecv`'s own plot: every (transport, mode) of its rows, memcpy dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    series: dict[str, list] = {}
    for row in rows:
        series.setdefault(f"{row['transport']} {row['mode']}".replace("grpc rpc", "gRPC"), []).append(row)
    for label, pts in sorted(series.items()):
        pts.sort(key=lambda x: x["bytes"])
        style: dict[str, Any] = (
            {"linestyle": "--" if "glibc" in label else ":", "color": "k"}
            if label.startswith("memcpy")
            else {"marker": "o"}
        )
        ax.plot([p["bytes"] / MB for p in pts], [p["seconds"] * 1e3 for p in pts], label=label, **style)
    ax.set_xscale("log", base=2)
    ticks = sorted({r["bytes"] / MB for r in rows})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_yscale("log")
    ax.set_xlabel("message size (MB)")
    ax.set_ylabel("time per transfer (ms)")
    ax.set_title("Send/Recv between two processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(results: dict, out: Path) -> Section:
    """The section (and sendrecv.png) where Send/Recv was measured; its targets at 64 MB."""
    sr = results.get("sendrecv")
    if not sr or "rows" not in sr:
        return [], []
    lines, f = table(sr)
    plot(sr, out / "sendrecv.png")
    text = section("Send/Recv", f"Seed: {SEED['sendrecv']}. " + load_note(results, "sendrecv"), lines, "sendrecv.png")
    size = fmt_size(f["size"])
    targets = []
    if "shm_x_grpc" in f:
        x = f["shm_x_grpc"]
        targets.append(Target(f"Send/Recv at {size}: rdkeras shm ≥ 50× gRPC.TCP", x >= 50, f"{x:.1f}×", []))
    if "shm_x_rpc" in f:
        x = f["shm_x_rpc"]
        targets.append(Target(f"Send/Recv at {size}: rdkeras shm ≥ 2× RPC over shm", x >= 2, f"{x:.2f}×", []))
    if "tcp_x_rpc" in f:
        x = f["tcp_x_rpc"]
        targets.append(Target(f"Send/Recv at {size}: rdkeras tcp vs RPC over tcp (reported)", None, f"{x:.2f}×", []))
    return text, targets
