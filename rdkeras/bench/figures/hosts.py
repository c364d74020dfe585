"""The hosts figure: 2 emulated hosts x 2 workers, the flat ring against auto (hierarchical), auto with bf16 and the
baselines' flat rings, an allreduce and a training step, on a shaped link and unshaped."""

from __future__ import annotations

from pathlib import Path

from rdkeras.bench.figures.common import Section, Target, load_note, markdown_table, pyplot, save_png, section
from rdkeras.bench.hosts_summary import BOUNDS, describe_parts, summarize

COLORS = {
    "flat ring": "tab:red",
    "auto": "tab:blue",
    "auto + bf16": "tab:cyan",
    "RPC over tcp": "tab:orange",
    "gRPC": "0.5",
}


def table(summary: dict, links: list[str]) -> list[str]:
    """Seconds per allreduce and per step of each configuration on each link, with its speed-up over the flat
    ring; each float32 run's largest weight difference from one process."""
    labels = list(COLORS)
    rows = []
    for link in links:
        for what in ("allreduce", "step"):
            part = summary.get(f"{link}/{what}")
            if not part:
                continue
            cells = [
                f"{part['seconds'][label]:.3f} s ({part['speedup'][label]:.2f}×)" if label in part["seconds"] else "–"
                for label in labels
            ]
            rows.append([link, what, *cells])
        weights = summary.get(f"{link}/weights")
        if weights:
            cells = [f"{weights[label]:.0e}" if label in weights else "–" for label in labels]
            rows.append([link, "weights − one process's (max)", *cells])
    return markdown_table(["link", "what", *labels], rows)


def plot(summary: dict, links: list[str], path: Path) -> None:
    plt = pyplot()
    parts = [(link, what) for link in links for what in ("allreduce", "step") if f"{link}/{what}" in summary]
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    width = 0.8 / len(COLORS)
    for k, (label, color) in enumerate(COLORS.items()):
        values = [summary[f"{link}/{what}"]["seconds"].get(label, 0.0) for link, what in parts]
        ax.bar([i + k * width for i in range(len(parts))], values, width, color=color, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(parts))], [f"{what}\n{link}" for link, what in parts])
    ax.set_ylabel("seconds")
    ax.set_title("2 emulated hosts x 2 workers (shm inside, tcp between)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    save_png(fig, path)


def targets(summary: dict, link: str) -> list[Target]:
    """Issue 23's at the shaped link: auto's step >= 1.4x the flat ring's, bf16's >= 2.6x, float32 weights equal
    to one process's within 1e-5."""
    step, allreduce = summary.get(f"{link}/step"), summary.get(f"{link}/allreduce")
    out = []
    if step and allreduce:
        for label, goal in (("auto", 1.4), ("auto + bf16", 2.6)):
            if label not in step["speedup"]:
                continue
            x = step["speedup"][label]
            why = [f"the allreduce alone: {allreduce['speedup'][label]:.2f}x (bound {BOUNDS[label]:g}x)"]
            parts = summary.get(f"{link}/parts") or {}
            for k in ("flat ring", label) if parts else ():
                why.append(f"{k}: {describe_parts(parts[k])} (compute: the model alone, every worker at once)")
            out.append(Target(f"{link}: {label} step >= {goal}x the flat ring's", x >= goal, f"{x:.2f}x", why))
    weights = summary.get(f"{link}/weights")
    if weights:
        worst = max(v for k, v in weights.items() if k != "auto + bf16")
        out.append(
            Target(f"{link}: float32 runs' weights equal one process's within 1e-5", worst <= 1e-5, f"{worst:.0e}", [])
        )
    return out


def render(results: dict, out: Path) -> Section:
    """The section (and hosts.png) where the hosts figure was measured."""
    measured = results.get("hosts")
    if not measured:
        return [], []
    if "rows" not in measured:
        reason = measured.get("skipped") or measured.get("error")
        return [f"## Across hosts\n\nNot measured: {reason}\n"], []
    summary = summarize(measured)
    links = list(measured["rows"])
    plot(summary, links, out / "hosts.png")
    intro = (
        f"Two network namespaces on one switch stand for two hosts of 2 workers each; {measured['mb']:g} MB of "
        f"float32 gradients (a Dense 2048→4096→2048 model); medians of {measured['reps']}. rdkeras runs shm inside "
        "a host and tcp between (`auto`'s choice); the baselines run their flat rings over the same link. "
        "Speed-ups are over rdkeras's flat ring. " + load_note(results, "hosts")
    )
    shaped = next((link for link in links if link != "unshaped"), None)
    met = targets(summary, shaped) if shaped else []
    return section("Across hosts", intro, table(summary, links), "hosts.png"), met
