"""FCN-5: the fully connected 5-layer network of the 2016 deep-learning tools benchmark."""

from __future__ import annotations

from typing import Any


def fcn5(input_dim: int = 4096, hidden: int = 1024, num_classes: int | None = None) -> Any:
    """input -> 3 x hidden (sigmoid) -> softmax.

    The benchmark's size is ``input_dim=26752, hidden=2048`` (118 M parameters,
    472 MB of float32 gradients per step): the most communication-bound of the six.

    Args:
        input_dim: Width of the input vector.
        hidden: Width of each of the three hidden layers.
        num_classes: Width of the softmax output; defaults to ``input_dim`` as in the benchmark.
    """
    import keras

    inputs = keras.Input((input_dim,), name="features")
    x = inputs
    for i in range(1, 4):
        x = keras.layers.Dense(hidden, activation="sigmoid", name=f"fc{i}")(x)
    outputs = keras.layers.Dense(num_classes or input_dim, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="fcn5")
