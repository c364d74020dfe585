"""The RPC-over-fast-transport baseline (rpc+shm, rpc+tcp, rpc+verbs): what it carries is a real TensorMessage
on a native wire. (Its conformance and failure tests are the transports' own, in test_conformance.py and
test_failures.py; Keras training over it is in test_data_parallel.py.)"""

from __future__ import annotations

from tests.conftest import run_ranks


def test_messages_are_tensor_messages_split_into_frames_over_the_inner_wire():
    (sender, receiver) = run_ranks("rpc_wire_format", transport="rpc+shm", module="tests.ranks.rpc_workers")
    # 3 MiB + header in 1 MiB frames: 4 frames, each one native write plus a flag.
    assert sender.value["inner_writes"] == 4 and sender.value["inner_flags"] == 4
    assert sender.value["serialized_is_tensor_message"]
    assert receiver.value["parsed"] == {"dtype": "<f4", "shape": [3, 262144], "equal": True}
    assert receiver.value["acks"] == 4  # one release per frame slot
