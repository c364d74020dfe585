"""A plain single-process Keras script, made distributed by the two marked lines.

python examples/mnist_mlp.py                          # one process
python -m rdkeras.launch -n 2 examples/mnist_mlp.py   # two workers, same code
"""

import argparse

import keras
import numpy as np

import rdkeras

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=2048)
parser.add_argument("--batch-size", type=int, default=64, help="the global batch, split over the workers")
args = parser.parse_args()

rng = np.random.default_rng(0)
x = rng.standard_normal((args.samples, 784)).astype("float32")
w = rng.standard_normal((784, 10)).astype("float32")
y = np.argmax(x @ w, axis=1)  # a learnable synthetic task

strategy = rdkeras.RDMAStrategy()  # added line 1
with strategy.scope():  # added line 2
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=2)  # the same steps on 1 or N workers
loss, acc = model.evaluate(x, y, batch_size=args.batch_size, verbose=0)
print(f"final loss={loss:.4f} accuracy={acc:.4f} workers={strategy.num_workers} transport={strategy.transport}")
