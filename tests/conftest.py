"""Shared fixtures: a helper to run functions on N ranks, and /dev/shm leak checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rdkeras import _engine
from rdkeras.launch import RankResult, spawn_call

TESTS_DIR = Path(__file__).resolve().parent
_VERBS_WHY = _engine.verbs_why_not_viable()
# verbs runs where an RDMA device exists (inside the SoftRoCE VM: tests/verbs/); elsewhere it is skipped.
VERBS = pytest.param("verbs", marks=pytest.mark.skipif(bool(_VERBS_WHY), reason=f"verbs: {_VERBS_WHY}"))
NATIVE = ["shm", "tcp", VERBS]
ALL_TRANSPORTS = ["shm", "tcp", VERBS, "grpc"]
# The RPC baseline over each native wire: the conformance tests run over these as well.
RPC = ["rpc+shm", "rpc+tcp", pytest.param("rpc+verbs", marks=VERBS.marks)]


def run_ranks(
    target: str,
    world_size: int = 2,
    *,
    transport: str = "shm",
    timeout: float = 120,
    check: bool = True,
    env: dict | None = None,
    per_rank_env: list | None = None,
    only_ranks: list | None = None,
    module: str = "tests.multiproc.workers",
    **kwargs,
) -> list[RankResult]:
    """Runs ``<module>:<target>(**kwargs)`` on every rank and returns the results.

    With `check`, every rank must exit 0; otherwise ranks run to the end even if one dies.
    """
    full_env = {
        "RDKERAS_TRANSPORT": transport,
        "RDKERAS_TIMEOUT": "60",
        "PYTHONPATH": str(TESTS_DIR.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    full_env.update(env or {})
    results = spawn_call(
        f"{module}:{target}",
        world_size,
        kwargs,
        timeout=timeout,
        env=full_env,
        per_rank_env=per_rank_env,
        only_ranks=only_ranks,
        stop_on_failure=check,
    )
    if check:
        for r in results:
            assert r.returncode == 0, f"rank {r.rank} failed:\n{r.output[-3000:]}"
    return results


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Nothing a test runs may leave files in /dev/shm."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.exists() else set()
    yield
    after = set(shm.iterdir()) if shm.exists() else set()
    assert after <= before, f"leaked in /dev/shm: {sorted(map(str, after - before))}"
