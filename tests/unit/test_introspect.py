"""rdkeras.introspect in one process: a model's state bytes are its variables' sizes; nothing on the wire."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rdkeras import introspect


def test_one_process_counts_the_variables_and_moves_nothing():
    import keras

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(2, dtype="float16")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    view = introspect.inspect(None)
    kernels = (5 * 7 + 7) * 4 + (7 * 2 + 2) * 2  # float32 then float16 weights
    before = view.state_bytes(model)
    assert before == introspect.StateBytes(parameters=kernels, gradients=kernels, optimizer=0)  # not built yet
    model.fit(np.ones((4, 5), np.float32), np.ones((4, 2), np.float32), epochs=1, verbose=0)
    after = view.state_bytes(model)
    # Adam: two moments per weight, each of the weight's dtype, and its iteration count and learning rate.
    assert after.optimizer == 2 * kernels + 8 + 4
    assert after.as_dict() == {"parameters": kernels, "gradients": kernels, "optimizer": 2 * kernels + 12}
    assert view.traffic() == {} and view.bytes_written() == 0.0 and view.workers == 1
    assert view.plan is None and view.plan_text() == "" and view.shard == "none"
    with pytest.raises(ValueError, match="needs a strategy"):
        view.algorithm_for(1 << 20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.parameters = 0  # type: ignore[misc]


def test_the_package_names_it():
    import rdkeras

    assert rdkeras.introspect.inspect is introspect.inspect and "introspect" in rdkeras.__all__
