"""Worker processes of one node: started, watched, their output forwarded, and never left behind.

``run_workers`` starts one process per command, each in its own process group
and with ``PR_SET_PDEATHSIG`` (the kernel kills it if the launcher dies,
however it dies; a reaper, :mod:`rdkeras._reaper`, then kills its group and
removes the reports folder); forwards output through :class:`_Terminal`;
returns when all ended, one failed or reported a failure (the others get
``FAILURE_GRACE_S`` to notice on their own, one that reported
``REPORTED_GRACE_S`` to exit), or the timeout passed; and kills every
survivor's group on the way out. ``rdkeras.launch`` builds on it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from rdkeras import reports
from rdkeras._reaper import Reaper

_RESULT_MARK = "@@rdkeras-result@@"
# After one worker fails, how long the others get to fail on their own (a dead
# peer is noticed within milliseconds) before they are killed.
FAILURE_GRACE_S = 10.0
# How long a worker that reported what ended it (its traceback follows at once) gets to exit by itself: the
# interpreter's and TensorFlow's teardown can take seconds more on a loaded machine, and the job waits for nothing.
REPORTED_GRACE_S = 5.0

PR_SET_PDEATHSIG = 1
# Lines TensorFlow prints while it starts, kept out of the terminal (not the logs) unless verbose.
_BANNERS = re.compile(
    rb"absl::InitializeLog\(\)|Unable to register cu(DNN|FFT|BLAS) factory|oneDNN custom operations are on|"
    rb"This TensorFlow binary is optimized|TF-TRT Warning|computation placer already registered|"
    rb"Could not find cuda drivers|cuda_executor\.cc.*NUMA node|Created device /job|"
    rb"failed call to cuInit"  # an E line, on every machine without a GPU (rdkeras doctor lists the GPUs)
)


def is_banner(line: bytes) -> bool:
    """Whether a line is one of TensorFlow's start-up banners (left out of what a user reads unless verbose)."""
    return _BANNERS.search(line) is not None


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    output: str
    value: Any = None
    ended_at: float = float("inf")  # when the launcher saw it exit (monotonic)
    tail: deque = field(default_factory=lambda: deque(maxlen=40), repr=False)
    report: dict | None = None  # what the worker said ended it (rdkeras.reports), if it said
    killed: bool = False  # still running when the launcher gave up on it, and killed (ended_at: then)
    unseen: str = ""  # why nobody knows how it ended (another node's launcher did not report), if so


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec function: the child gets SIGKILL when the launcher dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


class _Terminal:
    """Writes several workers' output to one stream: a ``[rank] `` prefix at the start of each
    line and after each carriage return (so a progress bar redraws in place), a newline first
    when another rank's line is unfinished, TensorFlow start-up banners left out unless verbose.

    A line can reach us in pieces (one read ends mid-line); the start of a rank's line is held
    until its end arrives or ``HOLD_S`` passes, so a banner split over two reads is still seen
    whole, and a progress bar lags by at most that much."""

    HOLD_S = 0.05

    def __init__(self, out: BinaryIO | _TextOut, verbose: bool):
        self.out, self.verbose = out, verbose
        self.lock = threading.Lock()
        self.owner: int | None = None  # rank whose line is unfinished on the terminal
        self.at_start = True  # the terminal's cursor is at column 0 (after \n or \r)
        self.held: dict[int, bytes] = {}  # per rank: the start of a line whose end has not come

    def holding(self, rank: int) -> bool:
        return rank in self.held

    def write(self, rank: int, data: bytes) -> None:
        with self.lock:
            self._emit(rank, self.held.pop(rank, b"") + data, hold=True)

    def release(self, rank: int) -> None:
        """Writes what is held for `rank` (its line's end did not come in time, or it exited)."""
        with self.lock:
            if rank in self.held:
                self._emit(rank, self.held.pop(rank), hold=False)

    def _emit(self, rank: int, data: bytes, hold: bool) -> None:
        parts = [p for p in re.split(rb"(?<=[\r\n])", data) if p]
        if hold and parts and not parts[-1].endswith((b"\r", b"\n")) and len(parts[-1]) < 4096:
            self.held[rank] = parts.pop()  # a line begins here; wait a moment for its end
        chunks = []
        for part in parts:
            if not self.verbose and part.endswith(b"\n") and _BANNERS.search(part):
                continue
            if self.owner not in (None, rank):
                chunks.append(b"\n")
                self.at_start = True
            if self.at_start and part not in (b"\n", b"\r"):
                chunks.append(f"[{rank}] ".encode())
            chunks.append(part)
            self.at_start = part.endswith((b"\n", b"\r"))
            self.owner = None if part.endswith(b"\n") else rank
        if chunks:
            self.out.write(b"".join(chunks))
            self.out.flush()


def run_workers(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict],
    *,
    ranks: Sequence[int] | None = None,
    timeout: float | None = None,
    stop_on_failure: bool = True,
    forward: bool = False,
    verbose: bool = False,
    log_dir: str | Path | None = None,
    watch: Any = None,
    on_exit: Callable[[int, int], None] | None = None,
) -> list[RankResult]:
    """Runs one process per command; returns when all ended, one failed, or the timeout passed.

    `watch` (an elastic job's :class:`rdkeras.launch_agent.ElasticAgent`) hears of every exit (``exited(rank,
    returncode)``); a worker that fails then ends the job only once `watch.error` says the others cannot go on.
    `on_exit(rank, returncode)` hears of every exit too (a launcher that tells the job's store).

    With `forward`, output is written to this process's stdout as it comes, each line
    prefixed by the rank (see :class:`_Terminal`). With `log_dir`, each rank's output
    also goes to ``log_dir/worker-RANK.log``. Survivors are killed (their whole process
    group) before returning, also when this function is interrupted.
    """
    ranks = list(range(len(commands))) if ranks is None else list(ranks)
    # Workers report what ended them here (rdkeras.reports): the cause, where exit order would mislead.
    report_dir = tempfile.mkdtemp(prefix="rdkeras-reports-")
    envs = [{**env, "RDKERAS_REPORT_DIR": report_dir} for env in envs]
    reaper = Reaper(report_dir)  # (removes the folder, and kills the workers' groups, if this process is killed)
    logs = []
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        logs = [open(Path(log_dir) / f"worker-{r}.log", "wb") for r in ranks]
    preexec = _die_with_parent(os.getpid())
    procs: list[subprocess.Popen] = []
    terminal = _Terminal(sys.stdout.buffer if hasattr(sys.stdout, "buffer") else _TextOut(), verbose)
    chunks: list[list[bytes]] = [[] for _ in commands]
    readers: list[threading.Thread] = []

    def pump(i: int) -> None:
        fd = procs[i].stdout.fileno()  # type: ignore[union-attr]
        while True:
            if forward and terminal.holding(ranks[i]) and not select.select([fd], [], [], terminal.HOLD_S)[0]:
                terminal.release(ranks[i])  # the rest of that line did not come in time
                continue
            if not (data := os.read(fd, 65536)):
                break
            chunks[i].append(data)
            if logs:
                logs[i].write(data)
                logs[i].flush()
            if forward:
                terminal.write(ranks[i], data)
        if forward:
            terminal.release(ranks[i])

    results = [RankResult(r, None, "") for r in ranks]

    def note_exits() -> None:
        now = time.monotonic()
        for i, p in enumerate(procs):
            if p.poll() is not None and results[i].ended_at == float("inf"):
                results[i].ended_at = now
                if watch is not None:
                    watch.exited(ranks[i], p.returncode)
                if on_exit is not None:
                    on_exit(ranks[i], p.returncode)

    def start(cmd: Sequence[str], env: dict) -> None:
        procs.append(
            subprocess.Popen(
                list(cmd),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                bufsize=0,
                start_new_session=True,
                preexec_fn=preexec,  # runs between fork and exec: only prctl and getppid
            )
        )
        reaper.watch(procs[-1].pid)
        readers.append(threading.Thread(target=pump, args=(len(procs) - 1,), daemon=True))
        readers[-1].start()

    try:
        for cmd, env in zip(commands, envs, strict=True):
            start(cmd, env)
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            note_exits()
            for worker, env in watch.take_spawns(envs[0]) if watch is not None else []:
                ranks.append(worker)  # a replacement (an elastic job): the same command, its own id
                results.append(RankResult(worker, None, ""))
                chunks.append([])
                if log_dir is not None:
                    logs.append(open(Path(log_dir) / f"worker-{worker}.log", "wb"))
                start(commands[0], env)
            if watch is not None:
                if watch.finished():
                    break  # every member is done: replacements still waiting to join are not needed
                failed = watch.error is not None
            else:  # a failure: a bad exit, or a report (a stalled rank's peers report it before they exit)
                failed = stop_on_failure and (any(p.poll() not in (None, 0) for p in procs) or _reported(report_dir))
            if failed or (deadline is not None and time.monotonic() > deadline):
                if failed:  # let the others notice the failure and report it themselves
                    end = time.monotonic() + FAILURE_GRACE_S
                    while time.monotonic() < end and not _nothing_to_wait_for(procs, ranks, report_dir):
                        note_exits()
                        time.sleep(0.05)
                break
            time.sleep(0.02)
    finally:
        note_exits()
        for i, p in enumerate(procs):
            if p.poll() is None:
                results[i].killed, results[i].ended_at = True, time.monotonic()
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
        for f in logs:
            f.close()
        found = reports.read(report_dir, ranks)
        shutil.rmtree(report_dir, ignore_errors=True)  # (here: on SIGINT and SIGTERM too; on SIGKILL, the reaper)
        reaper.done()
    for i, p in enumerate(procs):
        results[i].report = found.get(ranks[i])
        results[i].returncode = p.returncode
        results[i].output = b"".join(chunks[i]).decode(errors="replace")
        lines = results[i].output.splitlines(keepends=True)
        results[i].tail.extend(lines[-40:])
        for line in lines:
            if line.startswith(_RESULT_MARK):
                results[i].value = json.loads(line[len(_RESULT_MARK) :])
    return results


class _TextOut:
    """stdout without a byte buffer (a notebook's stream): bytes decoded as they come."""

    def write(self, data: bytes) -> None:
        sys.stdout.write(data.decode(errors="replace"))

    def flush(self) -> None:
        sys.stdout.flush()


def _reported(report_dir: str) -> bool:
    """Whether a worker wrote a failure report (rdkeras.reports) into `report_dir`."""
    try:
        return any(name.startswith("failure-") and name.endswith(".json") for name in os.listdir(report_dir))
    except OSError:
        return False


def _nothing_to_wait_for(procs: list[subprocess.Popen], ranks: list[int], report_dir: str) -> bool:
    """Whether no worker still running will end by itself soon: each is one the others' reports blame that has
    not reported itself (a stopped or hung rank cannot end by itself, nor say anything), or one that reported
    REPORTED_GRACE_S ago or more (it said why it stops and printed its traceback; its teardown is not waited for),
    or one named hung that reported so (its stacks are in its log: it will not end by itself either). A rank
    named hung gets a moment to write its stacks; one that said nothing yet, the rest of the failure's grace."""
    running = {r for p, r in zip(procs, ranks, strict=True) if p.poll() is None}
    if not running:
        return True
    found, now = reports.read(report_dir, ranks), time.time()
    blamed = {int(report["blamed"]) for report in found.values()}
    for rank in running:
        report = found.get(rank)
        if report is None and rank not in blamed:
            return False  # it has not noticed yet
        if report is not None and not report.get("hung") and now - report["time"] < REPORTED_GRACE_S:
            return False  # on its way out
    return not reports.waiting_for_stacks(found, running, now)


def first_failure(results: list[RankResult]) -> RankResult | None:
    """The worker that exited badly first (often, not always, the cause: see :func:`failed_rank`)."""
    failed = [r for r in results if r.returncode not in (0, None)]
    return min(failed, key=lambda r: r.ended_at) if failed else None


def failed_rank(results: list[RankResult]) -> RankResult | None:
    """The worker to blame: the one the workers' own reports name (an error of its own, or the rank the others
    lost), else the first that exited badly, else one still running at the timeout, else None."""
    if any(r.returncode != 0 for r in results):
        known = reports.cause({r.rank: r.report for r in results if r.report is not None})
        if known is not None:
            return next((r for r in results if r.rank == known["blamed"]), None) or first_failure(results)
    return first_failure(results) or next((r for r in results if r.returncode is None), None)


def cause_of(bad: RankResult, results: list[RankResult]) -> str:
    """Why `bad` is blamed, in the words of the report that blames it (or its exit status)."""
    known = reports.cause({r.rank: r.report for r in results if r.report is not None})
    if known is None or known["blamed"] != bad.rank:
        return _status(bad)
    seen = "" if known["reporter"] == known["blamed"] else f", seen by rank {known['reporter']}"
    return f"{reports.subject(known['why'], bad.rank)}{seen}; then {_status(bad)}"


def _status(r: RankResult) -> str:
    if r.unseen:
        return r.unseen
    if r.killed and r.report is not None and not r.report.get("hung"):
        return f"killed by the launcher (it reported, then did not exit within {REPORTED_GRACE_S:.0f} s)"
    if r.killed and r.report is not None:
        return "killed by the launcher once named hung (it would not end by itself; its stacks are in its output)"
    if r.killed:
        return "killed by the launcher (still running at the timeout, or after the others had failed)"
    if r.returncode is None:
        return "timeout"
    return f"exit code {r.returncode}" if r.returncode >= 0 else f"signal {-r.returncode}"


def _failure_message(r: RankResult, results: list[RankResult] | None = None) -> str:
    how = cause_of(r, results) if results is not None else _status(r)
    tail = "".join(r.tail).rstrip() or "(nothing)"
    return f"worker rank {r.rank} failed first ({how}); its last output:\n{tail}"
