"""The RPC-over-fast-transport baseline (rpc+shm, rpc+tcp, rpc+verbs): what it carries is a real TensorMessage
on a native wire, and Keras trains over it. (Its conformance and failure tests are the transports' own, in
test_conformance.py and test_failures.py.)"""

from __future__ import annotations

from tests.conftest import run_ranks


def test_messages_are_tensor_messages_split_into_frames_over_the_inner_wire():
    (sender, receiver) = run_ranks("rpc_wire_format", transport="rpc+shm", module="tests.multiproc.rpc_workers")
    # 3 MiB + header in 1 MiB frames: 4 frames, each one native write plus a flag.
    assert sender.value["inner_writes"] == 4 and sender.value["inner_flags"] == 4
    assert sender.value["serialized_is_tensor_message"]
    assert receiver.value["parsed"] == {"dtype": "<f4", "shape": [3, 262144], "equal": True}
    assert receiver.value["acks"] == 4  # one release per frame slot


def test_fit_over_rpc_matches_single_process():
    # Both RPC transports, ring allreduce and parameter servers, in one launch; global batch 16.
    import numpy as np

    configs = [["mlp", t, m] for t in ("rpc+shm", "rpc+tcp") for m in ("allreduce", "ps")]
    results = run_ranks(
        "fit_model_many", 2, transport="shm", timeout=300, module="tests.multiproc.keras_workers", configs=configs,
        batch=16,
    )  # fmt: skip
    for kind, transport, mode in configs:
        key = f"{kind}/{transport}/{mode}"
        runs = [r.value[key] for r in results]
        assert runs[0]["transport"] == transport
        for got, want in zip(runs[0]["weights"], results[0].value["mlp/reference"]["weights"], strict=True):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5, err_msg=key)
        assert runs[1]["weights"] == runs[0]["weights"] and runs[1]["evaluate"] == runs[0]["evaluate"], key
