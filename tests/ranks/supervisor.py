"""Kill trials: N workers, one of them killed at a chosen moment, every survivor timed and read.

The supervisor does what a launcher does for its workers (and what `rdkeras.launch`
is to do, see docs/reliability.md): it hosts the job's store (``RDKERAS_STORE=launcher``)
and, when a worker exits badly, reports it there (``StoreServer.abort``). That is what
makes a death *during start-up* -- before the victim reached the store, or before rank 0
listened -- as visible to the others as a death later on.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdkeras.rendezvous import StoreServer

REPO = Path(__file__).resolve().parents[2]
_MARK = "@@rdkeras-result@@"


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen
    lines: list = field(default_factory=list)
    ended_at: float | None = None
    returncode: int | None = None
    value: Any = None

    @property
    def output(self) -> str:
        return "".join(self.lines)


@dataclass
class Trial:
    victim: int
    killed_at: float  # seconds after start
    workers: list
    kill_time: float  # monotonic

    def survivors(self) -> list[Worker]:
        return [w for w in self.workers if w.rank != self.victim]

    def exit_seconds(self) -> list[float]:
        """Each survivor's exit, in seconds after the victim died (inf: still running, killed)."""
        return [(w.ended_at or float("inf")) - self.kill_time for w in self.survivors()]


def _status(rc: int) -> str:
    return f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"


def run_trial(
    target: str,
    world_size: int,
    victim: int,
    kill_after: float,
    *,
    transport: str,
    kwargs: dict | None = None,
    timeout: float = 60,
    worker_timeout: float = 60,
    stop_signal: int = signal.SIGKILL,
    host_store: bool = True,
    extra_env: dict[str, str] | None = None,
) -> Trial:
    """Starts `world_size` workers running ``tests.ranks.workers:<target>(**kwargs)``, sends `victim`
    `stop_signal` (SIGKILL: a death; SIGSTOP: a stall) `kill_after` seconds later, and waits (up to `timeout`)
    for the rest to end. `host_store`: this process hosts the store and reports deaths, as a launcher does;
    else rank 0 hosts it and nobody reports, as under srun, TF_CONFIG or torchrun."""
    token = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, token.encode(), world_size) if host_store else None
    from rdkeras.launch import free_port

    port = server.port if server is not None else free_port()
    code = (
        "import json, sys\n"
        "from tests.ranks import workers\n"
        f"value = getattr(workers, {target!r})(**json.loads(sys.argv[1]))\n"
        f"print({_MARK!r} + json.dumps(value), flush=True)\n"
    )
    workers: list[Worker] = []
    readers: list[threading.Thread] = []
    try:
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RDKERAS_RANK=str(rank),
                RDKERAS_WORLD_SIZE=str(world_size),
                RDKERAS_MASTER_ADDR="127.0.0.1",
                RDKERAS_MASTER_PORT=str(port),
                RDKERAS_JOB_TOKEN=token,
                RDKERAS_STORE="launcher" if host_store else "rank0",
                RDKERAS_TRANSPORT=transport,
                RDKERAS_TIMEOUT=str(worker_timeout),
                PYTHONUNBUFFERED="1",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **(extra_env or {}),
            )
            proc = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(kwargs or {})],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            workers.append(Worker(rank, proc))
        start = time.monotonic()
        readers = [threading.Thread(target=lambda w=w: w.lines.extend(w.proc.stdout), daemon=True) for w in workers]
        for t in readers:
            t.start()
        kill_time = None
        while any(w.ended_at is None for w in workers) and time.monotonic() - start < timeout:
            now = time.monotonic()
            if kill_time is None and now - start >= kill_after:
                os.kill(workers[victim].proc.pid, stop_signal)
                kill_time = now
            for w in workers:
                if w.ended_at is None and w.proc.poll() is not None:
                    w.ended_at, w.returncode = time.monotonic(), w.proc.returncode
                    if w.returncode != 0 and server is not None:  # as a launcher does: tell the others who died
                        server.abort(w.rank, _status(w.returncode))
            if stop_signal != signal.SIGKILL and all(w.ended_at is not None for w in workers if w.rank != victim):
                break  # the stalled victim never ends by itself
            time.sleep(0.005)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.wait()
        if server is not None:
            server.close()
    for t in readers:
        t.join(timeout=5)
    for w in workers:
        w.proc.stdout.close()  # type: ignore[union-attr]
        w.returncode = w.proc.returncode
        for line in w.lines:
            if line.startswith(_MARK):
                w.value = json.loads(line[len(_MARK) :])
    return Trial(victim, kill_after, workers, kill_time if kill_time is not None else float("nan"))
