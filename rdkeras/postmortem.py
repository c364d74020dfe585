"""``rdkeras postmortem DIR``: lines up the ranks' flight-recorder dumps (:mod:`rdkeras.flight`) and says which
rank diverged first.

Every rank runs the same collectives in the same order, so its collective #n is the others' #n. Lined up by
number, the first place the ranks part ways names the rank that left the common path first:

- a collective every rank entered, called differently (another op, another size) by some: the fewest that
  agree diverged there;
- else, the rank whose last collective is the earliest (it never entered the next one, which others did): it
  stopped -- hung, or died -- there; ties go to the lower rank;
- else no rank diverged: every record agrees up to its end.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Divergence:
    rank: int  # the rank that diverged first
    number: int  # at its collective #number
    why: str


def load(folder: str | Path) -> dict[int, dict[str, Any]]:
    """The dumps in `folder` (``flight-RANK.json``), by rank; unreadable ones are left out."""
    out = {}
    for path in sorted(Path(folder).glob("flight-*.json")):
        try:
            data = json.loads(path.read_text())
            out[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _by_number(dump: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(c["number"]): c for c in dump.get("collectives", [])}


def diverged(dumps: dict[int, dict[str, Any]]) -> Divergence | None:
    """The rank that diverged first (the module's docstring says how), or None if every record agrees."""
    if len(dumps) < 2:
        return None
    records = {rank: _by_number(d) for rank, d in dumps.items()}
    common = set.intersection(*(set(r) for r in records.values()))
    for n in sorted(common):
        groups: dict[tuple[str, int], list[int]] = {}
        for rank in sorted(records):
            c = records[rank][n]
            groups.setdefault((c["op"], int(c["bytes"])), []).append(rank)
        if len(groups) > 1:
            majority = max(groups, key=lambda g: (len(groups[g]), -groups[g][0]))
            odd = min((g for g in groups if g != majority), key=lambda g: (len(groups[g]), groups[g][0]))
            rank = groups[odd][0]
            return Divergence(rank, n, f"rank {rank} called {odd[0]} #{n} with {odd[1]} bytes where ranks "
                              f"{groups[majority]} called {majority[0]} with {majority[1]} bytes")  # fmt: skip
    last = {rank: max(r) if r else 0 for rank, r in records.items()}
    if len(set(last.values())) < 2:
        return None
    rank = min(last, key=lambda r: (last[r], r))
    n = last[rank] + 1
    ahead = sorted(r for r in records if n in records[r])
    op = records[ahead[0]][n]["op"] if ahead else "collective"
    mine = records[rank].get(last[rank])
    if mine is None:
        done = "it ran no collective"
    elif not mine["end_ns"]:
        done = f"its last, #{last[rank]} ({mine['op']}), never finished"
    else:
        first_dump = min(float(d.get("time") or 0) for d in dumps.values())
        lag = max(0.0, first_dump - mine["end_ns"] * 1e-9)
        done = f"its last, #{last[rank]} ({mine['op']}), finished {lag:.1f} s before the first dump"
    return Divergence(rank, n, f"rank {rank} never entered {op} #{n}, which ranks {ahead} entered; {done}")


def _line(rank: int, dump: dict[str, Any]) -> str:
    collectives = dump.get("collectives", [])
    failure = dump.get("failure") or {}
    if not collectives:
        last = "no collectives"
    else:
        c = collectives[-1]
        state = "failed" if c.get("failed") else "under way" if not c["end_ns"] else "finished"
        last = f"last #{c['number']} {c['op']} ({c['bytes']} bytes, {state})"
    when = time.strftime("%H:%M:%S", time.localtime(dump.get("time", 0)))
    why = f"; its error: {failure['why']}" if failure.get("why") else ""
    return f"rank {rank}: dumped at {when}, {len(collectives)} collectives recorded, {last}{why}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rdkeras postmortem", description="Line up the ranks' flight-recorder dumps (RDKERAS_FLIGHT_DIR) "
        "and say which rank diverged first.")  # fmt: skip
    parser.add_argument("folder", help="the folder the ranks dumped flight-RANK.json into")
    args = parser.parse_args(argv)
    dumps = load(args.folder)
    if not dumps:
        print(f"no flight-RANK.json in {args.folder} (set RDKERAS_FLIGHT_DIR for the job)")
        return 2
    for rank in sorted(dumps):
        print(_line(rank, dumps[rank]))
    world = max((d.get("world_size") or 0) for d in dumps.values())
    missing = sorted(set(range(world)) - set(dumps))
    if missing:
        print(f"no dump from rank(s) {missing}")
    found = diverged(dumps)
    print(f"diverged first: {found.why}" if found else "no rank diverged: every record agrees up to its end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
