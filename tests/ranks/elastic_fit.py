"""An unchanged Keras script for the elastic tests: a small MLP, global batch 12, 3 epochs of 4 steps.

    python -m rdkeras.launch -n 3 --min-workers 2 tests/ranks/elastic_fit.py OUT [--kill WORKER:EPOCH:BATCH ...]
    python tests/ranks/elastic_fit.py OUT --one-process

Each worker that ends writes its weights to OUT/weights-WORKER.npz (WORKER: its first rank); a worker
named by --kill SIGKILLs itself at that batch (after the step, before the next begins); one named by --hang
hangs there alive, in one of tests/ranks/hang_workers.py's ways, for 60 s (its launcher ends it first).
"""

import argparse
import os
import signal
import sys
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--kill", action="append", default=[], help="WORKER:EPOCH:BATCH")
p.add_argument("--stop", default=None, help="WORKER:EPOCH:BATCH: SIGSTOP instead")
p.add_argument("--hang", default=None, help="WORKER:EPOCH:BATCH:HOW (callback, lock, numpy_function)")
p.add_argument("--one-process", action="store_true")
p.add_argument("--tensorboard", action="store_true", help="TensorBoard and TrainingStats into OUT/tb")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--slow", type=float, default=0.0, help="seconds each step waits (a replacement has time to start)")
p.add_argument("--checkpoint", action="store_true", help="ModelCheckpoint: OUT/ckpt/ckpt-EPOCH.weights.h5 (weights)")
p.add_argument(
    "--die-in-save",
    default=None,
    help="WORKER:EPOCH: SIGKILL inside that epoch's checkpoint write, once its temporary file is written",
)
p.add_argument(
    "--epoch-weights", action="store_true", help="each worker's weights at each epoch end: OUT/epoch-WORKER-EPOCH.npz"
)
p.add_argument("--replacement", choices=("exit", "hang"), default=None, help="a replacement exits (or hangs) first")
a = p.parse_args()
if a.replacement and "RDKERAS_JOIN" in os.environ:  # before it reaches the launcher's lobby
    print(f"replacement {os.environ['RDKERAS_JOIN']}: cannot start ({a.replacement})", flush=True)
    if a.replacement == "exit":
        sys.exit(3)
    time.sleep(3600)

import keras  # noqa: E402

worker = int(os.environ.get("RDKERAS_RANK", "0"))
keras.utils.set_random_seed(7)
rng = np.random.default_rng(0)
x = rng.normal(size=(48, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 2))).astype("float32")


def build() -> keras.Model:
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)
    return model


class Kill(keras.callbacks.Callback):
    def __init__(self, at: list[tuple[int, int, int]], sig: int):
        super().__init__()
        self.at, self.sig, self.epoch = at, sig, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(a.slow)
        if (worker, self.epoch, batch) in self.at:
            if self.sig == signal.SIGKILL:  # (the time it died at: the verdict tests' time to both exits)
                print(f"worker {worker} dies at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), self.sig)


def parse(spec: str) -> tuple[int, int, int]:
    w, e, b = (int(v) for v in spec.split(":"))
    return w, e, b


class EpochWeights(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        np.savez(os.path.join(a.out, f"epoch-{worker}-{epoch}.npz"), *self.model.get_weights())


callbacks = [Kill([parse(k) for k in a.kill], signal.SIGKILL)]
if a.epoch_weights:
    callbacks.append(EpochWeights())
if a.stop:
    callbacks.append(Kill([parse(a.stop)], signal.SIGSTOP))
if a.hang:
    *where, hang_how = a.hang.split(":")

    class Hang(Kill):
        def on_train_batch_end(self, batch, logs=None):
            if (worker, self.epoch, batch) == tuple(int(v) for v in where):
                from tests.ranks.hang_workers import HANGS

                print(f"worker {worker} hangs ({hang_how}) at {time.time():.3f}", flush=True)
                HANGS[hang_how](60.0)

    callbacks.append(Hang([], 0))
if a.one_process:
    model = build()
    model.fit(x, y, batch_size=12, epochs=a.epochs, shuffle=False, verbose=0)
    np.savez(os.path.join(a.out, "weights-one.npz"), *model.get_weights())
    sys.exit(0)

import rdkeras  # noqa: E402

if a.die_in_save:  # the chief dies in the middle of a checkpoint: its temporary written, not yet renamed
    from rdkeras.fitting import saving

    write_atomically = saving.write_atomically
    victim, at_epoch = (int(v) for v in a.die_in_save.split(":"))

    def dying_write(path, write, expected_bytes=0):
        def write_then_die(tmp):
            write(tmp)
            if worker == victim and f"ckpt-{at_epoch + 1}." in path.name:
                os.kill(os.getpid(), signal.SIGKILL)

        write_atomically(path, write_then_die, expected_bytes)

    saving.write_atomically = dying_write

strategy = rdkeras.RDMAStrategy()
with strategy.scope():
    model = build()
if a.tensorboard:
    from rdkeras.callbacks import TrainingStats

    callbacks += [keras.callbacks.TensorBoard(os.path.join(a.out, "tb")), TrainingStats(os.path.join(a.out, "tb"))]
if a.checkpoint:
    callbacks.append(
        keras.callbacks.ModelCheckpoint(os.path.join(a.out, "ckpt", "ckpt-{epoch}.weights.h5"), save_weights_only=True)
    )
try:
    model.fit(x, y, batch_size=12, epochs=a.epochs, shuffle=False, verbose=0, callbacks=callbacks)
except Exception as e:  # (the time it failed at: the hang tests' time to name)
    print(f"worker {worker} failed at {time.time():.3f}: {type(e).__name__}: {e}", flush=True)
    raise
if a.tensorboard and strategy.is_chief:  # what TensorBoard shows: every epoch's loss, the membership change
    import glob

    import tensorflow as tf

    for path in sorted(glob.glob(os.path.join(a.out, "tb", "**", "events.*"), recursive=True)):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                if v.tag in ("epoch_loss", "elastic/workers"):
                    print(f"TB {v.tag} step {event.step} value {tf.make_ndarray(v.tensor)}", flush=True)
worker = int(os.environ.get("RDKERAS_JOIN", worker))  # a replacement's id
with open("/proc/self/maps") as maps:  # arenas mapped (own and peers'): none of a group left behind may remain
    arenas = {line.split()[4] for line in maps if "memfd:rdkeras-arena" in line}  # (by inode)
print(f"worker {worker} maps {len(arenas)} arenas", flush=True)
np.savez(os.path.join(a.out, f"weights-{worker}.npz"), *model.get_weights())
print(f"worker {worker} ended as rank {strategy.worker_index} of {strategy.num_workers}", flush=True)
strategy.close()
