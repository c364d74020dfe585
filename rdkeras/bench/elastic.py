"""Elastic recovery: how long after a worker is killed the survivors' group runs its first step.

    python -m rdkeras.bench elastic [--workers 2,4,8]

For each worker count N, an elastic launch (``--min-workers N-1``) trains an MLP data-parallel with plain
``fit``; the last worker SIGKILLs itself after a given step, in the middle of an epoch. The launcher's agent
records when the group re-formed and when the new group's first step ended; the victim wrote the time of its
kill just before it. Printed per N: the step time before the loss, the time from the kill to the next group's
publication (the survivors noticing the loss, leaving the old group and agreeing on the new one) and to its first
step (a new engine, the state shared from the most advanced survivor, the interrupted step run again).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

KILL_AFTER = 6  # steps before the victim dies (the first epoch has 10)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="2,4,8", help="comma-separated worker counts (each at least 2)")
    p.add_argument("--width", type=int, default=512, help="width of the MLP's hidden layers")
    p.add_argument("--transport", default="shm", help="the engine transport (shm, tcp)")
    p.add_argument("--out", default="bench-results", help="folder for elastic.json")


def worker_main(width: int, batch: int, kill_file: str) -> dict:
    """One worker: trains, and the last one kills itself after step KILL_AFTER (writing the time first)."""
    import os
    import signal
    import time

    import keras
    import numpy as np

    import rdkeras
    from rdkeras import cluster

    me, world = cluster.resolve().rank, cluster.resolve().world_size
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 10, 256)).astype("float32")
    y = rng.integers(0, 10, size=batch * 10)
    step_times: list[float] = []

    class Victim(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.began, self.steps = 0.0, 0

        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            step_times.append(time.perf_counter() - self.began)
            self.steps += 1
            if me == world - 1 and self.steps == KILL_AFTER:
                Path(kill_file).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    strategy = rdkeras.RDMAStrategy()
    with strategy.scope():
        hidden = [keras.layers.Dense(width, activation="relu") for _ in range(3)]
        model = keras.Sequential([keras.Input((256,)), *hidden, keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)  # fmt: skip
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[Victim()])
    before = sorted(step_times[1:KILL_AFTER])
    result = {"worker": me, "world": strategy.num_workers, "params": int(model.count_params()),
              "step_s": before[len(before) // 2] if before else math.nan}  # fmt: skip
    strategy.close()
    return result


def run(args: argparse.Namespace) -> int:
    from rdkeras.launch import ElasticSettings, Job, call_command, run_local

    rows = []
    for n in [int(w) for w in args.workers.split(",") if w.strip()]:
        if n < 2:
            print(f"[elastic] {n} worker(s): a loss needs at least 2; skipped")
            continue
        batch = math.lcm(n, n - 1) * max(1, 32 // math.lcm(n, n - 1))
        print(f"[elastic] {n} workers (min {n - 1}), global batch {batch}, transport {args.transport} ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="rdkeras-elastic-") as tmp:
            kill_file = str(Path(tmp) / "killed-at")
            elastic = ElasticSettings(n - 1)
            command = call_command("rdkeras.bench.elastic:worker_main", {"width": args.width, "batch": batch,
                                                                         "kill_file": kill_file})  # fmt: skip
            # TMPDIR: what the killed worker leaves (TensorFlow's autograph modules) goes with the folder.
            results = run_local(command, Job(n), env={"RDKERAS_TRANSPORT": args.transport, "TMPDIR": tmp},
                                timeout=600, elastic=elastic)  # fmt: skip
            survivors = [r for r in results if r.rank != n - 1]
            if elastic.error or not elastic.changes or any(r.returncode != 0 for r in survivors):
                print(f"[elastic] {n} workers: the job did not go on: {elastic.error or 'no membership change'}")
                for r in results:
                    print(f"  worker {r.rank}: exit {r.returncode}; {''.join(r.tail)[-500:]}")
                return 1
            change = elastic.changes[0]
            killed_at = float(Path(kill_file).read_text())
            value = survivors[0].value
            rows.append(
                {
                    "workers": n,
                    "params": value["params"],
                    "step_s": value["step_s"],
                    "published_s": change.published_at - killed_at,
                    "first_step_s": change.first_step_at - killed_at,
                    "went_on_with": len(change.members),
                }
            )
    print(f"\nElastic recovery: the last worker SIGKILLed after step {KILL_AFTER}, transport {args.transport}, "
          f"an MLP of {rows[0]['params']:,} parameters" if rows else "")  # fmt: skip
    print(f"{'workers':>8} {'step before':>12} {'new group':>10} {'first step':>11}  (seconds after the kill)")
    for row in rows:
        print(f"{row['workers']:>8} {row['step_s']:>12.4f} {row['published_s']:>10.3f} {row['first_step_s']:>11.3f}")
    worst = max((row["first_step_s"] for row in rows), default=math.nan)
    print(f"target: the first step of the new group <= 5 s after the kill: {'met' if worst <= 5 else 'missed'} "
          f"(worst {worst:.2f} s)")  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "elastic.json").write_text(json.dumps(rows, indent=1))
    return 0
