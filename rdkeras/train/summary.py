"""The lines a training run ends with: throughput, traffic and waiting per step, in words a person can use."""

from __future__ import annotations

from typing import Any


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def step_timer() -> Any:
    """A Keras callback that times training steps after the first (which includes tracing and compiling)."""
    import time

    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.steps, self.first, self.last = 0, 0.0, 0.0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.steps += 1
            self.last = time.perf_counter()
            if self.steps == 1:
                self.first = self.last

        def steady(self) -> tuple[int, float]:
            """Steps after the first and the seconds they took."""
            return self.steps - 1, self.last - self.first

    return StepTimer()


def measure(strategy: Any) -> dict[str, float]:
    """This worker's traffic counters now (bytes written, received, seconds waited); {} without an engine."""
    engine = getattr(strategy, "engine", None)
    return dict(engine.traffic()) if engine is not None else {}


def text(results: dict, before: dict[str, float], after: dict[str, float], *, synthetic: bool) -> str:
    """The summary of a finished run (printed by the chief, also stored in results.json).

    Args:
        results: The run's results (``workers``, ``steps``, ``batch_size``: the global batch, ``fit_seconds``,
            ``steady_steps`` / ``steady_seconds``: the steps after the first and their time, ``device``,
            ``transport``, ``parallelism``, ``model``; optionally ``one_process`` with a reference
            run's ``examples_per_s``).
        before: This worker's traffic counters when fit started; after: when it ended.
        synthetic: The data is random (inputs and labels), so its metrics mean nothing.
    """
    workers, steps, batch = results["workers"], results["steps"], results["batch_size"]
    timed, seconds = results.get("steady_steps", 0), results.get("steady_seconds", 0.0)
    how = f"steps 2-{timed + 1}, global batch {batch}; the first step compiles"
    if timed < 1 or seconds <= 0:
        timed, seconds = steps, max(results["fit_seconds"], 1e-9)
        how = f"{steps} step(s) of global batch {batch}, compilation included"
    total = timed * batch / seconds
    results["examples_per_s"] = total
    lines = [
        f"summary: {results['model']} on {workers} worker(s), parallelism={results['parallelism']}, "
        f"transport={results['transport']}, device {results['device']}",
        f"  throughput: {total:,.0f} examples/s in total, {total / workers:,.0f} per worker, "
        f"{timed / seconds:.1f} steps/s ({how})",
    ]
    if after and steps:
        sent = (after.get("bytes_written", 0) - before.get("bytes_written", 0)) / steps
        got = (after.get("bytes_received", 0) - before.get("bytes_received", 0)) / steps
        wait = (after.get("wait_seconds", 0) - before.get("wait_seconds", 0)) * 1e3 / steps
        lines.append(f"  per step on the chief: sent {_bytes(sent)}, received {_bytes(got)}, waited {wait:.1f} ms")
    reference = results.get("one_process")
    if reference:
        ratio = total / max(reference["examples_per_s"], 1e-9)
        lines.append(f"  vs one process: {reference['examples_per_s']:,.0f} examples/s there, {ratio:.2f}x here")
    elif workers > 1:
        lines.append("  vs one process: not measured in this run (add cluster.num_workers=1 to measure it)")
    if synthetic:
        lines.append(
            "  the data is random (inputs and labels): loss and accuracy mean nothing here; this run measures speed"
        )
    return "\n".join(lines)
