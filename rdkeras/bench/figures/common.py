"""What the report's figures share: number formats, a section's frame, a table by message size, plots."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rdkeras.bench.labels import MB, STEP_PARTS


class Target(NamedTuple):
    """One line of the report's targets: what, whether it was met (None: reported only), the measured
    value, and under a missed one why (from the step's measured parts)."""

    what: str
    met: bool | None
    measured: str
    why: list[str]


Section = tuple[list[str], list[Target]]  # a figure's lines of the report, and its targets


def fmt_size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // 1024} KB" if n >= 1024 else f"{n} B"


def fmt_x(v: float | None, digits: int = 1) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{digits}f}×"


def fmt_ms(v: float) -> str:
    return f"{v * 1e3:.0f} ms"


def step_parts(record: dict, labels: tuple[str, str, str], fmt: Any) -> str:
    """'label value, ...' for each of STEP_PARTS the record has."""
    pairs = zip(labels, STEP_PARTS, strict=True)
    return ", ".join(f"{label} {fmt(record[k])}" for label, k in pairs if record.get(k) is not None)


def rate_of(runs: list[dict], model: str, mode: str, transport: str, workers: int | None = None) -> float | None:
    """The rate of the first run of this configuration (any worker count where `workers` is None)."""
    for r in runs:
        if (r["model"], r["mode"], r["transport"]) == (model, mode, transport) and (
            workers is None or r["workers"] == workers
        ):
            return r["rate"]
    return None


def load_note(results: dict, part: str) -> str:
    """How loaded the machine was around a figure's measurement ("" where not recorded)."""
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


def section(title: str, intro: str, table: list[str], png: str) -> list[str]:
    """A figure's section of the report: heading, what was measured, its table, its plot."""
    return [f"## {title}", "", intro, "", *table, "", f"![{title}]({png})", ""]


def markdown_table(header: Sequence[str | None], rows: Iterable[Sequence[str | None]]) -> list[str]:
    """A Markdown table's lines: the header, its ``|---|`` line, a line per row of cells. None is a blank cell
    (``| |``); "" keeps both its spaces (``|  |``): the report has always written both, and stays byte for byte."""

    def line(cells: Sequence[str | None]) -> str:
        return "|" + "".join(" |" if c is None else f" {c} |" for c in cells)

    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def size_table(intro: str, first: list[str], rows: list[tuple[list[str], dict[int, str]]]) -> list[str]:
    """A paragraph and a table with a column per message size: `first` names the leading columns; each row
    gives their cells and its cell per size ("–" where it has none). Nothing without rows."""
    if not rows:
        return []
    sizes = sorted({x for _, cells in rows for x in cells})
    body = ([*lead, *(cells.get(x, "–") for x in sizes)] for lead, cells in rows)
    return ["", intro, "", *markdown_table([*first, *map(fmt_size, sizes)], body)]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
