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


def one_process_line(results: dict) -> str:
    """The summary's comparison with the same training in one process (``results["one_process"]``)."""
    alone = results["one_process"]
    ratio = results["examples_per_s"] / max(alone["examples_per_s"], 1e-9)
    line = (
        f"  vs one process: {alone['examples_per_s']:,.0f} examples/s there (the same training, run after this "
        f"one), so {ratio:.2f}x here"
    )
    if "val_accuracy" in alone["final"]:
        line += f"; held-out accuracy there {alone['final']['val_accuracy']:.3f}"
    return line


def text(
    results: dict, before: dict[str, float], after: dict[str, float], *, synthetic: bool, compared: bool = False
) -> str:
    """The summary of a finished run (printed by the chief, also stored in results.json).

    Args:
        results: The run's results (``workers``, ``steps``, ``batch_size``: the global batch, ``fit_seconds``,
            ``steady_steps`` / ``steady_seconds``: the steps after the first and their time, ``device``,
            ``transport``, ``parallelism``, ``model``; optionally ``one_process`` with a reference
            run's ``examples_per_s``).
        before: This worker's traffic counters when fit started; after: when it ended.
        synthetic: The data is random (inputs and labels), so its metrics mean nothing.
        compared: The same training runs in one process next (its line is added then).
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
    pipeline = results.get("pipeline")
    if pipeline:
        cut = " | ".join(f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0] for names in pipeline["stages"])
        line = f"  pipeline: {cut}; {pipeline['micro_batches']} micro-batches, {pipeline['schedule']}"
        if "expected_speedup" in pipeline:
            costs = " / ".join(f"{c:.1f}" for c in pipeline["compute_ms"])
            line += (f"; automatic cut, stages' measured compute {costs} ms (batches of {pipeline['timed_rows']} "
                     f"rows), expected {pipeline['expected_speedup']:.2f}x one device")  # fmt: skip
        line += f"; activations stashed at most {' / '.join(map(str, pipeline['stashed']))} micro-batches"
        lines.append(line)
    for change in results.get("membership_changes", []):
        who = (f"worker {', '.join(map(str, change['joined']))} joined" if change["joined"]
               else f"lost worker {', '.join(map(str, change['lost']))}")  # fmt: skip
        lines.append(f"  elastic: after step {change['step']}, {who}; {change['workers']} workers went on "
                     f"(re-formed in {change['seconds']:.2f} s)")  # fmt: skip
    final = results.get("final", {})
    held_out = [f"{k.removeprefix('val_')} {v:.3f}" for k, v in final.items() if k.startswith("val_")]
    if held_out and not synthetic:
        lines.append(f"  on the held-out data after the last epoch: {', '.join(held_out)}")
    if workers > 1 and not compared:
        lines.append(
            "  vs one process: not measured in this run (trainer.compare_one_process=true runs the same training "
            "in one process after it)"
        )
    if synthetic:
        lines.append(
            "  the data is random (inputs and labels): loss and accuracy mean nothing here; this run measures speed"
        )
    return "\n".join(lines)
