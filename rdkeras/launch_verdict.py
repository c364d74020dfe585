"""The launcher's verdict: the worker to blame, in the words of the reports, and one line per rank.

Each per-rank line says how the rank ended, when (after, or before, the blamed rank ended: never a negative
time), and what it reported, naming whose error that was (:func:`rdkeras.reports.sentence`).
"""

from __future__ import annotations

import math

from rdkeras import reports
from rdkeras._workers import RankResult, _failure_message, _status, failed_rank


def rank_line(r: RankResult, bad: RankResult) -> str:
    """How rank `r` ended, next to the blamed rank `bad`, and what it reported."""
    line = f"rank {r.rank}: {_status(r)}"
    gap = r.ended_at - bad.ended_at
    if r is not bad and not bad.killed and math.isfinite(gap):  # (killed: it ended when the launcher chose)
        line += f", {gap:.1f} s after rank {bad.rank}" if gap >= 0 else f", {-gap:.1f} s before rank {bad.rank} ended"
    if r.report and r is not bad:
        line += f"; it reported {reports.sentence(r.report)}"
    return line


def verdict(results: list[RankResult]) -> tuple[int, list[str]]:
    """The launcher's exit status and what it prints (without its "rdkeras.launch: " prefix)."""
    bad = failed_rank(results)
    if bad is None:
        return 0, []
    lines = [_failure_message(bad, results), *(rank_line(r, bad) for r in results)]
    return (bad.returncode if bad.returncode and bad.returncode > 0 else 1), lines
