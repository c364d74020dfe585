"""Local launcher: run a script or a function on N worker processes of this machine.

    python -m rdkeras.launch -n 4 train.py --epochs 3
    rdkeras.launch(train_fn, num_workers=4)           # from a notebook

It generates the job token, picks a free rendezvous port, sets the RDKERAS_*
environment of each worker, forwards worker output with a "[rank] " prefix,
and if any worker fails it stops the others and reports that worker's error.
Nothing is left running: workers get their own process group, killed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_RESULT_MARK = "@@rdkeras-result@@"
# After one worker fails, how long the others get to fail on their own (a dead
# peer is noticed within milliseconds) before they are killed.
FAILURE_GRACE_S = 10.0


class LaunchError(RuntimeError):
    """A worker failed; the message names its rank and shows the end of its output."""

    def __init__(self, message: str, results: list[RankResult]):
        super().__init__(message)
        self.results = results


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    output: str
    value: Any = None
    ended_at: float = float("inf")  # when the launcher saw it exit (monotonic)
    tail: deque = field(default_factory=lambda: deque(maxlen=40), repr=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world_size: int, port: int, token: str, extra: dict[str, str] | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        RDKERAS_RANK=str(rank),
        RDKERAS_WORLD_SIZE=str(world_size),
        RDKERAS_MASTER_ADDR="127.0.0.1",
        RDKERAS_MASTER_PORT=str(port),
        RDKERAS_JOB_TOKEN=token,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def run_workers(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict],
    *,
    ranks: Sequence[int] | None = None,
    timeout: float | None = None,
    stop_on_failure: bool = True,
    forward: bool = False,
) -> list[RankResult]:
    """Runs one process per command; returns when all ended, one failed, or the timeout passed.

    With `forward`, output lines are printed with a "[rank] " prefix as they come.
    Survivors are killed (their whole process group) before returning.
    """
    ranks = list(range(len(commands))) if ranks is None else list(ranks)
    procs = [
        subprocess.Popen(
            list(cmd),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            bufsize=1,
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    results = [RankResult(r, None, "") for r in ranks]
    chunks: list[list[str]] = [[] for _ in procs]
    lock = threading.Lock()

    def pump(i: int) -> None:
        for line in procs[i].stdout:  # type: ignore[union-attr]
            chunks[i].append(line)
            results[i].tail.append(line)
            if forward and not line.startswith(_RESULT_MARK):
                with lock:
                    sys.stdout.write(f"[{ranks[i]}] {line}")
                    sys.stdout.flush()

    readers = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout

    def note_exits() -> None:
        now = time.monotonic()
        for i, p in enumerate(procs):
            if p.poll() is not None and results[i].ended_at == float("inf"):
                results[i].ended_at = now

    try:
        while any(p.poll() is None for p in procs):
            note_exits()
            failed = stop_on_failure and any(p.poll() not in (None, 0) for p in procs)
            if failed or (deadline is not None and time.monotonic() > deadline):
                if failed:  # let the others notice the failure and report it themselves
                    end = time.monotonic() + FAILURE_GRACE_S
                    while time.monotonic() < end and any(p.poll() is None for p in procs):
                        note_exits()
                        time.sleep(0.05)
                break
            time.sleep(0.02)
    finally:
        note_exits()
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.wait()
        for t in readers:
            t.join(timeout=5)
        for p in procs:
            p.stdout.close()  # type: ignore[union-attr]
    for i, p in enumerate(procs):
        results[i].returncode = p.returncode
        results[i].output = "".join(chunks[i])
        for line in chunks[i]:
            if line.startswith(_RESULT_MARK):
                results[i].value = json.loads(line[len(_RESULT_MARK) :])
    return results


def first_failure(results: list[RankResult]) -> RankResult | None:
    """The worker that failed first (the others usually failed because of it)."""
    failed = [r for r in results if r.returncode not in (0, None)]
    return min(failed, key=lambda r: r.ended_at) if failed else None


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
    """Runs ``module:function(**kwargs)`` on every rank; each RankResult.value is what it returned (JSON).

    Raises nothing itself: inspect ``returncode`` and ``output``. (Tests and benchmarks use this.)
    """
    module, func = target.split(":")
    code = (
        "import json, sys, importlib\n"
        f"fn = getattr(importlib.import_module({module!r}), {func!r})\n"
        "value = fn(**json.loads(sys.argv[1]))\n"
        f"print({_RESULT_MARK!r} + json.dumps(value), flush=True)\n"
    )
    port, token = free_port(), secrets.token_hex(16)
    ranks = list(range(world_size)) if only_ranks is None else only_ranks
    envs = []
    for rank in ranks:
        extra = dict(env or {})
        extra.update((per_rank_env or [{}] * world_size)[rank])
        envs.append(worker_env(rank, world_size, port, token, extra))
    commands = [[sys.executable, "-c", code, json.dumps(kwargs or {})] for _ in ranks]
    return run_workers(commands, envs, ranks=ranks, timeout=timeout, stop_on_failure=stop_on_failure)


def launch(
    fn: Callable[..., Any],
    num_workers: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    *,
    transport: str | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on `num_workers` local processes and returns their results.

    Usable from a notebook, like Accelerate's ``notebook_launcher``: `fn` (and
    what it refers to) travels by value with cloudpickle, so it may be defined
    in the notebook itself. Worker output appears with a "[rank] " prefix. If a
    worker fails, the others are stopped and LaunchError names the failed rank.
    """
    import cloudpickle

    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    with tempfile.TemporaryDirectory(prefix="rdkeras-launch-") as tmp:
        payload = os.path.join(tmp, "fn.pkl")
        with open(payload, "wb") as f:
            cloudpickle.dump((fn, tuple(args), dict(kwargs or {})), f)
        code = (
            "import sys, pickle\n"
            "fn, args, kwargs = pickle.load(open(sys.argv[1], 'rb'))\n"
            "value = fn(*args, **kwargs)\n"
            "import os\n"
            "with open(os.path.join(sys.argv[2], 'result-%s.pkl' % os.environ['RDKERAS_RANK']), 'wb') as f:\n"
            "    import cloudpickle; cloudpickle.dump(value, f)\n"
        )
        extra = dict(env or {})
        if transport:
            extra["RDKERAS_TRANSPORT"] = transport
        port, token = free_port(), secrets.token_hex(16)
        envs = [worker_env(r, num_workers, port, token, extra) for r in range(num_workers)]
        results = run_workers(
            [[sys.executable, "-c", code, payload, tmp]] * num_workers, envs, timeout=timeout, forward=True
        )
        bad = first_failure(results) or next((r for r in results if r.returncode is None), None)
        if bad is not None:
            raise LaunchError(_failure_message(bad), results)
        values = []
        for r in range(num_workers):
            with open(os.path.join(tmp, f"result-{r}.pkl"), "rb") as f:
                values.append(cloudpickle.load(f))
        return values


def _status(r: RankResult) -> str:
    if r.returncode is None:
        return "timeout"
    return f"exit code {r.returncode}" if r.returncode >= 0 else f"signal {-r.returncode}"


def _failure_message(r: RankResult) -> str:
    how = _status(r)
    tail = "".join(r.tail).rstrip() or "(nothing)"
    return f"worker rank {r.rank} failed first ({how}); its last output:\n{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rdkeras.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="worker processes to start")
    parser.add_argument("--transport", help="sets RDKERAS_TRANSPORT for every worker (shm, tcp, grpc, auto)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before all workers are stopped")
    parser.add_argument("script", help="the Python script to run (or -m module)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    a = parser.parse_args(argv)
    if a.num_workers < 1:
        parser.error(f"-n must be at least 1, got {a.num_workers}")
    cmd = [sys.executable, *(["-m", a.args[0], *a.args[1:]] if a.script == "-m" else [a.script, *a.args])]
    if a.script != "-m" and not os.path.exists(a.script):
        parser.error(f"no such script: {a.script}")
    extra = {"RDKERAS_TRANSPORT": a.transport} if a.transport else {}
    port, token = free_port(), secrets.token_hex(16)
    envs = [worker_env(r, a.num_workers, port, token, extra) for r in range(a.num_workers)]
    results = run_workers([cmd] * a.num_workers, envs, timeout=a.timeout, forward=True)
    bad = first_failure(results) or next((r for r in results if r.returncode is None), None)
    if bad is not None:
        print(f"rdkeras.launch: {_failure_message(bad)}", file=sys.stderr)
        for r in results:
            after = f", {r.ended_at - bad.ended_at:.1f} s after rank {bad.rank}" if r is not bad else ""
            print(f"rdkeras.launch: rank {r.rank}: {_status(r)}{after}", file=sys.stderr)
        return bad.returncode if bad.returncode and bad.returncode > 0 else 1
    return 0


class _CallableModule(types.ModuleType):
    """``rdkeras.launch(fn, num_workers=N)`` and ``python -m rdkeras.launch`` share one name."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return launch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
