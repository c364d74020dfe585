"""Renders the scalars of a run's TensorBoard event files to one PNG, as TensorBoard's scalar tab shows them.

python -m rdkeras.train.tbplot OUTPUT_DIR/tensorboard scalars.png
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np


def read_run(folder: str | Path) -> dict[str, list[tuple[int, Any]]]:
    """``{tag: [(step, value), ...]}`` of one run folder's event files: float scalars as floats, text
    summaries (the plan) as str. Read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    out: dict[str, list[tuple[int, Any]]] = {}
    for tag in acc.Tags()["tensors"]:
        values: list[tuple[int, Any]] = []
        for e in acc.Tensors(tag):
            proto = e.tensor_proto
            if proto.dtype == 7:  # DT_STRING: a text summary
                values.append((e.step, proto.string_val[0].decode()))
            elif proto.dtype == 1:  # DT_FLOAT: a scalar
                values.append((e.step, float(np.frombuffer(proto.tensor_content, np.float32)[0])))
        if values:
            out[tag] = values
    return out


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{"run/tag": [(step, value), ...]}`` for every float scalar under `log_dir` (one run per subfolder)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for run in sorted(p for p in Path(log_dir).iterdir() if p.is_dir()):
        for tag, values in read_run(run).items():
            if isinstance(values[0][1], float):
                out[f"{run.name}/{tag}"] = values
    return out


def render(log_dir: str | Path, path: str | Path, title: str = "") -> list[str]:
    """Writes the PNG; returns the tags drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = {k: v for k, v in read_scalars(log_dir).items() if len(v) > 1}
    cols = 3
    rows = max(1, math.ceil(len(scalars) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (tag, points) in zip(axes.flat, scalars.items(), strict=False):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, color="#ef6c00", linewidth=1.4)
        ax.set_title(tag, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(scalars) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return list(scalars)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m rdkeras.train.tbplot LOG_DIR OUT.png")
    drawn = render(sys.argv[1], sys.argv[2], title=str(Path(sys.argv[1]).resolve().parent.name))
    print(f"{len(drawn)} scalars -> {sys.argv[2]}")
