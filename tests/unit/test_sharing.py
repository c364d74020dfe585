"""Variables shared among the members (rdkeras.parallel.collectives.sharing), against a recording stand-in for
the collectives (tests/multiproc/test_shards.py moves real bytes)."""

from __future__ import annotations

import keras
import numpy as np


class _RecordingCollectives:
    """Two members, this one rank 1: from_owners gives each array its owner's value (owner * 100 + the array)."""

    size = 2

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.purposes: list[str | None] = []
        self.released: list[str] = []

    def from_owners(self, arrays, owners, purpose=None):
        self.calls.append([a.nbytes for a in arrays])
        self.purposes.append(purpose)
        return [a + 100.0 * owner for a, owner in zip(arrays, owners, strict=True)]

    def release(self, purpose):
        self.released.append(purpose)


def test_variables_are_shared_a_chunk_at_a_time_each_assigned_before_the_next_is_read(monkeypatch):
    # The start's broadcast held the whole model twice over in copies (1.5 GB of a 168 M GPT-2 worker's peak):
    # in groups of at most a chunk (a larger variable alone), on one ring released after the last.
    from rdkeras.parallel.collectives import sharing

    monkeypatch.setattr(sharing, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(sharing, "KEPT_BYTES", 512)
    sizes = [100, 100, 100, 100, 600, 100]  # float32 elements: 400 B each, and one of 2400 B
    variables = [keras.Variable(np.full(n, i, np.float32)) for i, n in enumerate(sizes)]
    collectives = _RecordingCollectives()
    sharing.share_variables(collectives, variables, [0, 1, 0, 1, 0, 1])  # type: ignore[arg-type]
    assert collectives.calls == [[400, 400], [400, 400], [2400], [400]]
    assert collectives.purposes == ["broadcast"] * 4 and collectives.released == ["broadcast"]
    for i, v in enumerate(variables):
        np.testing.assert_array_equal(v.numpy(), np.full(sizes[i], i + 100.0 * (i % 2), np.float32))
