"""Convolutional networks: AlexNet, VGG-16, Inception-v3 (the seed's CNNs) and a small Fashion-MNIST CNN."""

from __future__ import annotations

from typing import Any


def _scaled(channels: int, width: float) -> int:
    return max(1, round(channels * width))


def alexnet(image_size: int = 64, num_classes: int = 100, width: float = 0.25, dropout: float = 0.5) -> Any:
    """AlexNet (Krizhevsky et al. 2012, single-tower form): 5 convolutions, 3 fully connected layers.

    The published size is ``image_size=224, num_classes=1000, width=1.0`` (about 61 M parameters,
    most of them in ``fc6``/``fc7``).

    Args:
        image_size: Height and width of the square RGB input.
        num_classes: Outputs of the softmax.
        width: Multiplies every layer's channels/units (1.0 is the published network).
        dropout: Dropout rate before ``fc6`` and ``fc7``.
    """
    import keras
    from keras import layers

    inputs = keras.Input((image_size, image_size, 3), name="images")
    x = layers.Conv2D(_scaled(96, width), 11, strides=4, padding="same", activation="relu", name="conv1")(inputs)
    x = layers.MaxPooling2D(3, strides=2, name="pool1")(x)
    x = layers.Conv2D(_scaled(256, width), 5, padding="same", activation="relu", name="conv2")(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="pool2")(x)
    x = layers.Conv2D(_scaled(384, width), 3, padding="same", activation="relu", name="conv3")(x)
    x = layers.Conv2D(_scaled(384, width), 3, padding="same", activation="relu", name="conv4")(x)
    x = layers.Conv2D(_scaled(256, width), 3, padding="same", activation="relu", name="conv5")(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="pool5")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dropout(dropout, name="drop6")(x)
    x = layers.Dense(_scaled(4096, width), activation="relu", name="fc6")(x)
    x = layers.Dropout(dropout, name="drop7")(x)
    x = layers.Dense(_scaled(4096, width), activation="relu", name="fc7")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="alexnet")


_VGG16_BLOCKS = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))


def vgg16(image_size: int = 32, num_classes: int = 10, width: float = 0.25, fc_units: int | None = None) -> Any:
    """VGG-16 (Simonyan & Zisserman 2014) with keras.applications' layer names.

    ``block1_conv1`` ... ``block5_pool``, ``flatten``, ``fc1``, ``fc2``, ``predictions``:
    the natural model-parallel cut is ``{"block*": 0, "flatten": 1, "fc*": 1, "predictions": 1}``.
    The published size is ``image_size=224, num_classes=1000, width=1.0`` (138 M parameters,
    102 M of them in ``fc1``).

    Args:
        image_size: Height and width of the square RGB input (at least 32: five 2x2 poolings).
        num_classes: Outputs of the softmax.
        width: Multiplies the convolution channels.
        fc_units: Units of ``fc1`` and ``fc2``; defaults to 4096 x width.
    """
    import keras
    from keras import layers

    if image_size < 32:
        raise ValueError(f"vgg16 needs image_size >= 32 (five 2x2 poolings), got {image_size}")
    inputs = keras.Input((image_size, image_size, 3), name="images")
    x = inputs
    for b, (channels, convs) in enumerate(_VGG16_BLOCKS, start=1):
        for c in range(1, convs + 1):
            x = layers.Conv2D(_scaled(channels, width), 3, padding="same", activation="relu", name=f"block{b}_conv{c}")(
                x
            )
        x = layers.MaxPooling2D(2, strides=2, name=f"block{b}_pool")(x)
    x = layers.Flatten(name="flatten")(x)
    units = fc_units or _scaled(4096, width)
    x = layers.Dense(units, activation="relu", name="fc1")(x)
    x = layers.Dense(units, activation="relu", name="fc2")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="vgg16")


def inception_v3(image_size: int = 75, num_classes: int = 10) -> Any:
    """Inception-v3 (Szegedy et al. 2015), keras.applications' definition, randomly initialised.

    Layers are named as there (``conv2d_N``, ``mixed0`` ... ``mixed10``, ``avg_pool``,
    ``predictions``). The published size is ``image_size=299, num_classes=1000`` (23.9 M
    parameters); the width is the paper's at every size (the smallest input is 75).

    Args:
        image_size: Height and width of the square RGB input (at least 75).
        num_classes: Outputs of the softmax.
    """
    import keras

    if image_size < 75:
        raise ValueError(f"inception_v3 needs image_size >= 75, got {image_size}")
    return keras.applications.InceptionV3(
        weights=None, input_shape=(image_size, image_size, 3), classes=num_classes, include_top=True
    )


def fashion_cnn(image_size: int = 28, num_classes: int = 10, filters: int = 32, dense: int = 128) -> Any:
    """A small CNN for 28x28 grey images (Fashion-MNIST): two convolutions, pooling, dropout, two dense layers.

    Args:
        image_size: Height and width of the square grey input.
        num_classes: Outputs of the softmax.
        filters: Channels of the first convolution (the second has twice as many).
        dense: Units of the hidden dense layer.
    """
    import keras
    from keras import layers

    inputs = keras.Input((image_size, image_size, 1), name="images")
    x = layers.Conv2D(filters, 3, activation="relu", name="conv1")(inputs)
    x = layers.Conv2D(2 * filters, 3, activation="relu", name="conv2")(x)
    x = layers.MaxPooling2D(2, name="pool")(x)
    x = layers.Dropout(0.25, name="drop1")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(dense, activation="relu", name="fc1")(x)
    x = layers.Dropout(0.5, name="drop2")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="fashion_cnn")
