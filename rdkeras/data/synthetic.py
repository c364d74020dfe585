"""Synthetic inputs and labels, like TensorFlow's tf_cnn_benchmarks: measures the system, not learning."""

from __future__ import annotations

import numpy as np

from rdkeras.data.base import Data


def synthetic_images(samples: int, image_size: int, num_classes: int, channels: int = 3, seed: int = 0) -> Data:
    """Uniform random images in [0, 1) and uniform random labels."""
    rng = np.random.default_rng(seed)
    x = rng.random((samples, image_size, image_size, channels), dtype=np.float32)
    y = rng.integers(0, num_classes, samples).astype(np.int32)
    return Data(x, y, description=f"synthetic images {image_size}x{image_size}x{channels}, {samples} samples")


def synthetic_vectors(samples: int, input_dim: int, num_classes: int | None = None, seed: int = 0) -> Data:
    """Uniform random vectors and labels (FCN-5's benchmark data)."""
    rng = np.random.default_rng(seed)
    x = rng.random((samples, input_dim), dtype=np.float32)
    y = rng.integers(0, num_classes or input_dim, samples).astype(np.int32)
    return Data(x, y, description=f"synthetic vectors of {input_dim}, {samples} samples")


def synthetic_tokens(samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> Data:
    """Random token sequences; the target at each position is the next token."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, vocab_size, (samples, seq_len + 1)).astype(np.int32)
    return Data(stream[:, :-1], stream[:, 1:], description=f"synthetic tokens, {samples} x {seq_len} of {vocab_size}")
