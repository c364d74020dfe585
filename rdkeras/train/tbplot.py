"""Renders the scalars of a run's TensorBoard event files to one PNG, as TensorBoard's scalar tab shows them.

python -m rdkeras.train.tbplot OUTPUT_DIR/tensorboard scalars.png
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{"run/tag": [(step, value), ...]}`` for every scalar under `log_dir` (one run per subfolder)."""
    from tensorboard.backend.event_processing import event_accumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for run in sorted(p for p in Path(log_dir).iterdir() if p.is_dir()):
        acc = event_accumulator.EventAccumulator(str(run), size_guidance={event_accumulator.TENSORS: 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            events = acc.Tensors(tag)
            if not events or events[0].tensor_proto.dtype != 1:  # DT_FLOAT scalars only (not text, not the model)
                continue
            out[f"{run.name}/{tag}"] = [
                (e.step, float(np.frombuffer(e.tensor_proto.tensor_content, np.float32)[0])) for e in events
            ]
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
