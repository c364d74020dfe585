"""Sharded checkpoints written by some workers and resumed by others (tests/multiproc/test_sharded_checkpoint.py)."""

from __future__ import annotations

import numpy as np


def train(
    directory: str,
    epochs: int,
    shard: str | None,
    load: bool = False,
    save: bool = False,
    backup: str = "",
    save_first: bool = False,
) -> dict:
    """A small model (an Embedding, Dense layers, AdamW on a decaying schedule) fit for `epochs` on fixed data in
    a fixed order; `shard` None: one process without a strategy. Loads the checkpoint in `directory` first, or saves
    one there after (`save_first`: before fit, its weights as built), as asked. `backup` "interrupt": a
    BackupAndRestore in `directory`, the run stopped by an error at the start of the second epoch (the process ends
    as a killed one would); "resume": a BackupAndRestore there."""
    import keras

    from rdkeras.parallel import sharded_checkpoint

    strategy = None
    if shard is not None:
        import rdkeras

        strategy = rdkeras.RDMAStrategy(shard=shard)
    # (`save_first`: each worker builds other weights; the chief's are one process's)
    keras.utils.set_random_seed(5 + (strategy.engine.rank if strategy is not None and save_first else 0))
    rng = np.random.default_rng(3)
    x = rng.integers(0, 37, (64, 5)).astype("int32")
    y = (x.sum(axis=1) % 3).astype("int32")
    with strategy.scope() if strategy else _nothing():
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(37, 7),
                                  keras.layers.Flatten(), keras.layers.Dense(13, activation="tanh"),
                                  keras.layers.Dense(3)])  # fmt: skip
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.8)
        model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    if save_first:
        strategy.save_checkpoint(model, directory)  # type: ignore[union-attr]
    if load:
        if strategy is not None:
            strategy.load_checkpoint(model, directory)
        else:
            sharded_checkpoint.load(directory, model)
    callbacks = [keras.callbacks.BackupAndRestore(directory)] if backup else []
    if backup == "interrupt":

        class Interrupt(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
                if epoch == 1:
                    raise KeyboardInterrupt

        callbacks.append(Interrupt())
        try:
            model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
        except KeyboardInterrupt:
            strategy.close()  # type: ignore[union-attr]
            return {"interrupted": True}
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    if save:
        strategy.save_checkpoint(model, directory)  # type: ignore[union-attr]
    out = {"weights": [w.astype(np.float64).tolist() for w in model.get_weights()], "loss": history.history["loss"],
           "iterations": int(model.optimizer.iterations.numpy())}  # fmt: skip
    if strategy is not None:
        strategy.close()
    return out


def _nothing():
    import contextlib

    return contextlib.nullcontext()
