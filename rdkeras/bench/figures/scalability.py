"""The scalability figure: total mini-batches/s of 1 ... 8 workers in parameter-server mode, rdkeras and gRPC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdkeras.bench.figures.common import Section, fmt_x, load_note, markdown_table, pyplot, rate_of, save_png, section
from rdkeras.bench.labels import SEED


def table(sc: dict, cores: int) -> tuple[list[str], dict[str, Any]]:
    """Total rates per model and worker count; rdkeras's ratio to gRPC per (model, workers)."""
    runs = [r for r in sc["runs"] if r["model"] != "probe"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    rows: list[list[str | None]] = []
    facts: dict[Any, Any] = {}
    for m in models:
        local = rate_of(runs, m, "local", "none")
        for n in sc["workers"]:
            if n == 1:
                rows.append([m, "1", f"{local:.2f}" if local else "–", "–", "–", "–", None])
                continue
            rd, g = rate_of(runs, m, sc["mode"], "shm", n), rate_of(runs, m, sc["mode"], "grpc", n)
            x = rd / g if rd and g else None
            facts[(m, n)] = x
            note = f"{n} workers on {cores} cores" if n > cores else ""
            rows.append(
                [m, str(n), f"{local:.2f}", f"{rd * n:.2f}", f"{g * n:.2f}", fmt_x(x, 2), note]
                if rd and g and local
                else [m, str(n), "–", "–", "–", "–", "failed"]
            )
    header = ["model", "workers", "Local (1 process)", "rdkeras shm, total", "gRPC, total", "rdkeras ÷ gRPC", "note"]
    return markdown_table(header, rows), facts


def plot(sc: dict, path: Path) -> None:
    plt = pyplot()
    runs = [r for r in sc["runs"] if r["model"] != "probe"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models, strict=False):
        ns = [n for n in sc["workers"] if n > 1]
        for t, label, color in (("shm", "rdkeras (shm)", "tab:blue"), ("grpc", "gRPC.TCP", "tab:red")):
            pts = [(n, rate_of(runs, m, sc["mode"], t, n)) for n in ns]
            pts = [(n, r * n) for n, r in pts if r]
            local = rate_of(runs, m, "local", "none")
            if local:
                pts = [(1, local), *pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
        local = rate_of(runs, m, "local", "none")
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
    save_png(fig, path)


def render(results: dict, out: Path) -> Section:
    """The section (and scalability.png) where scalability was measured; no targets."""
    sc = results.get("scalability")
    if not sc or not sc.get("runs"):
        return [], []
    lines, _ = table(sc, results.get("machine", {}).get("cores", 2))
    plot(sc, out / "scalability.png")
    intro = (
        f"Seed: {SEED['scalability']}. Parameter-server mode (the seed's), batch 32 "
        "per worker; total mini-batches/s of all workers. " + load_note(results, "scalability")
    )
    return section("Scalability", intro, lines, "scalability.png"), []
