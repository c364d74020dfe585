"""Shared fixtures: helpers to run functions on N ranks (as processes or as threads), and /dev/shm leak checks."""

from __future__ import annotations

import importlib
import json
import os
import secrets
import shutil
import tempfile
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
_RUN_TMP = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    """The processes the tests start make their temporary files in a folder of this run, removed at its end: a
    worker a test kills on purpose never runs TensorFlow's exit hook that deletes autograph's generated modules,
    and they would pile up in /tmp (about ten per run of the elastic tests)."""
    tempfile.gettempdir()  # this process, and pytest's tmp_path folders, keep the usual one
    folder = tempfile.mkdtemp(prefix="rdkeras-tests-")
    config.stash[_RUN_TMP] = (folder, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder, previous = config.stash[_RUN_TMP]
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
    shutil.rmtree(folder, ignore_errors=True)


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
    module: str = "tests.ranks.workers",
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
    module: str = "tests.ranks.workers",
    **kwargs,
) -> list[RankResult]:
    """Runs ``<module>:<target>(**kwargs)`` on every rank as a thread of this process (gloo's spawn pattern):
    one Engine per thread, created by ``workers.open_engine``; the engine's blocking calls release the GIL.

    Every rank must return within `timeout`; a rank that raised fails the test with its traceback. Values go
    through JSON as they do from a process, so the same worker serves both.
    """
    from tests.ranks import workers

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


class InTurn:
    """The results of one launch_in_turn: ``in_turn(key)`` is job `key`'s RankResults (`value`: what it returned
    on that rank), as run_ranks would give them for a launch of its own; if the job failed or never ran, the
    test fails with the traceback of the job that failed (or the launch's output)."""

    def __init__(self, ranks: list[RankResult], kwargs: dict[str, dict]):
        self.ranks = ranks
        self.kwargs = kwargs  # each job's arguments, by key

    def __call__(self, key: str) -> list[RankResult]:
        problems, out = [], []
        for r in self.ranks:
            jobs = r.value or {}
            if key not in jobs:
                failed = [k for k, v in jobs.items() if "error" in v]
                why = (
                    f"job {failed[0]!r} failed before it:\n{jobs[failed[0]]['error'][-3000:]}"
                    if failed
                    else f"the launch ended (exit code {r.returncode}):\n{r.output[-3000:]}"
                )
                problems.append(f"rank {r.rank} never ran it: {why}")
            elif "error" in jobs[key]:
                problems.append(f"it failed on rank {r.rank}:\n{jobs[key]['error'][-3000:]}")
            else:
                out.append(RankResult(r.rank, r.returncode, r.output, jobs[key]["value"]))
        if problems:
            pytest.fail(f"{key}: " + "\n".join(problems))
        return out


def launch_in_turn(
    jobs: dict[str, tuple], world_size: int, *, transport: str = "shm", timeout: float = 600, env: dict | None = None
) -> InTurn:
    """Runs several tests' workloads in one launch of `world_size` rank processes, one after another, so that a
    process imports TensorFlow once rather than once per test (tests.ranks.in_turn).

    `jobs` maps a key to ``("module:function", kwargs)``, or ``(target, kwargs, env)`` with variables for that job
    alone (e.g. its RDKERAS_TRANSPORT). Each job gets a rendezvous port of its own and starts with a fresh Keras
    session, as it would in processes of its own.
    """
    spec = [
        {
            "key": key,
            "target": target,
            "kwargs": kwargs,
            "env": {"RDKERAS_MASTER_PORT": str(free_port()), **(more[0] if more else {})},
        }
        for key, (target, kwargs, *more) in jobs.items()
    ]
    ranks = run_ranks(
        "run",
        world_size,
        transport=transport,
        timeout=timeout,
        check=False,
        env=env,
        module="tests.ranks.in_turn",
        jobs=spec,
    )
    return InTurn(ranks, {job["key"]: job["kwargs"] for job in spec})


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Nothing a test runs may leave files in /dev/shm."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.exists() else set()
    yield
    after = set(shm.iterdir()) if shm.exists() else set()
    assert after <= before, f"leaked in /dev/shm: {sorted(map(str, after - before))}"
