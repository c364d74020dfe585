"""Model state per worker: KerasHub's GPT-2 trained with every shard mode, at 1, 2 and 4 workers.

    python -m rdkeras.bench memory [--workers 1,2,4] [--modes none,parameters] [--hidden 512] [--layers 4] [--quick]
    python -m rdkeras.bench memory --oom-demo | --cap-mb M   (each process capped: rdkeras.bench.memory_cap)

A GPT-2 causal LM built from its config (no download) trains with Adam for a few steps in one process, then on N
data-parallel workers with ``shard="none"``, ``"optimizer"``, ``"gradients"`` and ``"parameters"``, each a launch of
its own (peak memory is a process's). Printed per configuration, for the chief: the bytes of parameters,
gradients and optimizer state it holds (counted from the variables; a sharded worker receives its shard of the
averaged gradients only), its peak resident memory above what it held once TensorFlow, Keras and KerasHub were
imported (VmHWM - VmRSS then), the median step time and the bytes it sent per step; at each N the step time of
every mode against ``shard="none"``, measured side by side in this run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

MODES = ("none", "optimizer", "gradients", "parameters")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (1: one process, unsharded)")
    p.add_argument("--hidden", type=int, default=512, help="GPT-2 hidden size")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--vocabulary", type=int, default=16_000, help="vocabulary size")
    p.add_argument("--sequence", type=int, default=64, help="tokens a sequence")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=6, help="training steps (the first 2 untimed)")
    p.add_argument("--transport", default="shm", help="the engine transport (shm, tcp)")
    p.add_argument("--modes", default=",".join(MODES), help="shard modes at N > 1, comma-separated")
    p.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, a 4,000-token vocabulary, 1-2 workers")
    p.add_argument("--out", default="bench-results", help="folder for memory.json")
    p.add_argument("--cap-mb", type=int, default=0, help="cap every process at this many MB (a cgroup each): one "
                   "process, then the most workers with shard=parameters (rdkeras.bench.memory_cap)")  # fmt: skip
    p.add_argument("--oom-demo", action="store_true", help="--cap-mb with the model size and cap that show one "
                   "process OOM-killed and 4 workers training here")  # fmt: skip


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS: resident now; VmHWM: the peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker_main(mode: str | None, hidden: int, layers: int, vocabulary: int, sequence: int, batch: int,
                steps: int, learnable: bool = False, learning_rate: float = 1e-4,
                cgroup_prefix: str | None = None) -> dict:  # fmt: skip
    """Trains the GPT-2 (`mode` None: in one process, without rdkeras); this worker's state bytes, peak memory
    above the bare imports, median step time and bytes written per step. Tokens are uniformly random, or with
    `learnable` drawn from ids 1-63 only (a distribution the model learns within a few steps: the loss falls).
    With `cgroup_prefix` the worker first joins its rank's capped group (rdkeras.bench.cgroup)."""

    from rdkeras.bench import cgroup

    cgroup.join_rank(cgroup_prefix)  # before TensorFlow is imported: all this process holds counts against its cap
    import keras
    import keras_hub
    import numpy as np

    from rdkeras import introspect
    from rdkeras.bench import pin_one_core, step_timer

    pin_one_core()
    bare_kb = _status_kb("VmRSS")  # TensorFlow, Keras and KerasHub imported, nothing built
    strategy = None
    if mode is not None:
        import rdkeras

        strategy = rdkeras.RDMAStrategy(shard=mode)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocabulary, (batch * steps, sequence + 1)).astype("int32")
    if learnable:
        tokens = tokens % 63 + 1
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((len(tokens), sequence), bool)}
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy else _nothing():
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary, num_layers=layers, num_heads=max(1, hidden // 64), hidden_dim=hidden,
            intermediate_dim=4 * hidden, max_sequence_length=sequence, dropout=0.0,
        )  # fmt: skip
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        loss = keras.losses.SparseCategoricalCrossentropy(True)
        lm.compile(optimizer=keras.optimizers.Adam(learning_rate), loss=loss)

    view = introspect.inspect(strategy)
    timer = step_timer(view.bytes_written)
    lm.fit(x, tokens[:, 1:], batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    out = {
        **view.state_bytes(lm).as_dict(),
        "peak_above_bare_mb": (_status_kb("VmHWM") - bare_kb) / 1024,
        "peak_mb": _status_kb("VmHWM") / 1024,
        "step_s": float(np.median(timer.times[2:])),
        "bytes_per_step": (timer.bytes[1] - timer.bytes[0]) / max(1, steps - 2),
        "losses": timer.losses,
    }
    if strategy is not None:
        strategy.close()
    return out


def _nothing() -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks

    shape = {"hidden": args.hidden, "layers": args.layers, "vocabulary": args.vocabulary}
    counts = [int(n) for n in args.workers.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown shard mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.quick:
        shape, counts = {"hidden": 128, "layers": 2, "vocabulary": 4000}, [n for n in counts if n <= 2] or [1]
    if args.oom_demo:
        from rdkeras.bench.memory_cap import DEMO

        shape = {**shape, "hidden": DEMO["hidden"], "layers": DEMO["layers"]}
        args.cap_mb, args.sequence, args.steps = args.cap_mb or DEMO["cap_mb"], DEMO["sequence"], DEMO["steps"]
    kwargs = {**shape, "sequence": args.sequence, "batch": args.batch, "steps": args.steps}
    if args.cap_mb:
        from rdkeras.bench import memory_cap

        return memory_cap.run(args, kwargs)
    env = {"RDKERAS_TRANSPORT": args.transport, "TF_CPP_MIN_LOG_LEVEL": "3"}
    target = "rdkeras.bench.memory:worker_main"
    rows: list[dict] = []
    for n in counts:
        for mode in modes if n > 1 else [None]:
            ranks = run_ranks("memory", f"{n} worker(s), shard={mode}", target, n, {**kwargs, "mode": mode}, env=env,
                              timeout=1800)  # fmt: skip
            if ranks is None:
                return 1
            rows.append({"workers": n, "mode": mode or "one process", **ranks[0].value})
    model = f"GPT-2 (hidden {shape['hidden']}, {shape['layers']} layers, vocabulary {shape['vocabulary']:,}"
    print(f"{model}, sequence {args.sequence}), Adam, global batch {args.batch}, over {args.transport}; per worker:")
    header = ("workers", "shard", "params MB", "grads MB", "optim MB", "state vs 1", "peak MB", "peak vs 1", "step",
              "vs none", "sent/step")  # fmt: skip
    print("".join(f"{h:>12}" for h in header))
    one = rows[0] if rows[0]["mode"] == "one process" else None
    for row in rows:
        state = row["parameters"] + row["gradients"] + row["optimizer"]
        none = next((r for r in rows if r["workers"] == row["workers"] and r["mode"] in ("none", "one process")), None)
        base = one or row
        row["state_vs_one"] = state / (base["parameters"] + base["gradients"] + base["optimizer"])
        row["peak_vs_one"] = row["peak_above_bare_mb"] / base["peak_above_bare_mb"]
        row["step_vs_none"] = row["step_s"] / none["step_s"] if none else None  # (shard="none" not run at N)
        vs_none = "-" if none is None else f"{row['step_vs_none']:.2f}x"
        cells = (row["workers"], row["mode"], f"{row['parameters'] / 1e6:.1f}", f"{row['gradients'] / 1e6:.1f}",
                 f"{row['optimizer'] / 1e6:.1f}", f"{row['state_vs_one']:.2f}x", f"{row['peak_above_bare_mb']:.0f}",
                 f"{row['peak_vs_one']:.2f}x", f"{row['step_s'] * 1e3:.0f} ms", vs_none,
                 f"{row['bytes_per_step'] / 1e6:.1f} MB")  # fmt: skip
        print("".join(f"{c:>12}" for c in cells))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps({"model": shape, **kwargs, "transport": args.transport,
                                                 "rows": rows}, indent=1))  # fmt: skip
    print(f"(written to {out / 'memory.json'})")
    return 0
