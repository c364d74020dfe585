"""The seed's six benchmark models, plus the two real-data models, as Keras Functional models.

Every builder returns an uncompiled ``keras.Model`` whose layers have stable,
descriptive names (``block1_conv1``, ``fc1``, ``lstm2``, ``predictions``), so
that model-parallel placement globs such as ``{"block*": 0, "fc*": 1}`` read
well. Defaults are small enough to train on two CPU cores; the docstrings name
the arguments that give the published sizes.
"""

from rdkeras.models.cnn import alexnet, fashion_cnn, inception_v3, vgg16
from rdkeras.models.fcn import fcn5
from rdkeras.models.rnn import char_lm, gru, lstm

__all__ = ["alexnet", "char_lm", "fashion_cnn", "fcn5", "gru", "inception_v3", "lstm", "vgg16"]
