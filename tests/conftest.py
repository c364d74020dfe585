"""Shared fixtures: helpers to run functions on N ranks (as processes or as threads), and /dev/shm leak checks."""

from __future__ import annotations

import importlib
import json
import os
import secrets
import threading
import time
import traceback
from pathlib import Path

import pytest

from rdkeras import _engine
from rdkeras.launch import RankResult, free_port, spawn_call

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


def run_threads(
    target: str,
    world_size: int = 2,
    *,
    transport: str = "shm",
    timeout: float = 120,
    module: str = "tests.multiproc.workers",
    **kwargs,
) -> list[RankResult]:
    """Runs ``<module>:<target>(**kwargs)`` on every rank as a thread of this process (gloo's spawn pattern):
    one Engine per thread, created by ``workers.open_engine``; the engine's blocking calls release the GIL.

    Every rank must return within `timeout`; a rank that raised fails the test with its traceback. Values go
    through JSON as they do from a process, so the same worker serves both.
    """
    from tests.multiproc import workers

    fn = getattr(importlib.import_module(module), target)
    engine = {
        "world_size": world_size,
        "transport": transport,
        "master_addr": "127.0.0.1",
        "master_port": free_port(),
        "token": secrets.token_hex(16),
        "timeout": 60,
    }
    values: list = [None] * world_size
    errors: list[str | None] = [None] * world_size

    def rank(r: int) -> None:
        workers.THREAD_RANK.engine = {**engine, "rank": r}
        try:
            values[r] = json.loads(json.dumps(fn(**kwargs)))
        except BaseException:
            errors[r] = traceback.format_exc()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} of {target} still running after {timeout} s"
    for r, error in enumerate(errors):
        assert error is None, f"rank {r} (a thread) raised:\n{error[-3000:]}"
    return [RankResult(r, 0, "", value) for r, value in enumerate(values)]


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Nothing a test runs may leave files in /dev/shm."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.exists() else set()
    yield
    after = set(shm.iterdir()) if shm.exists() else set()
    assert after <= before, f"leaked in /dev/shm: {sorted(map(str, after - before))}"
