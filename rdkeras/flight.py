"""The flight recorder's dump: a failing rank's last collectives, for ``rdkeras postmortem`` to line up.

The engine keeps each rank's last 64 collectives (op, bytes, members, start, end; ``engine/progress.h``). Where
``RDKERAS_FLIGHT_DIR`` names a folder, a rank that fails -- or sees another fail, or is named hung -- writes
``flight-RANK.json`` there once: its record and the failure it knew of. :mod:`rdkeras.postmortem` reads them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rdkeras import options

_dumped: set[int] = set()  # ranks of this process that dumped already (the first dump stands)


def entries(backend: Any) -> list[dict[str, Any]]:
    """`backend`'s flight record as dicts, oldest first ([] for a backend without one: the baselines)."""
    record = getattr(backend, "flight_record", None) or []
    keys = ("number", "op", "bytes", "members", "start_ns", "end_ns", "failed")
    return [dict(zip(keys, entry, strict=True)) for entry in record]


def dump(backend: Any, rank: int, failure: tuple[int, int, str] | None, folder: Path | None = None) -> Path | None:
    """Writes `rank`'s record and `failure` (failed rank, reporter, why) to ``flight-RANK.json`` in `folder`
    (default ``RDKERAS_FLIGHT_DIR``), once per rank; returns the file, or None where nothing was written."""
    folder = options.from_env().flight_dir if folder is None else folder
    if folder is None or rank in _dumped:
        return None
    _dumped.add(rank)
    failed, reporter, why = failure if failure is not None else (None, None, None)
    data = {"rank": rank, "world_size": getattr(backend, "world_size", None), "time": time.time(),
            "failure": {"rank": failed, "reporter": reporter, "why": why}, "collectives": entries(backend)}  # fmt: skip
    path = Path(folder) / f"flight-{rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        return None  # the dump helps a postmortem; failing to write it must not hide the error itself
    return path
