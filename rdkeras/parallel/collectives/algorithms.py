"""The allreduce algorithms as objects, each saying when it is enabled, in a priority list (Horovod's
``AllreduceOp::Enabled``): a call runs the first enabled one for its members, its size and the transport's
capabilities. And the cost formulas that decide between them."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from rdkeras.parallel.options import ALGORITHMS
from rdkeras.transports.base import Capabilities

Groups = Sequence[Sequence[int]]  # the members, grouped by host

# Where a host runs more workers than it has cores, a message also waits for its receiver to be scheduled:
# ~150 us a message with 3 and 4 workers on 2 cores (python -m rdkeras.bench algorithms).
SCHEDULING_S = 150e-6


def host_groups(hosts: Sequence[str], members: Sequence[int]) -> list[list[int]]:
    """The members grouped by host (`hosts[rank]`): hosts in the order of their first member, ranks in order."""
    groups: dict[str, list[int]] = {}
    for rank in members:
        groups.setdefault(hosts[rank], []).append(rank)
    return list(groups.values())


def grid_side(n: int) -> int | None:
    """The side g of a 2D ring over `n` ranks (n/g groups of g): the largest divisor of n with 2 <= g <= sqrt(n),
    which makes 2(g-1) + 2(n/g-1) messages in sequence the fewest; None where there is none (n < 4, n prime)."""
    return next((g for g in range(math.isqrt(n), 1, -1) if n % g == 0), None) if n >= 4 else None


def grid_groups(groups: Groups) -> list[list[int]]:
    """`groups` (members by host) as the hierarchical allreduce runs over them: where every host has one worker,
    a 2D ring (:func:`grid_side`): consecutive members in groups of g, which then stand for hosts -- the ring of
    a group, then the rings of the members at one position in every group. Otherwise `groups` unchanged."""
    side = _grid_of(groups)
    if side is None:
        return [list(g) for g in groups]
    flat = [g[0] for g in groups]
    return [flat[i : i + side] for i in range(0, len(flat), side)]


def _grid_of(groups: Groups) -> int | None:
    """The side of the 2D ring over `groups` (members by host), where every host has one worker; else None."""
    return grid_side(len(groups)) if all(len(g) == 1 for g in groups) else None


def _shape(groups: Groups) -> str:
    sizes = sorted({len(g) for g in groups})
    hosts, each = len(groups), sizes[0]
    if len(sizes) == 1:
        return f"{hosts} host{'s' * (hosts > 1)} x {each} worker{'s' * (each > 1)}"
    return f"hosts of {' and '.join(map(str, sizes))} workers"


def doubling_messages(members: int) -> int:
    """Messages in sequence in a recursive-doubling allreduce of `members`: log2 of the largest power of two
    P <= members, and two more (in and back) for the members beyond P."""
    power = 1 << (members.bit_length() - 1)
    return power.bit_length() - 1 + (2 if power < members else 0)


def doubling_below(members: int, message_s: float, byte_s: float, add_byte_s: float) -> int:
    """The size (bytes) below which recursive doubling beats the ring, from the transport's per-message and
    per-byte costs and the per-byte cost of a sum: the ring sends 2(N-1) messages of G/N bytes each and adds
    (N-1)/N of G; recursive doubling sends L messages of G (L = :func:`doubling_messages`) and adds L·G."""
    n = members
    if n < 2:
        return 0
    steps = doubling_messages(n)
    saved = (2 * (n - 1) - steps) * message_s
    extra = (steps - 2 * (n - 1) / n) * byte_s + (steps - (n - 1) / n) * add_byte_s
    return int(saved / extra) if extra > 0 else 1 << 62


# The hierarchical allreduce's passes, at least: the engine sums pass k across hosts while the ring inside the
# host reduce-scatters pass k+1 and allgathers pass k-1, so the links between hosts wait only for the first
# pass's reduce-scatter and the last one's allgather. Each pass costs a hand-off between threads and its rings'
# messages: ~2.5 ms with 4 workers on 2 cores (bench hosts, unshaped link: 64 MB in 4 MiB passes took 0.127 s,
# in one 0.088 s), while a 1 Gbit/s link gains as much from 16 MiB passes as from 4 MiB ones.
HIERARCHY_PASS_BYTES = 16 << 20
MESSAGE_SHARE = 1 / 8  # of a message's byte cost, the most its per-message cost may add across hosts


def hierarchy_pass_bytes(members: int, message_s: float, byte_s: float) -> int:
    """The hierarchical allreduce's pass over `members` ranks in all, whose messages across hosts cost
    `message_s` + `byte_s` per byte: HIERARCHY_PASS_BYTES, or more (whole MiB) where each of the ring's
    messages across hosts -- 1/members of a pass -- would otherwise spend more than MESSAGE_SHARE of its
    bytes' time on its per-message cost (many hosts: short passes pay 2(H-1) message costs each)."""
    needed = members * message_s / (MESSAGE_SHARE * byte_s)
    return max(HIERARCHY_PASS_BYTES, math.ceil(needed / (1 << 20)) << 20)


class Algorithm:
    """An allreduce algorithm: when it is enabled, and why it was chosen."""

    name = ""

    def enabled(self, groups: Groups, nbytes: int, capabilities: Capabilities) -> bool:
        """Whether a call of `nbytes` over `groups` (members by host) runs this algorithm on a transport with
        these capabilities."""
        raise NotImplementedError

    def why(self, groups: Groups) -> str:
        raise NotImplementedError


class Ring(Algorithm):
    """One ring over every member: 2(N-1) messages of 1/N of the bytes each; bandwidth-optimal, always runs."""

    name = "ring"

    def __init__(self, reason: str | None = None):
        self.reason = reason  # why, where it is not the hosts' shape ("asked for")

    def enabled(self, groups: Groups, nbytes: int, capabilities: Capabilities) -> bool:
        return True

    def why(self, groups: Groups) -> str:
        if self.reason:
            return self.reason
        what = "one host" if len(groups) == 1 else "one worker per host" if {len(g) for g in groups} == {1} else None
        return f"{_shape(groups)}: {what or 'unequal hosts'}"


class Hierarchical(Algorithm):
    """Sum inside each host, shards across hosts, share inside each host (:class:`HierarchicalAllreduce`):
    enabled where several hosts run the same number (> 1) of members each -- only then does reducing inside a
    host first take bytes off the links between hosts -- or one each and a 2D grid of them (:func:`grid_groups`:
    the flat ring's bytes in 2(g-1) + 2(N/g-1) messages in sequence instead of 2(N-1)). Asked for, any hosts of
    equal worker counts."""

    name = "hierarchical"

    def __init__(self, asked: bool = False):
        self.asked = asked

    def enabled(self, groups: Groups, nbytes: int, capabilities: Capabilities) -> bool:
        if not capabilities.runs(self.name):
            return False
        sizes = {len(g) for g in groups}
        if _grid_of(groups) is not None or self.asked:
            return len(sizes) == 1
        return len(groups) > 1 and len(sizes) == 1 and sizes.pop() > 1

    def why(self, groups: Groups) -> str:
        side = _grid_of(groups)
        if side is not None:
            n = len(groups)
            steps = 2 * (side - 1) + 2 * (n // side - 1)
            return (
                f"{n} hosts x 1 worker: a 2D ring, {n // side} groups of {side} ({steps} messages in sequence where a "
                f"flat ring sends {2 * (n - 1)})"
            )
        if self.asked:
            return f"asked for ({_shape(groups)})"
        return f"{_shape(groups)}: sum inside each host, shards across hosts, share inside each host"


class Doubling(Algorithm):
    """Recursive doubling: log2(N) messages of every byte, where a ring sends 2(N-1) of 1/N each -- faster for
    small tensors. Enabled below `below` bytes (None: always, as asked for)."""

    name = "doubling"

    def __init__(self, below: int | None = None):
        self.below = below

    def enabled(self, groups: Groups, nbytes: int, capabilities: Capabilities) -> bool:
        return capabilities.runs(self.name) and (self.below is None or nbytes < self.below)

    def why(self, groups: Groups) -> str:
        return "asked for" if self.below is None else f"below {self.below:,} bytes"


def priorities(
    requested: str, groups: Groups, capabilities: Capabilities, compression: str | None = None
) -> list[Algorithm]:
    """The algorithms a call may run, first enabled first, for the `requested` one ("auto", "ring",
    "hierarchical", "doubling") over `groups` (members by host) on a transport with these `capabilities`. The one
    place what was asked for is checked against what the transport and the hosts can do: raises ValueError
    saying what to use instead."""
    if requested not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {requested!r}")
    if not capabilities.runs(requested if requested != "auto" else "ring") or (
        compression and not capabilities.runs("compression")
    ):
        asked = f"compression={compression!r}" if compression else f"algorithm={requested!r}"
        raise ValueError(
            f"{asked} runs in the engine; transport {capabilities.transport!r} is a baseline with a flat ring "
            "of its own: use algorithm='ring' (or 'auto') and no compression with it"
        )
    if requested == "ring":
        return [Ring("asked for")]
    if requested == "doubling":
        return [Doubling()]
    if requested == "hierarchical":
        if len({len(g) for g in groups}) > 1:
            raise ValueError(
                f"algorithm='hierarchical' needs the same number of workers on every host; these hosts have "
                f"{', '.join(str(len(g)) for g in groups)}: use algorithm='ring' (or 'auto')"
            )
        return [Hierarchical(asked=True)]
    if not capabilities.composes_rings:
        return [Ring(f"transport {capabilities.transport!r} has a flat ring of its own")]
    message_s, byte_s, add_byte_s = capabilities.costs
    if max(len(g) for g in groups) > (os.cpu_count() or 1):  # messages wait to be scheduled
        message_s += SCHEDULING_S
    members = sum(len(g) for g in groups)
    return [Doubling(doubling_below(members, message_s, byte_s, add_byte_s)), Hierarchical(), Ring()]


def choose(algorithms: Sequence[Algorithm], groups: Groups, nbytes: int, capabilities: Capabilities) -> Algorithm:
    """The first of `algorithms` enabled for a call of `nbytes` (the last one is always enabled)."""
    return next((a for a in algorithms if a.enabled(groups, nbytes, capabilities)), algorithms[-1])


def choose_algorithm(algorithm: str, groups: Groups) -> tuple[str, str]:
    """(the allreduce algorithm for large tensors, why) for members grouped by host, on an engine transport."""
    everything = Capabilities("any")
    chosen = choose(
        [a for a in priorities(algorithm, groups, everything) if not isinstance(a, Doubling) or a.below is None],
        groups,
        1 << 62,
        everything,
    )
    return chosen.name, chosen.why(groups)
