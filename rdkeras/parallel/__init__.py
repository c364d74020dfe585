"""How a compiled Keras model is spread over workers (data parallel now; model parallel later)."""
