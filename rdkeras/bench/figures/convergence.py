"""The convergence figure: loss (perplexity) against wall-clock time of two real applications, and the time
each transport took to the loss both reach."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rdkeras.bench.figures.common import Section, Target, fmt_x, load_note, markdown_table, pyplot, save_png, section
from rdkeras.bench.labels import LABEL, SEED


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


def steps_to_target(curves: dict[str, list[tuple[float, float]]]) -> dict[str, int]:
    """The step (1-based) at which each run first reached :func:`time_to_target`'s target."""
    target, _ = time_to_target(curves)
    if target is None:
        return {}
    smooth = {t: _batch_losses(c) for t, c in curves.items() if c}
    return {t: next(k for k, (_, v) in enumerate(s, start=1) if v <= target) for t, s in smooth.items()}


def compression_lines(cv: dict) -> tuple[list[str], list[Target]]:
    """The steps float32 and bf16 gradients took to the common target, per task, and the target (bf16 within 5%
    more steps than float32)."""
    rows, targets = [], []
    for task, runs in cv.get("tasks", {}).items():
        if "shm" not in runs or "shm+bf16" not in runs:
            continue
        steps = steps_to_target({t: r["curve"] for t, r in runs.items()})
        ratio = steps["shm+bf16"] / steps["shm"]
        rows.append([task, str(steps["shm"]), str(steps["shm+bf16"]), f"{ratio:.3f}"])
        why = [f"the bf16 run needed {steps['shm+bf16'] - steps['shm']} more steps to the target loss"]
        targets.append(
            Target(f"{task}: bf16 gradients reach the target within 5% more steps", ratio <= 1.05, f"{ratio:.3f}", why)
        )
    header = ["task", "steps to target, float32", "steps to target, bf16 gradients", "bf16 / float32"]
    return (markdown_table(header, rows) if targets else []), targets


def table(cv: dict) -> tuple[list[str], dict[str, Any]]:
    """Time to the common target per task and transport; the speed-up per task."""
    rows: list[list[str | None]] = []
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
        rows.append(
            [
                task,
                "perplexity" if lm else "training loss",
                f"{math.exp(target) if lm else target:.3f}",
                f"{times['shm']:.1f} s",
                f"{times['grpc']:.1f} s",
                fmt_x(speed, 2),
                f"{per_step['shm'] * 1e3:.0f} ms / {per_step['grpc'] * 1e3:.0f} ms",
            ]
        )
    for task, why in cv.get("skipped", {}).items():
        rows.append([task, f"skipped: {why}", None, None, None, None, None])
    times_to = [f"time to target, {LABEL[t]}" for t in ("shm", "grpc")]
    header = ["task", "metric", "target", *times_to, "speed-up", "seconds per step (rdkeras / gRPC)"]
    return markdown_table(header, rows), facts


def plot(cv: dict, path: Path) -> None:
    plt = pyplot()
    tasks = list(cv.get("tasks", {}))
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(5.2 * max(1, len(tasks)), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=False):
        lm = task == "lstm_lm"
        runs = cv["tasks"][task]
        names = {"shm": "rdkeras (shm)", "shm+bf16": "rdkeras (shm), bf16 gradients", "grpc": "gRPC.TCP"}
        for t, color in (("shm", "tab:blue"), ("shm+bf16", "tab:cyan"), ("grpc", "tab:red")):
            if t in runs:
                pts = _batch_losses(runs[t]["curve"])
                ax.plot([p[0] for p in pts], [math.exp(p[1]) if lm else p[1] for p in pts], color=color, label=names[t])
        target, times = time_to_target({t: r["curve"] for t, r in runs.items()})
        if target is not None and "shm" in times and "grpc" in times:
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
    save_png(fig, path)


def render(results: dict, out: Path) -> Section:
    """The section (and convergence.png where a task ran) where convergence was measured; no targets."""
    cv = results.get("convergence")
    if not cv:
        return [], []
    lines, _ = table(cv)
    bf16, targets = compression_lines(cv)
    if bf16:
        lines += [
            "",
            'The same runs with `compression="bf16"` (everywhere: one host): the gradients summed on a bfloat16 '
            "wire change the losses, so the steps to the common target may differ.",
            "",
            *bf16,
        ]
    if cv.get("tasks"):
        plot(cv, out / "convergence.png")
    intro = (
        f"Seed: {SEED['convergence']}. {cv['workers']} workers, batch 32 per worker, "
        "Adam; the same steps on the same data in both runs (so the same losses), so the speed-up is "
        "the time per step. " + load_note(results, "convergence")
    )
    return section("Convergence", intro, lines, "convergence.png"), targets
