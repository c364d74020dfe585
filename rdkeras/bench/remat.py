"""Activation memory saved by rematerialization: KerasHub's GPT-2 built under ``keras.RematScope`` or not.

    python -m rdkeras.bench remat [--mode full] [--workers 1,2] [--hidden 128] [--layers 2] [--sequence 256]

A GPT-2 causal LM built from its config (no download) trains with Adam for a few steps, without and with
rematerialization (``keras.RematScope(mode)`` around the model's construction: Keras fixes each layer's mode then),
in one process and on N data-parallel workers, each configuration a launch of its own (peak memory is a process's).
Printed per configuration, for the chief: the peak of TensorFlow's CPU allocator over the timed steps (the steps'
tensors: activations kept for backprop, gradients; ``tf.config.experimental.get_memory_info``), its peak resident
memory above what it held once TensorFlow, Keras and KerasHub were imported (VmHWM - VmRSS then: tracing included),
the median step time, the first and last losses, and, against the same
worker count without rematerialization, the peak's and the step time's ratios, measured side by side in this run.
One process rematerializes through rdkeras's seam as a strategy does (``keras_internals.hold_remat``: Keras's own
TensorFlow ``remat`` fails inside ``fit``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from rdkeras.bench.memory import _status_kb

REMAT_MODES = ("full", "activations", "larger_than")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="full", choices=REMAT_MODES, help="the RematScope mode compared with none")
    p.add_argument("--threshold", type=int, default=1024, help="larger_than: the output size threshold")
    p.add_argument("--workers", default="1,2", help="worker counts, comma-separated (1: one process)")
    p.add_argument("--hidden", type=int, default=128, help="GPT-2 hidden size")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--vocabulary", type=int, default=2_000, help="vocabulary size")
    p.add_argument("--sequence", type=int, default=256, help="tokens a sequence")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=5, help="training steps (the first 2 untimed)")
    p.add_argument("--transport", default="shm", help="the engine transport (shm, tcp)")
    p.add_argument("--out", default="bench-results", help="folder for remat.json")


def worker_main(remat: dict | None, distributed: bool, hidden: int, layers: int, vocabulary: int, sequence: int,
                batch: int, steps: int) -> dict:  # fmt: skip
    """Trains the GPT-2, built under ``keras.RematScope(**remat)`` (None: no scope), in one process or under an
    RDMAStrategy; this worker's peak memory above the bare imports, median step time and losses."""

    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    from rdkeras import keras_internals
    from rdkeras.bench import pin_one_core, step_timer

    pin_one_core()
    bare_kb = _status_kb("VmRSS")  # TensorFlow, Keras and KerasHub imported, nothing built
    strategy = None
    if distributed:
        import rdkeras

        strategy = rdkeras.RDMAStrategy()
    elif remat is not None:
        keras_internals.hold_remat()  # what a strategy holds: Keras's own TensorFlow remat fails in fit
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocabulary, (batch * steps, sequence + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((len(tokens), sequence), bool)}
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy else contextlib.nullcontext():
        with keras.RematScope(**remat) if remat else contextlib.nullcontext():
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=vocabulary, num_layers=layers, num_heads=max(1, hidden // 64), hidden_dim=hidden,
                intermediate_dim=4 * hidden, max_sequence_length=sequence, dropout=0.0,
            )  # fmt: skip
            lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.Adam(1e-4), loss=keras.losses.SparseCategoricalCrossentropy(True))

    # Traced by the third step: from there, the steps' own tensors.
    timer = step_timer(at_first_timed=lambda: tf.config.experimental.reset_memory_stats("CPU:0"))
    lm.fit(x, tokens[:, 1:], batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    out = {
        "peak_above_bare_mb": (_status_kb("VmHWM") - bare_kb) / 1024,
        "tensors_peak_mb": tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20,
        "step_s": float(np.median(timer.times[2:])),
        "losses": timer.losses,
    }
    if strategy is not None:
        strategy.close()
    elif remat is not None:
        keras_internals.release_remat()
    return out


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks

    counts = [int(n) for n in args.workers.split(",")]
    kwargs = {"hidden": args.hidden, "layers": args.layers, "vocabulary": args.vocabulary, "sequence": args.sequence,
              "batch": args.batch, "steps": args.steps}  # fmt: skip
    scope = {"mode": args.mode, "output_size_threshold": args.threshold}
    env = {"RDKERAS_TRANSPORT": args.transport, "TF_CPP_MIN_LOG_LEVEL": "3"}
    rows: list[dict] = []
    for n in counts:
        for remat in (None, scope):
            label = f"{n} worker(s), remat={remat['mode'] if remat else 'none'}"
            ranks = run_ranks("remat", label, "rdkeras.bench.remat:worker_main", n,
                              {**kwargs, "remat": remat, "distributed": n > 1}, env=env, timeout=1800)  # fmt: skip
            if ranks is None:
                return 1
            rows.append({"workers": n, "remat": remat["mode"] if remat else "none", **ranks[0].value})
    print(f"GPT-2 (hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocabulary:,}, sequence "
          f"{args.sequence}), Adam, global batch {args.batch}, over {args.transport}; the chief:")  # fmt: skip
    header = ("workers", "remat", "tensors MB", "vs none", "peak RSS MB", "vs none", "step", "vs none", "loss first",
              "loss last")  # fmt: skip
    print("".join(f"{h:>12}" for h in header))
    for row in rows:
        none = next(r for r in rows if r["workers"] == row["workers"] and r["remat"] == "none")
        row["tensors_vs_none"] = row["tensors_peak_mb"] / none["tensors_peak_mb"]
        row["peak_vs_none"] = row["peak_above_bare_mb"] / none["peak_above_bare_mb"]
        row["step_vs_none"] = row["step_s"] / none["step_s"]
        cells = (row["workers"], row["remat"], f"{row['tensors_peak_mb']:.0f}", f"{row['tensors_vs_none']:.2f}x",
                 f"{row['peak_above_bare_mb']:.0f}", f"{row['peak_vs_none']:.2f}x",
                 f"{row['step_s'] * 1e3:.0f} ms", f"{row['step_vs_none']:.2f}x", f"{row['losses'][0]:.4f}",
                 f"{row['losses'][-1]:.4f}")  # fmt: skip
        print("".join(f"{c:>12}" for c in cells))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remat.json").write_text(json.dumps({**kwargs, "scope": scope, "transport": args.transport,
                                                "rows": rows}, indent=1))  # fmt: skip
    print(f"(written to {out / 'remat.json'})")
    return 0
