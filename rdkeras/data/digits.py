"""Handwritten digits, 8x8 (1,797 images of 10 classes), shipped inside rdkeras: real data on any machine.

The data is the UCI ML repository's "Optical Recognition of Handwritten Digits" test set (E. Alpaydin and
C. Kaynak, 1998; CC BY 4.0), as scikit-learn ships it (``digits.csv.gz``: 64 pixel counts 0..16, then the
label, per row). Small enough to train on in seconds, real enough that held-out accuracy means something.
"""

from __future__ import annotations

import gzip
from importlib import resources

import numpy as np

from rdkeras.data.base import Data, DataError

IMAGES = 1797


def digits(held_out: int = 450, seed: int = 0) -> Data:
    """The 8x8 digits as 64 features scaled to [0, 1], split at random into training and held-out images.

    Args:
        held_out: How many images are held out (evaluated after every epoch, never trained on).
        seed: The split's seed (the same on every worker, so every worker holds the same split).
    """
    if not 0 < held_out < IMAGES:
        raise DataError(f"data.held_out must be between 1 and {IMAGES - 1} of the {IMAGES} images, got {held_out}")
    with resources.files("rdkeras.data").joinpath("digits.csv.gz").open("rb") as raw, gzip.open(raw, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x, y = table[:, :64] / 16.0, table[:, 64].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    test, train = order[:held_out], order[held_out:]
    return Data(
        x[train],
        y[train],
        validation=(x[test], y[test]),
        description=f"handwritten digits 8x8 (UCI, in rdkeras): {len(train)} training, {held_out} held-out images",
        info={"num_classes": 10, "input_dim": 64},
    )
