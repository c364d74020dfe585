"""Sparse gradients: an Embedding's gradient exchanged as its rows and indices, against as a dense tensor.

    python -m rdkeras.bench embedding [--vocabulary 100000] [--workers 2]

A text classifier (Embedding of `vocabulary` x `dim` -> mean -> Dense) trains with Adam on N data-parallel workers,
its Embedding's IndexedSlices gathered from every worker (the default), then allreduced as dense tensors
(``sparse_as_dense=True``, Horovod's switch), side by side in one run; then once in one process. Printed per mode:
the bytes each worker sends per step, the step time, and how far the weights end from one process's (Adam updates
only the rows a batch touched when given IndexedSlices: the dense exchange hands it zeros for every other row,
which it then decays).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

MODES = {"sparse": False, "sparse_as_dense": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocabulary", type=int, default=100_000, help="rows of the Embedding")
    p.add_argument("--dim", type=int, default=64, help="columns of the Embedding")
    p.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
    p.add_argument("--length", type=int, default=16, help="tokens a sequence")
    p.add_argument("--steps", type=int, default=20, help="training steps timed (after 2 untimed)")
    p.add_argument("--workers", type=int, default=2, help="data-parallel workers")
    p.add_argument("--transport", default="shm", help="the engine transport (shm, tcp)")
    p.add_argument("--quick", action="store_true", help="a 20,000-row vocabulary and 10 steps")
    p.add_argument("--out", default="bench-results", help="folder for embedding.json")


def worker_main(modes: list, vocabulary: int, dim: int, batch: int, length: int, steps: int, alone: bool) -> dict:
    """Trains the classifier in each mode (or, `alone`, once without rdkeras); per mode: the bytes this worker
    wrote per step, its median step time and its final weights' checksum pieces."""

    import keras
    import numpy as np

    from rdkeras import introspect
    from rdkeras.bench import pin_one_core, step_timer

    pin_one_core()
    rng = np.random.default_rng(0)
    x = rng.zipf(1.3, (batch * (steps + 2), length)) % vocabulary
    y = (x[:, 0] % 2).astype("int32")
    out = {}
    for mode in [None] if alone else modes:
        strategy = None
        if mode is not None:
            import rdkeras

            strategy = rdkeras.RDMAStrategy(sparse_as_dense=MODES[mode])
        keras.utils.set_random_seed(1)
        with strategy.scope() if strategy else _nothing():
            model = keras.Sequential([keras.Input((length,), dtype="int64"), keras.layers.Embedding(vocabulary, dim),
                                      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])  # fmt: skip
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(True))

        timer = step_timer(introspect.inspect(strategy).bytes_written)  # each step's time, the bytes it wrote

        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        weights = model.get_weights()
        out[mode or "one process"] = {
            "bytes_per_step": (timer.bytes[1] - timer.bytes[0]) / steps,
            "step_s": float(np.median(timer.times[2:])),
            "weights": [w.astype(np.float64).tolist() for w in weights[1:]],  # all but the embedding
            "embedding_sum": float(np.abs(weights[0]).sum(dtype=np.float64)),
            "embedding_rows": weights[0][: min(vocabulary, 512)].astype(np.float64).tolist(),
        }
        if strategy is not None:
            strategy.close()
        keras.backend.clear_session()
    return out


def _nothing() -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def _max_difference(a: dict, b: dict) -> float:
    import numpy as np

    pairs = [*zip(a["weights"], b["weights"], strict=True), (a["embedding_rows"], b["embedding_rows"])]
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks

    vocabulary, steps = (20_000, 10) if args.quick else (args.vocabulary, args.steps)
    kwargs = {"modes": list(MODES), "vocabulary": vocabulary, "dim": args.dim, "batch": args.batch,
              "length": args.length, "steps": steps}  # fmt: skip
    env = {"RDKERAS_TRANSPORT": args.transport, "TF_CPP_MIN_LOG_LEVEL": "3"}
    target = "rdkeras.bench.embedding:worker_main"
    workers = run_ranks("embedding", "the workers", target, args.workers, {**kwargs, "alone": False}, env=env,
                        timeout=1200)  # fmt: skip
    alone = run_ranks("embedding", "one process", target, 1, {**kwargs, "alone": True}, env=env, timeout=1200)
    if workers is None or alone is None:
        return 1
    chief, reference = workers[0].value, alone[0].value["one process"]
    dense_bytes = vocabulary * args.dim * 4
    print(f"Embedding {vocabulary:,} x {args.dim} ({dense_bytes / 1e6:.1f} MB of gradient), global batch {args.batch} "
          f"x {args.length} tokens, Adam, {args.workers} workers over {args.transport}:")  # fmt: skip
    print(f"{'mode':<18}{'sent per step':>16}{'step':>12}{'max |w - one process|':>24}")
    rows = {}
    for mode in MODES:
        r = chief[mode]
        rows[mode] = {"bytes_per_step": r["bytes_per_step"], "step_s": r["step_s"],
                      "max_difference": _max_difference(r, reference)}  # fmt: skip
        print(f"{mode:<18}{r['bytes_per_step'] / 1e6:>13.3f} MB{r['step_s'] * 1e3:>9.1f} ms"
              f"{rows[mode]['max_difference']:>24.2e}")  # fmt: skip
    saved = rows["sparse_as_dense"]["bytes_per_step"] / max(rows["sparse"]["bytes_per_step"], 1.0)
    faster = rows["sparse_as_dense"]["step_s"] / rows["sparse"]["step_s"]
    print(f"sparse: {saved:.1f}x fewer bytes on the wire, {faster:.2f}x the dense step's speed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embedding.json").write_text(json.dumps({"vocabulary": vocabulary, "dim": args.dim, "batch": args.batch,
                                                    "length": args.length, "workers": args.workers,
                                                    "modes": rows, "bytes_saved": saved, "speed_up": faster},
                                                   indent=1))  # fmt: skip
    return 0
