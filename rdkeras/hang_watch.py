"""A hung rank's own side of progress liveness: when a peer names this rank hung, its Python stacks go to its log.

A rank that lives but hangs outside the engine (a callback that sleeps, a deadlock on a lock, a
``numpy_function`` that never returns) is named by the ranks that wait for it in a collective (the engine's
progress timeout, docs/reliability.md). Its record reaches this rank's control block too, where the engine's
heartbeat thread notices it. One thread per engine blocks on that (in C++, without the GIL) and, once named,
writes what the peer said and every thread's Python stack to stderr (``faulthandler``) -- where the hang is --,
its flight record (:mod:`rdkeras.flight`) and the launcher's report for this rank. It ends when the engine closes.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
from collections.abc import Callable
from typing import Any

from rdkeras import flight, reports


def start(backend: Any, then: Callable[[], None]) -> Callable[[], None]:
    """Watches `backend` (an engine's native one; others have nothing to watch) for this rank being named hung;
    returns the function that stops watching, after calling `then` (what else the engine stops at close)."""
    wait = getattr(backend, "wait_named_hung", None)
    if wait is None or backend.world_size < 2:
        return then
    thread = threading.Thread(target=_watch, args=(backend, wait), name="rdkeras-hang-watch", daemon=True)
    thread.start()

    def stop() -> None:
        then()
        backend.begin_close()  # ends the wait (the engine is closing anyway)
        thread.join(timeout=5.0)

    return stop


def _watch(backend: Any, wait: Callable[[], str]) -> None:
    rank, said = backend.rank, wait()
    if not said:
        return  # closed
    try:
        print(f"rdkeras: rank {rank} was named hung by a peer: {said}\nIts threads' Python stacks, most recent "
              "call first:", file=sys.stderr, flush=True)  # fmt: skip
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass  # no usable stderr: the peers' errors still name this rank
    flight.dump(backend, rank, (rank, rank, said))
    reports.write(rank, rank, said, hung=True)
