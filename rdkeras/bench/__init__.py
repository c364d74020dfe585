"""Benchmarks: ``python -m rdkeras.bench <name> [--quick]``. Ratios are measured side by side in one run."""

from __future__ import annotations

from typing import Any


def run_ranks(bench: str, label: str, target: str, world_size: int, kwargs: dict, **spawn_kwargs: Any) -> Any:
    """Runs ``target`` on `world_size` ranks: their results, or None once the failing rank's output is printed."""
    from rdkeras.launch import spawn_call

    ranks = spawn_call(target, world_size, kwargs, **spawn_kwargs)
    bad = [r for r in ranks if r.returncode != 0]
    if bad:
        print(f"[{bench}] {label} failed on rank {bad[0].rank}:\n{bad[0].output[-2000:]}")
        return None
    return ranks
