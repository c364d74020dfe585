"""Recurrent language models: the seed's LSTM and GRU (PTB-style word LMs) and a character LM."""

from __future__ import annotations

from typing import Any


def _recurrent_lm(
    cell: str, vocab_size: int, seq_len: int, embed_dim: int, hidden: int, num_layers: int, dropout: float, name: str
) -> Any:
    import keras
    from keras import layers

    rnn = {"lstm": layers.LSTM, "gru": layers.GRU}[cell]
    inputs = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab_size, embed_dim, name="embedding")(inputs)
    for i in range(1, num_layers + 1):
        x = rnn(hidden, return_sequences=True, dropout=dropout, name=f"{cell}{i}")(x)
    outputs = layers.Dense(vocab_size, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name=name)


def lstm(
    vocab_size: int = 2000,
    seq_len: int = 20,
    embed_dim: int = 128,
    hidden: int = 128,
    num_layers: int = 2,
    dropout: float = 0.0,
) -> Any:
    """A word-level LSTM language model (Zaremba et al. 2014): embedding, stacked LSTMs, softmax at every step.

    PTB sizes: ``vocab_size=10000, seq_len=35`` with ``hidden=embed_dim=`` 200 (small),
    650 (medium) or 1500 (large); the 2016 benchmark used ``hidden=256, seq_len=32``.

    Args:
        vocab_size: Words in the vocabulary (embedding rows and softmax outputs).
        seq_len: Time steps per example.
        embed_dim: Width of the word embedding.
        hidden: Units of each LSTM layer.
        num_layers: Stacked LSTM layers (named ``lstm1``, ``lstm2``, ...).
        dropout: Input dropout of each LSTM layer.
    """
    return _recurrent_lm("lstm", vocab_size, seq_len, embed_dim, hidden, num_layers, dropout, "lstm")


def gru(
    vocab_size: int = 2000,
    seq_len: int = 20,
    embed_dim: int = 128,
    hidden: int = 128,
    num_layers: int = 2,
    dropout: float = 0.0,
) -> Any:
    """The same language model as :func:`lstm` with GRU layers (``gru1``, ``gru2``, ...)."""
    return _recurrent_lm("gru", vocab_size, seq_len, embed_dim, hidden, num_layers, dropout, "gru")


def char_lm(
    vocab_size: int = 96, seq_len: int = 64, embed_dim: int = 32, hidden: int = 256, num_layers: int = 1
) -> Any:
    """A character-level LSTM language model (for the Shakespeare recipe)."""
    return _recurrent_lm("lstm", vocab_size, seq_len, embed_dim, hidden, num_layers, 0.0, "char_lm")
