"""The engine face's typed ends (rdkeras/channels.py): a channel end refuses the other end's call."""

from __future__ import annotations

import numpy as np
import pytest

from rdkeras.channels import DynamicChannel, StaticChannel
from rdkeras.errors import EngineError


class _End:
    def __init__(self) -> None:
        self.sent: list[np.ndarray] = []

    def send(self, data: np.ndarray) -> None:
        self.sent.append(np.array(data))


def test_a_static_channel_end_sends_or_receives_as_its_rank_does():
    end = _End()
    tx = StaticChannel("act", end, True, (2, 3), np.dtype("float32"))  # type: ignore[arg-type]
    tx.send(np.ones((2, 3), np.float32))
    assert len(end.sent) == 1 and end.sent[0].nbytes == 24
    with pytest.raises(EngineError, match=r"static channel 'act': recv\(\) on the rank that sends on it; call send"):
        tx.recv()
    with pytest.raises(ValueError, match=r"carries float32\[2, 3\], got float64\[2, 3\]"):
        tx.send(np.ones((2, 3)))
    rx = StaticChannel("act", end, False, (2, 3), np.dtype("float32"))  # type: ignore[arg-type]
    with pytest.raises(EngineError, match=r"send\(\) on the rank that receives on it; call recv\(\) here"):
        rx.send(np.ones((2, 3), np.float32))


def test_a_dynamic_channel_receiver_cannot_send_or_flush():
    rx = DynamicChannel("seq", _End(), False)  # type: ignore[arg-type]
    for call in (lambda: rx.send(np.ones(3)), rx.flush):
        with pytest.raises(EngineError, match="dynamic channel 'seq'"):
            call()
