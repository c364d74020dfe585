"""The benchmarks' groups of processes: where each runs."""

from __future__ import annotations

from types import SimpleNamespace

import rdkeras.bench
from rdkeras.bench import measure


def test_an_undistributed_group_keeps_each_processs_rank_so_each_pins_its_own_core(monkeypatch):
    # "Local, N processes at once" (the compute of a distributed step with every core busy) pins each process by
    # its rank (pin_and_thread: rank mod cores); every process once resolved rank 0, so all computed on one core.
    given = {}

    def capture(bench, label, target, workers, kwargs, env=None, timeout=None):
        given.update(env=env, workers=workers, distributed=kwargs["distributed"])
        return None

    monkeypatch.setattr(rdkeras.bench, "run_ranks", capture)
    measure.fit_group("loaded", [], 2, None, {"warmup": 1, "steps": 1}, SimpleNamespace(timeout=60))
    assert given["workers"] == 2 and given["distributed"] is False
    monkeypatch.undo()
    ranks = rdkeras.bench.run_ranks(
        "test", "ranks", "tests.ranks.workers:resolved_rank", 2, {}, env=given["env"], timeout=60
    )
    assert sorted(r.value["rank"] for r in ranks) == [0, 1]
