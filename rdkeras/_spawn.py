"""Run a Python callable on N local ranks, one process each (tests and benchmarks).

The seed of the local launcher: it picks a free rendezvous port, generates the
job token, sets the RDKERAS_* environment, and if any rank fails it stops the
others, so nothing is left running.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

_RESULT_MARK = "@@rdkeras-result@@"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    value: Any = None


def worker_env(rank: int, world_size: int, port: int, token: str, extra: dict[str, str] | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        RDKERAS_RANK=str(rank),
        RDKERAS_WORLD_SIZE=str(world_size),
        RDKERAS_MASTER_ADDR="127.0.0.1",
        RDKERAS_MASTER_PORT=str(port),
        RDKERAS_JOB_TOKEN=token,
    )
    env.update(extra or {})
    return env


def spawn_call(
    target: str,
    world_size: int,
    kwargs: dict | None = None,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    per_rank_env: list[dict[str, str]] | None = None,
    only_ranks: list[int] | None = None,
    stop_on_failure: bool = True,
) -> list[RankResult]:
    """Runs ``module:function(**kwargs)`` on every rank; returns each rank's JSON-able result.

    A rank's result is what the function returns. Raises nothing itself:
    inspect ``returncode`` and ``output`` of each RankResult.
    """
    module, func = target.split(":")
    code = (
        "import json, sys, importlib\n"
        f"fn = getattr(importlib.import_module({module!r}), {func!r})\n"
        f"value = fn(**json.loads(sys.argv[1]))\n"
        f"print({_RESULT_MARK!r} + json.dumps(value), flush=True)\n"
    )
    port, token = free_port(), secrets.token_hex(16)
    procs = []
    for rank in range(world_size) if only_ranks is None else only_ranks:
        extra = dict(env or {})
        extra.update((per_rank_env or [{}] * world_size)[rank])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(kwargs or {})],
                env=worker_env(rank, world_size, port, token, extra),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = stop_on_failure and any(p.poll() not in (None, 0) for p in procs)
            if time.monotonic() > deadline or failed:
                time.sleep(0.5 if time.monotonic() <= deadline else 0)  # let a peer report its own error
                break
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    results = []
    for rank, p in zip(range(world_size) if only_ranks is None else only_ranks, procs, strict=True):
        out = p.communicate()[0]
        value = None
        for line in out.splitlines():
            if line.startswith(_RESULT_MARK):
                value = json.loads(line[len(_RESULT_MARK) :])
        results.append(RankResult(rank, p.returncode, out, value))
    return results
