"""Fashion-MNIST (Zalando, 70,000 28x28 grey images of 10 clothing classes) from Debian's package."""

from __future__ import annotations

import gzip
import os

import numpy as np

from rdkeras.data.base import Data, DataError, exclusive

DEFAULT_PATH = "/usr/share/datasets/fashion-mnist"  # apt-get install dataset-fashion-mnist
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def _read_idx(path: str, header: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=header)


def _from_folder(path: str) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    splits = []
    for images, labels in _FILES.values():
        y = _read_idx(os.path.join(path, labels), 8)
        x = _read_idx(os.path.join(path, images), 16).reshape(len(y), 28, 28)
        splits.append((x, y))
    return tuple(splits)


def _from_keras() -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    import keras

    with exclusive("fashion-mnist"):
        return keras.datasets.fashion_mnist.load_data()


def fashion_mnist(path: str = DEFAULT_PATH, limit: int | None = None, test_limit: int | None = None) -> Data:
    """Training images with their labels, and the 10,000 test images as the validation set.

    Args:
        path: Folder holding the four ``*-idx?-ubyte.gz`` files. Where it is missing,
            ``keras.datasets.fashion_mnist`` is tried (it needs the internet).
        limit: Use only the first `limit` training images (quick runs).
        test_limit: Use only the first `test_limit` test images.
    """
    missing = [f for pair in _FILES.values() for f in pair if not os.path.exists(os.path.join(path, f))]
    if not missing:
        (x, y), (tx, ty) = _from_folder(path)
        source = path
    else:
        try:
            (x, y), (tx, ty) = _from_keras()
        except Exception as e:
            raise DataError(
                f"Fashion-MNIST not found at {path} (no {missing[0]}) and keras.datasets could not download it "
                f"({type(e).__name__}): install it with `apt-get install dataset-fashion-mnist` or pass data.path=DIR"
            ) from None
        source = "keras.datasets"
    x, y, tx, ty = x[:limit], y[:limit], tx[:test_limit], ty[:test_limit]

    def images(a: np.ndarray) -> np.ndarray:
        return (a.astype(np.float32) / 255.0)[..., None]

    return Data(
        images(x),
        y.astype(np.int32),
        validation=(images(tx), ty.astype(np.int32)),
        description=f"Fashion-MNIST from {source}: {len(y)} training, {len(ty)} test images",
        info={"num_classes": 10},
    )
