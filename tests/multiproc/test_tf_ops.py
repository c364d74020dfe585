"""rdkeras's native TensorFlow ops (RdkerasSend / RdkerasRecv) against the numpy_function hops they replace."""

import pytest

from tests.conftest import run_ranks, run_threads

MODULE = "tests.ranks.op_workers"
STEPS = 3


def _expected() -> list:
    """What rank 0 gets back: its float32 tensor and int32 tensor, each plus one."""
    out = []
    for i in range(STEPS):
        x = [[float((3 * r + c) * (i + 1) + 1) for c in range(3)] for r in range(4)]
        out.append([x, [n - i + 1 for n in range(5)]])
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_native_ops_carry_tensors_intact(transport):
    back, echo = run_threads("round_trip", 2, transport=transport, module=MODULE, steps=STEPS)
    assert back.value["came"] == _expected()
    assert back.value["ops"] == echo.value["ops"] == ["RdkerasRecv", "RdkerasSend"]


def test_without_native_ops_the_hops_are_numpy_functions_and_agree():
    back, echo = run_ranks("round_trip", 2, module=MODULE, env={"RDKERAS_NATIVE_OPS": "0"}, steps=STEPS)
    assert back.value["came"] == _expected()
    assert back.value["ops"] == echo.value["ops"] == ["PyFunc"]


def test_a_tensor_that_does_not_fit_its_channel_is_refused_when_traced():
    sender, _ = run_threads("wrong_shape", 2, module=MODULE)
    assert "static channel 'x' carries float32[4], the op has float32[5]" in sender.value["error"]


def test_a_step_run_after_its_engine_closed_fails_clearly():
    sender, _ = run_threads("after_close", 2, module=MODULE)
    assert sender.value["error"].startswith("AbortedError"), sender.value["error"]
    assert "engine is closed" in sender.value["error"]
