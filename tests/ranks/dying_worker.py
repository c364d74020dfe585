"""A training script whose rank 1 is killed in the middle of its first epoch."""

import os
import signal

import keras
import numpy as np

import rdkeras


class KillRankOne(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if strategy.worker_index == 1 and batch == 3:
            os.kill(os.getpid(), signal.SIGKILL)


x = np.random.default_rng(0).standard_normal((4096, 32)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int32")
strategy = rdkeras.RDMAStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[KillRankOne()])
print("finished training (should not happen)")
