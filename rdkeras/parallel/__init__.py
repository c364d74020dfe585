"""How a compiled Keras model is spread over workers: data, model (pipeline) and hybrid parallelism."""
