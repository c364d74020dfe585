"""Per-process memory caps for the benchmarks: one cgroup v1 memory group a process, made and removed here.

The launcher makes a group a rank (:func:`groups`) and tells the ranks their prefix; each moves itself into its
own (:func:`join_rank`) before it imports TensorFlow. Afterwards :func:`stats` reads
what the kernel counted (peak usage, times the cap was hit, processes the OOM killer ended) and :func:`remove`
takes the group away, also when the run failed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def unavailable(root: Path | None = None) -> str | None:
    """Why per-process caps cannot be set here (under `root`, default :data:`ROOT`), or None when they can."""
    root = ROOT if root is None else root
    if not (root / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller mounted at {root}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (caps need root)"
    return None


def create(name: str, limit_bytes: int, root: Path | None = None) -> Path:
    """A new group under `root` whose processes may hold `limit_bytes` of memory; with swap counted in too where
    the kernel accounts it (``memory.memsw.limit_in_bytes``), so that swapping cannot hide an overrun."""
    root = ROOT if root is None else root
    group = root / name
    group.mkdir()
    try:
        # Pages a process touched before it joined move with it (1: anonymous, 2: file-backed).
        with contextlib.suppress(OSError):
            (group / "memory.move_charge_at_immigrate").write_text("3")
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        if (root / "memory.memsw.limit_in_bytes").exists():  # the kernel accounts swap (memsw >= limit)
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
    except BaseException:
        remove(group)
        raise
    return group


def join(group: Path, pid: int | None = None) -> None:
    """Moves process `pid` (this one by default) into `group`."""
    (group / "cgroup.procs").write_text(str(pid or os.getpid()))


def join_rank(prefix: str | None) -> Path | None:
    """Moves this process into its rank's group, ``PREFIX-RANK`` (as :func:`groups` names them), if there is a
    prefix; before TensorFlow is imported, so that everything the process holds counts against the cap."""
    if not prefix:
        return None
    from rdkeras import cluster

    group = Path(f"{prefix}-{cluster.resolve().rank}")
    join(group)
    return group


def _int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def parse_oom_control(text: str) -> dict[str, int]:
    """``memory.oom_control``'s lines (``oom_kill_disable 0``, ``under_oom 0``, ``oom_kill 1``) as a dict."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def stats(group: Path) -> dict[str, int]:
    """What the kernel counted for `group`: its peak usage (bytes, page cache included), how often an allocation
    hit the cap, and how many of its processes the OOM killer ended (0 on kernels that do not count it)."""
    try:
        oom = parse_oom_control((group / "memory.oom_control").read_text())
    except OSError:
        oom = {}
    return {
        "max_usage_bytes": _int(group / "memory.max_usage_in_bytes"),
        # With swap accounted the combined counter is checked first, so its hits count as the cap's too.
        "failcnt": max(_int(group / "memory.failcnt"), _int(group / "memory.memsw.failcnt")),
        "oom_kill": oom.get("oom_kill", 0),
    }


def remove(group: Path, tries: int = 50) -> None:
    """Takes `group` away. A group still holding processes (ones exiting) is retried for a while, its processes
    first moved to the parent group; a plain folder (a test's stand-in for the cgroup root) is deleted."""
    for _ in range(tries):
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:  # a real group's control files do not count: this is no cgroup
                shutil.rmtree(group, ignore_errors=True)
                return
            if e.errno != errno.EBUSY:
                raise
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    join(group.parent, int(pid))
        time.sleep(0.1)
    raise OSError(errno.EBUSY, f"cgroup {group} still has processes")


@contextlib.contextmanager
def groups(prefix: str, count: int, limit_bytes: int, root: Path | None = None) -> Iterator[list[Path]]:
    """`count` groups ``PREFIX-0``, ``PREFIX-1``, ... under `root`, each capped at `limit_bytes`; removed on exit,
    however the block ends."""
    made: list[Path] = []
    try:
        for rank in range(count):
            made.append(create(f"{prefix}-{rank}", limit_bytes, root))
        yield made
    finally:
        for group in made:
            with contextlib.suppress(OSError):
                remove(group)
