"""Benchmarks: ``python -m rdkeras.bench <name> [--quick]``. Ratios are measured side by side in one run."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse


def pin_one_core() -> None:
    """Pins this rank to a core of its own and TensorFlow to one thread, so per-worker compute is the same in
    every configuration a benchmark compares."""
    import os

    from rdkeras import cluster

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[cluster.resolve().rank % len(cpus)]})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def add_rounds(p: argparse.ArgumentParser, combined: str) -> None:
    """``--rounds N``, as the benches that repeat their configurations declare it: `combined` ends its help,
    saying how the rounds' results make one (this machine's speed drifts between runs)."""
    p.add_argument("--rounds", type=int, default=1, help=f"run every configuration this many times in turn; {combined}")


def step_timer(written: Callable[[], float] | None = None, at_first_timed: Callable[[], object] | None = None) -> Any:
    """A Keras callback that records each training step's seconds (``times``) and loss (``losses``), and the
    bytes `written()` counts (:meth:`rdkeras.introspect.Inspection.bytes_written`) from the third step's start to
    the last step's end (``bytes``: [then, now]): not the start's broadcast of the weights, nor the epoch end's
    merge. `at_first_timed()` runs as the third step begins (the first two trace)."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.losses: list[float] = []
            self.bytes = [0.0, 0.0]

        def on_train_batch_begin(self, step: int, logs: object = None) -> None:
            if step == 2:
                if written is not None:
                    self.bytes[0] = written()
                if at_first_timed is not None:
                    at_first_timed()
            self.began = time.perf_counter()

        def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
            self.times.append(time.perf_counter() - self.began)
            if written is not None:
                self.bytes[1] = written()
            self.losses.append(float((logs or {}).get("loss", float("nan"))))

    return StepTimer()


def cut_after(names: list[str], layer: str) -> dict[str, int]:
    """A 2-stage hand placement: `names` (layers in order) up to `layer` on stage 0, the rest on stage 1."""
    if layer not in names[:-1]:
        where = "is the last layer: stage 1 would be empty" if names and layer == names[-1] else "is not a layer"
        raise SystemExit(
            f"bench: the cut {layer!r} {where}; cut after one of {', '.join(names[:-1])}, or let rdkeras cut ('auto')"
        )
    at = names.index(layer) + 1
    return {name: int(i >= at) for i, name in enumerate(names)}


def run_ranks(bench: str, label: str, target: str, world_size: int, kwargs: dict, **spawn_kwargs: Any) -> Any:
    """Runs ``target`` on `world_size` ranks: their results, or None once the failing rank's output is printed."""
    from rdkeras.launch import spawn_call

    ranks = spawn_call(target, world_size, kwargs, **spawn_kwargs)
    return _checked(bench, label, ranks)


def _checked(bench: str, label: str, ranks: Any) -> Any:
    bad = [r for r in ranks if r.returncode != 0]
    if bad:
        print(f"[{bench}] {label} failed on rank {bad[0].rank}:\n{bad[0].output[-2000:]}")
        return None
    return ranks


def run_ranks_on_hosts(
    bench: str,
    label: str,
    target: str,
    world_size: int,
    kwargs: dict,
    hosts: list[Any],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Any:
    """Like :func:`run_ranks`, with the ranks spread over network namespaces (``rdkeras.testing.netns``
    hosts): the first half on ``hosts[0]``, where rank 0 serves the rendezvous, the rest on ``hosts[1]``."""
    from rdkeras import launch

    port, token = 29400 + secrets.randbelow(2000), secrets.token_hex(16)  # a fresh namespace has every port free
    per_host = -(-world_size // len(hosts))
    commands, envs = [], []
    for rank in range(world_size):
        host = hosts[rank // per_host]
        extra = {"TF_CPP_MIN_LOG_LEVEL": "3", **(env or {}), "RDKERAS_TIMEOUT": str(min(timeout, 300))}
        envs.append(
            launch.worker_env(
                rank,
                world_size,
                port,
                token,
                extra,
                master_addr=hosts[0].addr,
                local_rank=rank % per_host,
                local_world_size=per_host,
            )
        )
        commands.append(host.command(launch.call_command(target, kwargs)))
    return _checked(bench, label, launch.run_workers(commands, envs, timeout=timeout))
