"""The memory bench under a per-process cap: a GPT-2 that one process cannot train within M MB trains on 4 workers
with ``shard="parameters"``, each within the same M MB.

    python -m rdkeras.bench memory --oom-demo            # the model size and cap measured to show it here
    python -m rdkeras.bench memory --cap-mb M [--hidden H --layers L ...]

Every process runs in a cgroup v1 memory group of its own, capped at M MB (swap included where the kernel counts
it), which it joins before importing TensorFlow; the groups are removed afterwards. Printed: whether the one
process was ended by the OOM killer (SIGKILL, and the kernel's ``oom_kill`` count or hits on the cap), and for the
workers the loss at every step and each one's peak (resident, and as the cgroup counted it, page cache included).
Without cgroup v1 memory (not root, or not mounted) it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
from pathlib import Path

# Measured on the 2-core, 24 GiB machine of docs/evaluation.md: one process peaks above this, a worker well below.
DEMO = {"hidden": 1024, "layers": 8, "sequence": 128, "steps": 4, "cap_mb": 3250}


def run(args: argparse.Namespace, kwargs: dict) -> int:
    from rdkeras.bench import cgroup
    from rdkeras.launch import spawn_call

    why = cgroup.unavailable()
    if why:
        print(f"[memory] per-process caps skipped: {why}")
        return 0
    cap = args.cap_mb << 20
    workers = max(int(n) for n in args.workers.split(","))
    workers = workers if workers > 1 else 4
    env = {"RDKERAS_TRANSPORT": args.transport, "TF_CPP_MIN_LOG_LEVEL": "3"}
    target = "rdkeras.bench.memory:worker_main"
    shape = f"GPT-2 (hidden {kwargs['hidden']}, {kwargs['layers']} layers, vocabulary {kwargs['vocabulary']:,}"
    print(f"{shape}, sequence {kwargs['sequence']}), Adam, global batch {kwargs['batch']}, {kwargs['steps']} steps;")
    print(f"every process in a cgroup of its own capped at {args.cap_mb} MB (swap: {_swap()})")
    kwargs = {**kwargs, "learnable": True, "learning_rate": 5e-4}  # a loss that can fall in a few steps
    results = {}
    for n, mode in ((1, None), (workers, "parameters")):
        label = "one process" if mode is None else f"{n} workers, shard={mode}"
        prefix = f"rdkeras-bench-{os.getpid()}-{n}"
        with cgroup.groups(prefix, n, cap) as made:
            ranks = spawn_call(target, n, {**kwargs, "mode": mode, "cgroup_prefix": str(cgroup.ROOT / prefix)},
                               env=env, timeout=1800)  # fmt: skip
            counted = [cgroup.stats(g) for g in made]
        results[label] = [_row(r, c) for r, c in zip(ranks, counted, strict=True)]
        failed = [r for r in ranks if r.returncode not in (0, -signal.SIGKILL, None)]
        if failed:  # not the cap: show why
            print(f"[memory] {label} failed on rank {failed[0].rank}:\n{failed[0].output[-2000:]}")
    one, sharded = results["one process"][0], results[f"{workers} workers, shard=parameters"]
    header = ("run", "rank", "exit", "oom kills", "cap hits", "peak RSS MB", "cgroup peak", "losses")
    print(f"{header[0]:>24}" + "".join(f"{h:>12}" for h in header[1:-1]) + "  " + header[-1])
    for label, rows in results.items():
        for row in rows:
            cells = (label if row["rank"] == 0 else "", row["rank"], row["exit"], row["oom_kill"], row["failcnt"],
                     _mb(row["peak_mb"]), _mb(row["max_usage_bytes"] / 2**20))  # fmt: skip
            losses = " ".join(f"{x:.3f}" for x in row["losses"]) or "-"
            print(f"{cells[0]:>24}" + "".join(f"{c:>12}" for c in cells[1:]) + "  " + losses)
    one_killed = one["exit"] == "SIGKILL" and (one["oom_kill"] > 0 or one["failcnt"] > 0)
    trained = all(r["exit"] == "0" for r in sharded)
    losses = sharded[0]["losses"]
    falling = trained and len(losses) > 1 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    ok = one_killed and falling
    verdict = "PASS" if ok else "FAIL"
    loss = f"trained, loss {losses[0]:.3f} -> {losses[-1]:.3f}" if trained else "did not train"
    print(f"verdict: {verdict}: one process {'OOM-killed' if one_killed else 'NOT OOM-killed'} under "
          f"{args.cap_mb} MB; {workers} workers (shard=parameters) {loss}"
          + (f" ({'falling' if falling else 'NOT falling'})" if trained else ""))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_cap.json").write_text(json.dumps({**kwargs, "cap_mb": args.cap_mb, "workers": workers,
                                                     "verdict": verdict, "runs": results}, indent=1))  # fmt: skip
    print(f"(written to {out / 'memory_cap.json'})")
    return 0 if ok else 1


def _row(rank: object, counted: dict) -> dict:
    code = getattr(rank, "returncode", None)
    value = getattr(rank, "value", None) or {}
    exit_ = "-" if code is None else signal.Signals(-code).name if code < 0 else str(code)
    return {"rank": getattr(rank, "rank", 0), "exit": exit_, **counted, "peak_mb": value.get("peak_mb"),
            "losses": value.get("losses", [])}  # fmt: skip


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _swap() -> str:
    from rdkeras.bench import cgroup

    try:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
    except OSError:
        return "unknown"
    if not lines:
        return "none"
    return "counted in the cap" if (cgroup.ROOT / "memory.memsw.limit_in_bytes").exists() else "on, not counted"
