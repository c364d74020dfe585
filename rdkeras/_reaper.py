"""What a launcher leaves when it dies without cleaning up (SIGKILL, the OOM killer), removed by a reaper.

Each worker gets ``PR_SET_PDEATHSIG`` (the kernel kills it when the launcher dies), but its own children do not,
and nothing removes the folder the workers report into. So :func:`start` starts a reaper next to the workers: a
small interpreter in a session of its own (a terminal's Ctrl-C does not reach it) that reads, from a pipe only
the launcher holds, the process group of each worker started. A launcher that cleaned up says ``done``. A pipe
that ends without it means the launcher died: the reaper kills every group it was told of and removes the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

_CODE = """
import os, shutil, signal, sys
for s in (signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups, done = [], False
with os.fdopen(int(sys.argv[1]), "rb") as pipe:
    for line in pipe:
        if line.strip() == b"done":
            done = True
            break
        groups.append(int(line))
if not done:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(sys.argv[2], ignore_errors=True)
"""


class Reaper:
    """The launcher's end of a reaper that removes `folder` and kills the registered groups if the launcher dies."""

    def __init__(self, folder: str):
        read, self._write = os.pipe()  # (neither end is inherited by the workers: Python's fds are not inheritable)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CODE, str(read), folder],
                pass_fds=(read,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read)

    def watch(self, group: int) -> None:
        """Registers a worker's process group (the worker's pid: it leads a session of its own)."""
        try:
            os.write(self._write, f"{group}\n".encode())
        except OSError:
            pass  # the reaper is gone (killed from outside): the launcher still cleans up itself

    def done(self) -> None:
        """The launcher cleaned up itself: the reaper ends without touching anything."""
        try:
            os.write(self._write, b"done\n")
        except OSError:
            pass
        finally:
            os.close(self._write)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
