"""The paper suite's report: Markdown tables beside the seed's claims, and one PNG per figure.

Each figure's tables, plot and reasons under a missed target are its own module in
``rdkeras.bench.figures``; :func:`write` puts them together in the order below.
"""

from __future__ import annotations

from pathlib import Path

from rdkeras.bench.figures import convergence, hosts, overlap, scalability, scale_model, sendrecv, throughput
from rdkeras.bench.figures.common import Target

# The report's sections in order: each renders itself (and its PNG) where results.json has its figure.
SECTIONS = (
    sendrecv.render,
    throughput.render,
    convergence.render,
    scalability.render,
    overlap.render,
    hosts.render,
    throughput.render_emulated,
    scale_model.render,
)


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
    targets: list[Target] = []
    for render in SECTIONS:
        section, met = render(results, out)
        lines += section
        targets += met
    lines += _targets(targets)
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def _targets(targets: list[Target]) -> list[str]:
    """Each target met, reported or MISSED, with the reasons under a missed one."""
    if not targets:
        return []
    lines = ["## Targets", ""]
    for what, ok, detail, why in targets:
        lines.append(f"- [{'met' if ok else 'reported' if ok is None else 'MISSED'}] {what}: {detail}")
        if ok is False:
            lines += [f"  - {w}" for w in why]
    lines.append("")
    return lines
