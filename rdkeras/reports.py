"""Failure reports: each worker tells its launcher what ended it, so the launcher names the cause.

Exit order says little: a rank that raised may take seconds to exit while the ranks
that lost it exit at once. So a worker whose launcher gave it a folder
(``RDKERAS_REPORT_DIR``) writes ``failure-RANK.json`` there once it knows why it
stops: the rank it blames (itself for an error of its own), who saw it, what was
seen and when. :func:`cause` reads them back for the launcher.

An uncaught exception in a worker's script is an error of its own: before Python
prints the traceback, every open engine tells the other ranks that this rank
stopped (so they stop waiting for it at once, naming it) and the report is written.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from rdkeras import options

_written: set[int] = set()  # ranks of this process that reported already (the first report stands)
HUNG = " has not entered "  # in the error of a rank named hung (alive, stuck outside the engine: the engine says so)
HUNG_GRACE_S = 2.0  # how long a launcher leaves a rank named hung to write its stacks before it kills it


def write(rank: int, blamed: int, why: str, reporter: int | None = None, hung: bool = False) -> None:
    """Reports that this worker (`rank`) stops because `blamed` failed (itself: an error of its own), once; `hung`:
    this rank was named hung, and it will not end by itself (its stacks are in its log by now)."""
    folder = options.from_env().report_dir
    if folder is None or rank in _written:
        return
    _written.add(rank)
    report = {"rank": rank, "blamed": blamed, "reporter": rank if reporter is None else reporter,
              "why": why, "time": time.time(), **({"hung": True} if hung else {})}  # fmt: skip
    path = Path(folder) / f"failure-{rank}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(report))
        os.replace(tmp, path)  # the launcher reads a whole report or none
    except OSError:
        pass  # a report helps the launcher; failing to write one must not hide the error itself


def read(folder: str | Path, ranks: Iterable[int]) -> dict[int, dict]:
    """The reports the workers of `ranks` wrote into `folder` (rank -> report)."""
    out = {}
    for rank in ranks:
        try:
            out[rank] = json.loads((Path(folder) / f"failure-{rank}.json").read_text())
        except (OSError, ValueError):
            continue
    return out


def waiting_for_stacks(reports: dict[int, dict], running: set[int], now: float | None = None) -> bool:
    """Whether a rank in `running` was named hung by another's report less than HUNG_GRACE_S ago and has not
    reported itself yet: its own watcher is writing its Python stacks to its log (rdkeras.hang_watch)."""
    now = time.time() if now is None else now
    for r in reports.values():
        b = int(r["blamed"])
        if b != r["rank"] and b in running and b not in reports and HUNG in r["why"] and now - r["time"] < HUNG_GRACE_S:
            return True
    return False


def cause(reports: dict[int, dict]) -> dict | None:
    """The root cause the reports agree on: the earliest error a rank reported of its own, else the rank most
    reports blame (in the words of a rank that saw it first-hand, else the earliest report), else None. A rank
    named hung reports itself, but that is the others' finding, not an error of its own."""
    own = [r for r in reports.values() if r["blamed"] == r["rank"] and not r.get("hung")]
    if own:
        return min(own, key=lambda r: r["time"])
    if not reports:
        return None
    votes: dict[int, list[dict]] = {}
    for r in reports.values():
        votes.setdefault(int(r["blamed"]), []).append(r)
    blamed = max(votes, key=lambda b: (len(votes[b]), -min(r["time"] for r in votes[b])))
    # (a hung rank's own words say less than those of the rank that named it: which op it has not entered)
    return min(votes[blamed], key=lambda r: (bool(r.get("hung")), r["reporter"] != r["rank"], r["time"]))


def subject(why: str, blamed: int) -> str:
    """`why` with its subject: a peer's finding may say "it stalled: ..." of the rank it blames (the engine's
    failure record), which reads "rank 1 stalled: ..." wherever the rank is not named just before."""
    return f"rank {blamed} {why[3:]}" if why.startswith("it ") else why


def sentence(report: dict) -> str:
    """What a report says, naming whose error it is: "an error of its own: ..." or "rank 1 stalled: ...
    (seen by rank 2)"."""
    rank, blamed, reporter = int(report["rank"]), int(report["blamed"]), int(report["reporter"])
    if blamed == rank:
        return f"{'it was named hung' if report.get('hung') else 'an error of its own'}: {report['why']}"
    said = subject(report["why"], blamed)
    if not said.startswith(f"rank {blamed} "):
        said = f"rank {blamed} failed: {said}"
    seen = reporter not in (rank, blamed) and "(seen by rank" not in said
    return f"{said} (seen by rank {reporter})" if seen else said


_engines: list[Callable[[BaseException], None]] = []  # died_of(error) of every open engine
_previous_hook: Callable[..., Any] | None = None


def on_uncaught_exception(died_of: Callable[[BaseException], None]) -> Callable[[], None]:
    """Calls ``died_of(error)`` when this process dies of an uncaught exception (before the traceback is
    printed); returns the function that stops it (an engine closes)."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    _engines.append(died_of)

    def remove() -> None:
        if died_of in _engines:
            _engines.remove(died_of)

    return remove


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    for died_of in list(_engines):
        try:
            died_of(value)
        except Exception:
            pass
    assert _previous_hook is not None
    _previous_hook(kind, value, tb)
