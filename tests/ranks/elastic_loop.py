"""A custom training loop for the elastic tests (rdkeras.elastic.State and run): a small MLP, global batch 12,
3 epochs of 4 steps, Adam; the loss is scaled by the global batch, as the tf.distribute tutorials do.

    python -m rdkeras.launch -n 3 --min-workers 2 tests/ranks/elastic_loop.py OUT [--kill WORKER:EPOCH:BATCH ...]
    python tests/ranks/elastic_loop.py OUT --one-process

Each worker that ends writes its weights to OUT/weights-WORKER.npz; a worker named by --kill SIGKILLs itself
after committing that batch.
"""

import argparse
import os
import signal
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--kill", action="append", default=[], help="WORKER:EPOCH:BATCH")
p.add_argument("--one-process", action="store_true")
p.add_argument("--slow", type=float, default=0.0, help="seconds each step waits (a replacement has time to start)")
a = p.parse_args()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

EPOCHS, STEPS, BATCH = 3, 4, 12
worker = int(os.environ.get("RDKERAS_JOIN", os.environ.get("RDKERAS_RANK", "0")))
keras.utils.set_random_seed(7)
rng = np.random.default_rng(0)
x = rng.normal(size=(STEPS * BATCH, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 2))).astype("float32")


def build() -> tuple[keras.Model, keras.optimizers.Optimizer]:
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    return model, keras.optimizers.Adam(0.01)


def global_batch(epoch: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(epoch).permutation(len(x))[batch * BATCH : (batch + 1) * BATCH]
    return x[order], y[order]


def make_step(model, optimizer):
    def step(xs, ys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(xs, training=True) - ys)) / (BATCH * 2)  # global batch's mean
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return step


if a.one_process:
    model, optimizer = build()
    step = tf.function(make_step(model, optimizer), jit_compile=False)
    for epoch in range(EPOCHS):
        for batch in range(STEPS):
            step(*global_batch(epoch, batch))
    np.savez(os.path.join(a.out, "weights-one.npz"), *model.get_weights())
    raise SystemExit(0)

import rdkeras  # noqa: E402

kills = {tuple(int(v) for v in k.split(":")) for k in a.kill}
strategy = rdkeras.RDMAStrategy()
with strategy.scope():
    model, optimizer = build()
step = make_step(model, optimizer)
train_step = tf.function(lambda xs, ys: strategy.run(step, args=(xs, ys)), jit_compile=False, reduce_retracing=True)

state = rdkeras.elastic.State(strategy, model, optimizer, epoch=0, batch=0)
state.register_reset_callbacks([lambda: print(f"worker {worker} reset: {strategy.num_workers} workers", flush=True)])


@rdkeras.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        while state.batch < STEPS:
            train_step(*strategy.local_rows(global_batch(state.epoch, state.batch)))
            time.sleep(a.slow)
            state.batch += 1
            state.commit()
            if (worker, state.epoch, state.batch - 1) in kills:
                os.kill(os.getpid(), signal.SIGKILL)
        state.epoch, state.batch = state.epoch + 1, 0


train(state)
print(f"worker {worker} ended as rank {strategy.worker_index} of {strategy.num_workers} after {state.commits} "
      f"commits at epoch {state.epoch}", flush=True)  # fmt: skip
np.savez(os.path.join(a.out, f"weights-{worker}.npz"), *model.get_weights())
strategy.close()
