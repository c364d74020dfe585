"""Collectives over the engine's ring allreduce: gradient averaging, state sharing, row gathering.

Everything here is collective: every member calls it in the same order with
equally shaped arguments (the ring checks nothing the caller can get wrong
silently only because all workers run the same program).
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import os
import queue
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdkeras import errors, transports
from rdkeras.channels import Ring
from rdkeras.engine import Engine
from rdkeras.parallel.options import ALGORITHMS, COMPRESSIONS

_FLOAT_KINDS = ("float32", "float64")


def _wire_dtype(dtype: np.dtype) -> np.dtype:
    """The ring's dtype for `dtype`: float32/float64 as they are, narrower floats as float32, and
    integers and booleans as float64 (exact below 2**53)."""
    dtype = np.dtype(dtype)
    if dtype.name in _FLOAT_KINDS:
        return dtype
    return np.dtype(np.float32) if dtype.kind == "f" or dtype.name == "bfloat16" else np.dtype(np.float64)


_WIRE = {"fp16": "float16", "bf16": "bfloat16"}
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


def grid_groups(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """`groups` (members by host) as the hierarchical allreduce runs over them: where every host has one worker,
    a 2D ring (:func:`grid_side`): consecutive members in groups of g, which then stand for hosts -- the ring of
    a group, then the rings of the members at one position in every group. Otherwise `groups` unchanged."""
    side = _grid_of(groups)
    if side is None:
        return [list(g) for g in groups]
    flat = [g[0] for g in groups]
    return [flat[i : i + side] for i in range(0, len(flat), side)]


def _grid_of(groups: Sequence[Sequence[int]]) -> int | None:
    """The side of the 2D ring over `groups` (members by host), where every host has one worker; else None."""
    return grid_side(len(groups)) if all(len(g) == 1 for g in groups) else None


def choose_algorithm(algorithm: str, groups: Sequence[Sequence[int]]) -> tuple[str, str]:
    """(the allreduce algorithm for large tensors, why) for members grouped by host. "auto": hierarchical where
    there are several hosts with the same number (> 1) of members each -- only then does reducing inside each
    host first take bytes off the links between hosts -- or one each and a 2D grid of them (:func:`grid_groups`:
    the same bytes as the flat ring's, 2(g-1) + 2(N/g-1) messages in sequence instead of 2(N-1)), else the ring.
    (Small tensors: :func:`doubling_below`.)"""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    side = _grid_of(groups)
    if algorithm in ("auto", "hierarchical") and side is not None:
        n = len(groups)
        steps = 2 * (side - 1) + 2 * (n // side - 1)
        return "hierarchical", (
            f"{n} hosts x 1 worker: a 2D ring, {n // side} groups of {side} ({steps} messages in sequence where a "
            f"flat ring sends {2 * (n - 1)})"
        )
    sizes = sorted({len(g) for g in groups})
    hosts, each = len(groups), sizes[0]
    shape = (
        f"{hosts} host{'s' * (hosts > 1)} x {each} worker{'s' * (each > 1)}"
        if len(sizes) == 1
        else f"hosts of {' and '.join(map(str, sizes))} workers"
    )
    if algorithm in ("ring", "doubling"):
        return algorithm, "asked for"
    if algorithm == "hierarchical":
        if len(sizes) > 1:
            raise ValueError(
                f"algorithm='hierarchical' needs the same number of workers on every host; these hosts have "
                f"{', '.join(str(len(g)) for g in groups)}: use algorithm='ring' (or 'auto')"
            )
        return "hierarchical", f"asked for ({shape})"
    if len(groups) > 1 and len(sizes) == 1 and sizes[0] > 1:
        return "hierarchical", f"{shape}: sum inside each host, shards across hosts, share inside each host"
    why = "one host" if len(groups) == 1 else "one worker per host" if sizes == [1] else "unequal hosts"
    return "ring", f"{shape}: {why}"


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


class Collectives:
    """Allreduce helpers over the engine, created lazily and identically on every member.

    Args:
        engine: The job's engine.
        bucket_bytes: Bytes the ring moves per pass.
        members: The ranks taking part, in ring order (default: all).
        name: A prefix keeping this instance's rings apart from another's.
        algorithm: "ring" (one ring over the members), "hierarchical" (see :class:`HierarchicalAllreduce`),
            "doubling" (recursive doubling, for small tensors: ``Engine.doubling``) or "auto": by where the members
            run (:func:`choose_algorithm`) and, on an engine transport, recursive doubling below
            :func:`doubling_below` bytes.
        hosts: Each rank's host identity, by rank (default: the engine's; the first allreduce asks for it, so
            give it when only some ranks are members).
        compression: None, "fp16" or "bf16": float32 gradients (``allreduce(..., compress=True)``) cross host
            boundaries as that 16-bit type, summed in float32 at every hop (Horovod's ``Compression.fp16``).
        compress_within_hosts: Compress inside a host too (one host's ring, the hierarchical allreduce's inside).
    """

    def __init__(
        self,
        engine: Engine,
        bucket_bytes: int,
        members: list[int] | None = None,
        name: str = "",
        algorithm: str = "ring",
        hosts: Sequence[str] | None = None,
        compression: str | None = None,
        compress_within_hosts: bool = False,
    ):
        self.engine, self.bucket_bytes, self.name = engine, bucket_bytes, name
        self.members = list(range(engine.world_size)) if members is None else list(members)
        self._rings: dict[tuple[str, str], tuple[Ring, int]] = {}
        self._serial = itertools.count()
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
        self.requested, self._hosts = algorithm, None if hosts is None else list(hosts)
        self.compression, self.compress_within_hosts = compression, compress_within_hosts
        self._chosen: tuple[str, str] | None = None
        self._hierarchy: HierarchicalAllreduce | None = None
        self._multi_host = False
        self.doubling_below = 0  # bytes below which "auto" sends a call by recursive doubling

    def rebind(self, engine: Engine) -> None:
        """Runs over `engine` from now on, all of its ranks members (an elastic job's next group): nothing of the
        old engine's is kept, and the algorithm is chosen again for the new group at the next call."""
        self.engine, self.members = engine, list(range(engine.world_size))
        self._rings.clear()
        self._serial = itertools.count()  # ring names start afresh, alike on every member (a replacement too)
        self._hosts, self._chosen, self._hierarchy = None, None, None
        self._multi_host, self.doubling_below = False, 0

    @property
    def algorithm(self) -> tuple[str, str]:
        """(the allreduce algorithm in use for large tensors, why); collective the first time where it depends
        on the hosts."""
        if self._chosen is None:
            spec = transports.get(self.engine.transport)
            if not spec.hierarchical and (self.requested in ("hierarchical", "doubling") or self.compression):
                asked = f"compression={self.compression!r}" if self.compression else f"algorithm={self.requested!r}"
                raise ValueError(
                    f"{asked} runs in the engine; transport {self.engine.transport!r} is a baseline with a flat ring "
                    "of its own: use algorithm='ring' (or 'auto') and no compression with it"
                )
            if (self.requested == "ring" and not self.compression) or self.size == 1:
                self._chosen = ("ring", "asked for" if self.requested == "ring" else "one member")
            elif not spec.hierarchical:
                self._chosen = ("ring", f"transport {self.engine.transport!r} has a flat ring of its own")
            else:
                hosts = self._hosts if self._hosts is not None else self.engine.hosts()
                groups = host_groups(hosts, self.members)
                self._multi_host = len(groups) > 1
                self._chosen = choose_algorithm(self.requested, groups)
                if self._chosen[0] == "hierarchical":
                    grid = grid_groups(groups)
                    self._hierarchy = HierarchicalAllreduce(self, grid, grid=grid != groups)
                if self.requested == "auto":
                    message_s, byte_s, add_byte_s = spec.costs
                    if max(len(g) for g in groups) > (os.cpu_count() or 1):  # messages wait to be scheduled
                        message_s += SCHEDULING_S
                    self.doubling_below = doubling_below(self.size, message_s, byte_s, add_byte_s)
        return self._chosen

    def algorithm_for(self, nbytes: int) -> str:
        """The algorithm a call of `nbytes` (padded) runs (collective the first time, as :attr:`algorithm`)."""
        name = self.algorithm[0] if self.size > 1 else "ring"
        return "doubling" if name != "doubling" and nbytes < self.doubling_below else name

    def describe(self) -> str:
        """The algorithm(s) in use and why, and what compression does, in a sentence (collective, as
        :attr:`algorithm`)."""
        name, why = self.algorithm
        text = f"{name} ({why})"
        if self.doubling_below:
            text += f"; recursive doubling below {self.doubling_below:,} bytes"
        if self.compression and (self._multi_host or self.compress_within_hosts):
            where = "everywhere" if self.compress_within_hosts else "between hosts"
            text += f"; float32 gradients travel as {_WIRE[self.compression]} {where}"
        elif self.compression:
            text += f"; compression {self.compression!r} unused: every worker on one host"
        return text

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def position(self) -> int:
        return self.members.index(self.engine.rank)

    def _ring(self, purpose: str, dtype: str, nbytes: int, kind: str = "ring") -> Ring:
        ring: Ring | None
        ring, capacity = self._rings.get((f"{kind}:{purpose}", dtype), (None, 0))
        needed = nbytes + 64 * 1024  # 64-byte padding per tensor, generously
        if ring is None or needed > capacity:
            capacity = max(needed, 2 * capacity, 1 << 20 if kind == "ring" else 0)
            label = f"{self.name}{purpose}/{dtype}/{next(self._serial)}"
            if kind == "doubling":
                ring = self.engine.doubling(label, capacity, self.members)
            else:
                ring = self.engine.ring(label, capacity, self.bucket_bytes, self.members)
            self._rings[(f"{kind}:{purpose}", dtype)] = (ring, capacity)
        return ring

    def allreduce(
        self, arrays: Sequence[np.ndarray], average: bool, purpose: str = "grads", compress: bool = False
    ) -> list[np.ndarray]:
        """Sums (averages) same-shaped lists of float arrays across members; one call per dtype.

        The results are views of registered memory, valid until the next-but-one call for this purpose (with
        compression: fresh arrays). `compress`: float32 arrays may travel as the `compression` type (gradients;
        never weights, whose broadcasts must be exact).
        """
        out: list[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
        for idx, reduce in self._calls(arrays, purpose, compress):
            for i, r in zip(idx, reduce([np.ascontiguousarray(arrays[i]) for i in idx], average), strict=True):
                out[i] = r
        return out

    def prepare(self, arrays: Sequence[np.ndarray], purpose: str = "grads", compress: bool = False) -> None:
        """Sets up what :meth:`allreduce` of these arrays for `purpose` runs on (collective, in the same order on
        every member: the rings' setup exchanges descriptors), so that calls for different purposes may then run
        at the same time on different threads."""
        self._calls(arrays, purpose, compress)

    def _calls(
        self, arrays: Sequence[np.ndarray], purpose: str, compress: bool
    ) -> list[tuple[list[int], Callable[[list[np.ndarray], bool], list[np.ndarray]]]]:
        """Per dtype (in name order): the arrays' indices and the call that reduces them, its rings set up."""
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(np.dtype(a.dtype).name, []).append(i)
        calls = []
        for dtype, idx in sorted(groups.items()):
            if dtype not in _FLOAT_KINDS:
                raise TypeError(f"cannot allreduce {dtype} tensors (float32/float64 only)")
            nbytes = sum(arrays[i].nbytes + 64 for i in idx)
            wire = _WIRE.get(self.compression or "") if compress and dtype == "float32" else None
            algorithm = self.algorithm_for(nbytes)
            if algorithm == "hierarchical":
                assert self._hierarchy is not None  # (set with the choice)
                within = self.compress_within_hosts or self._hierarchy.grid  # a grid's groups span hosts
                calls.append((idx, self._hierarchy.call(purpose, dtype, nbytes, wire, within)))
                continue
            if not (self._multi_host or self.compress_within_hosts):
                wire = None
            calls.append((idx, functools.partial(self._ring(purpose, dtype, nbytes, algorithm), wire=wire)))
        return calls

    def from_owners(self, arrays: Sequence[np.ndarray], owners: Sequence[int]) -> list[np.ndarray]:
        """Every member gets each array from its owner (a rank): an exact sum in which only the owner
        contributes (the others add zeros). Any dtype; returns fresh arrays."""
        me = self.engine.rank
        if self.size == 1 or not arrays:
            return [np.array(a, copy=True) for a in arrays]
        wire = [
            (np.asarray(a).astype(_wire_dtype(a.dtype)) if o == me else np.zeros(np.shape(a), _wire_dtype(a.dtype)))
            for a, o in zip(arrays, owners, strict=True)
        ]
        summed = self.allreduce(wire, average=False, purpose="sync")
        return [s.reshape(np.shape(a)).astype(np.asarray(a).dtype) for s, a in zip(summed, arrays, strict=True)]

    def broadcast(self, arrays: Sequence[np.ndarray], root: int = 0) -> list[np.ndarray]:
        """Every member gets `root`'s arrays."""
        return self.from_owners(arrays, [root] * len(arrays))

    def mean(self, values: Sequence[float]) -> list[float]:
        """The average of each value over the members."""
        if self.size == 1 or not values:
            return list(values)
        (out,) = self.allreduce([np.asarray(values, np.float64)], average=True, purpose="sync")
        return [float(v) for v in out]

    def gather_rows(self, array: np.ndarray) -> np.ndarray:
        """The members' arrays concatenated along the first axis, in member order (rows may differ)."""
        return self.gather_rows_many([array])[0]

    def gather_rows_many(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """:meth:`gather_rows` of arrays with the same rows on each member (an IndexedSlices' values and indices):
        one exchange of the counts, one of the rows."""
        if self.size == 1:
            return list(arrays)
        n, at = self.size, self.position
        counts = np.zeros(n, np.float64)
        counts[at] = len(arrays[0])
        (counts,) = self.allreduce([counts], average=False, purpose="rows")
        sizes = counts.astype(np.int64)
        start = int(sizes[:at].sum())
        wire = []
        for array in arrays:
            full = np.zeros((int(sizes.sum()), *array.shape[1:]), _wire_dtype(array.dtype))
            full[start : start + len(array)] = array
            wire.append(full)
        summed = self.allreduce(wire, average=False, purpose="rows")
        return [s.astype(a.dtype) for s, a in zip(summed, arrays, strict=True)]


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


class HierarchicalAllreduce:
    """A sum over hosts of L members each, in the engine (``hierarchicalAllreduce``, csrc/engine/collectives.cc):
    a ring inside each host reduce-scatters every pass (shared memory), the members holding the same chunk on
    every host (one per position) sum it across hosts -- every host's L links busy at once, each host sending
    2(H-1)/H of the bytes in all where a flat ring sends 2(N-1)/N per rank -- and the ring inside the host
    allgathers the sums. Every member ends with the same bits. With `grid`, the groups are a 2D ring's
    (:func:`grid_groups`), each of several hosts: the rings of a group cross hosts too."""

    def __init__(self, collectives: Collectives, groups: list[list[int]], grid: bool = False):
        me = collectives.engine.rank
        self.grid = grid
        host = next(h for h, g in enumerate(groups) if me in g)
        self.position, self.locals_ = groups[host].index(me), len(groups[host])
        base, size = collectives.name, collectives.bucket_bytes
        message_s, byte_s, _ = transports.get(collectives.engine.transport).costs
        passes = min(size, hierarchy_pass_bytes(collectives.size, message_s, byte_s))
        self.inside = Collectives(collectives.engine, passes, groups[host], name=f"{base}host{host}/")
        self.across = Collectives(
            collectives.engine, size, [g[self.position] for g in groups], name=f"{base}shard{self.position}/"
        )
        self.world = collectives.size

    def call(
        self, purpose: str, dtype: str, nbytes: int, wire: str | None = None, within: bool = False
    ) -> Callable[[list[np.ndarray], bool], list[np.ndarray]]:
        """The sum (mean: `average`) of same-dtype arrays of `nbytes` in all (padded), its rings set up; views of
        registered memory, valid until the next-but-one call for this purpose (fresh arrays where compressed).
        `wire`: the 16-bit type float32 crosses hosts as; `within`: inside each host too."""
        inside = self.inside._ring(purpose, dtype, nbytes)
        # The chunk a member holds after a pass's reduce-scatter: at most a 1/L share of a pass, 64-byte rounded.
        chunk = -(-min(nbytes, inside.end.capacity, self.inside.bucket_bytes) // self.locals_) + 64
        across = self.across._ring(purpose, dtype, chunk)
        compressed = within and wire is not None
        return lambda arrays, average: inside.hierarchical(arrays, average, across, self.world, wire, compressed)


def share_variables(collectives: Collectives, variables: Sequence[Any], owners: Sequence[int]) -> None:
    """Assigns each Keras variable its owner's value on every member (collective)."""
    if collectives.size == 1 or not variables:
        return
    values = collectives.from_owners([np.asarray(v.numpy()) for v in variables], owners)
    for v, value in zip(variables, values, strict=True):
        v.assign(value)


def share_new_variables(collectives: Collectives, variables: Sequence[Any], where: str) -> None:
    """Gives every member rank 0's values of variables each member created alike (collective); raises on
    every member if they created different ones (count, shapes or dtypes)."""
    if collectives.size == 1:
        return
    described = ";".join(f"{tuple(v.shape)}:{v.dtype.name}" for v in variables)
    mine = np.array([len(variables), zlib.crc32(described.encode())], np.float64)
    (reference,) = collectives.broadcast([mine], root=0)
    (differ,) = collectives.allreduce([np.array([float((mine != reference).any())])], average=False, purpose="sync")
    if differ[0]:
        raise ValueError(
            f"the workers created different variables {where} ({len(variables)} here; {int(differ[0])} worker(s) "
            "differ from rank 0): create the same models, optimizers and metrics on every worker"
        )
    share_variables(collectives, variables, [0] * len(variables))


BUCKET_BYTES = 4 << 20  # the bucket size where overlap is on


def overlap_bytes(transport: str, hierarchical: bool = False) -> int:
    """The default gradient bucket size for overlapping the exchange with backprop on `transport`, with no GPU
    doing the compute: 0 (off) where the bytes are moved by this process's own cores while they also compute (a
    transport whose spec sets ``copies_on_own_cores``: the exchange would only take turns with backprop on the
    same core -- measured 20% slower) or where the gradients go by the `hierarchical` allreduce (each bucket's
    call fills and drains its own pipeline of passes, and the sums inside each host are these cores' work: on
    2 emulated hosts x 2 at 1 Gbit/s, 3 rounds, a step took 0.727 s in 4 MiB buckets against 0.696 s in one
    exchange after backprop, bf16 0.427 s against 0.401 s), else ``BUCKET_BYTES``. With a GPU, ``BUCKET_BYTES``.
    ``RDMAStrategy(overlap_bytes=...)`` overrides it."""
    if transports.get(transport).copies_on_own_cores or hierarchical:
        tf = sys.modules.get("tensorflow")  # not imported: no TensorFlow compute (the engine-only tests)
        if tf is None or not tf.config.list_physical_devices("GPU"):
            return 0
    return BUCKET_BYTES


# Gradient buckets exchanged at once: each on rings of its own, so one bucket's sums inside a host (or its wait
# for a late worker) leave the wire to the other's passes.
EXCHANGE_LANES = 2


def reverse_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices grouped into buckets of at least `bucket_bytes` (the last one may be smaller), the last
    index first: backprop produces the last layers' gradients first."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        filled += sizes[i]
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketPipeline:
    """Runs work on buckets in communication threads, in the order they are started, while the caller
    (TensorFlow's executor, still computing the backward pass) goes on; :meth:`wait` collects them.

    ``start(exchange, b, arrays)`` queues bucket `b` of one traced exchange and returns at once;
    ``wait(exchange)`` blocks until every bucket of it is done and returns their results, or raises what
    the work raised. Buckets are taken in start order -- which TensorFlow's automatic control dependencies
    make program order, the same on every worker, so every worker's collectives match: `prepare` (what must
    happen in that order on every worker, such as setting up a bucket's rings) runs for each in turn, then
    `work` runs on lane ``b % lanes``. With one lane the buckets' work runs one at a time; with more, a bucket's
    exchange runs beside the previous one's, on collectives of its own, so one bucket's phases that do not use
    the wire (the sums inside a host) overlap another's that do. The work releases the GIL (the engine's
    collectives do), so backprop runs meanwhile.
    """

    def __init__(
        self,
        work: Callable[[int, int, list[np.ndarray]], Any],
        name: str,
        timeout: float,
        prepare: Callable[[int, int, list[np.ndarray]], Any] | None = None,
        lanes: int = 1,
    ):
        self._work, self._prepare, self._name, self._timeout = work, prepare, name, timeout
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lanes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(lanes if lanes > 1 else 0)]
        self._done = threading.Condition()
        self._results: dict[int, dict[int, Any]] = {}  # exchange -> bucket -> result
        self._expected: dict[int, int] = {}  # exchange -> the bucket that must come next
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._generation = 0  # bumped by reset(): buckets started before it are dropped
        self._closed = False
        # Per exchange call: [first start, end of the work done before the wait began, wait entered, wait left,
        # seconds of work (summed over lanes)] (perf_counter) -- how much communication backprop hid (benchmarks
        # read it).
        self.timeline: collections.deque[list[float]] = collections.deque(maxlen=256)
        self._current: dict[int, list[float]] = {}
        _PIPELINES.add(self)

    def start_ops(self, exchange: int, buckets: list[list[int]], tensors: list[Any], name: str) -> list[Any]:
        """One stateful op per bucket, its only inputs that bucket's `tensors`, that starts the bucket and
        returns a ticket: TensorFlow runs each as soon as its gradients exist, in bucket order."""
        import tensorflow as tf

        tickets = []
        for b, members in enumerate(buckets):

            def start(*arrays: np.ndarray, b: int = b) -> np.int64:
                self.start(exchange, b, list(arrays))
                return np.int64(b)

            inputs = [tensors[i] for i in members]
            tickets.append(tf.numpy_function(start, inputs, Tout=tf.int64, stateful=True, name=f"{name}{b}"))
        return tickets

    def start(self, exchange: int, bucket: int, arrays: list[np.ndarray]) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name}: the exchange is closed (its RDMAStrategy was closed)")
        if bucket == 0:
            self._current[exchange] = [time.perf_counter(), 0.0, 0.0, 0.0, 0.0]
        if not self._threads:
            loops = [(self._loop, self._jobs)] + [(self._lane, q) for q in self._lanes]
            for i, (loop, jobs) in enumerate(loops):
                name = f"rdkeras-{self._name}" + (f"-lane{i - 1}" if i else "")
                self._threads.append(threading.Thread(target=loop, args=(jobs,), name=name, daemon=True))
            for t in self._threads:
                t.start()
        # The arrays are views of TensorFlow's gradient buffers; the wait op takes the same tensors as
        # inputs, so TensorFlow keeps them alive (and unchanged) until the bucket is done.
        self._jobs.put((self._generation, exchange, bucket, arrays))

    def reset(self) -> None:
        """Forgets every bucket started so far and any error (an elastic job's group re-formed: the exchange in
        flight is repeated from the start). Work still running on the old group fails, and is dropped."""
        with self._done:
            self._generation += 1
            self._results.clear()
            self._expected.clear()
            self._current.clear()
            self._error = None

    def close(self, timeout: float = 5.0) -> None:
        """Stops the threads once the work in hand is done (waiting at most `timeout` seconds for them: one still
        inside a collective ends when its engine closes); later starts fail."""
        self._closed = True
        self.reset()  # what is queued is dropped
        for jobs in [self._jobs, *self._lanes]:
            jobs.put(None)
        ends = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, ends - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            generation, exchange, bucket, arrays = job
            with self._done:  # checked and counted with the generation, so a reset in between drops the bucket
                if generation != self._generation or self._error is not None:
                    continue  # started before a reset, or after a failure of its group
                expected = self._expected.get(exchange, 0)
                self._expected[exchange] = bucket + 1
            try:
                if bucket != expected:
                    raise RuntimeError(
                        f"{self._name}: bucket {bucket} started before bucket {expected}; the workers' exchanges "
                        "would not match (were TensorFlow's automatic control dependencies disabled?)"
                    )
                if self._prepare is not None:
                    self._prepare(exchange, bucket, arrays)
            except BaseException as e:  # reported by wait(), in the training step
                self._fail(generation, e)
                continue
            if self._lanes:
                self._lanes[bucket % len(self._lanes)].put(job)
            else:
                self._run(job)

    def _lane(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            self._run(job)

    def _live(self, generation: int) -> bool:
        with self._done:
            return generation == self._generation and self._error is None

    def _fail(self, generation: int, error: BaseException) -> None:
        with self._done:
            if generation == self._generation:  # else the old group's work, dropped by a reset
                self._error = error
                self._done.notify_all()

    def _run(self, job: tuple[int, int, int, list[np.ndarray]]) -> None:
        generation, exchange, bucket, arrays = job
        if not self._live(generation):
            return
        try:
            began = time.perf_counter()
            result = self._work(exchange, bucket, arrays)
            ended = time.perf_counter()
        except BaseException as e:
            self._fail(generation, e)
            return
        with self._done:
            if generation != self._generation:
                return
            marks = self._current.get(exchange)
            if marks is not None:
                marks[4] += ended - began
                if not marks[2]:  # the wait has not begun yet: this bucket was hidden behind backprop
                    marks[1] = ended
            self._results.setdefault(exchange, {})[bucket] = result
            self._done.notify_all()

    def wait(self, exchange: int, count: int) -> list[Any]:
        """Every bucket's result, in bucket order; fails after `timeout` seconds without progress."""
        return [self.wait_bucket(exchange, b, count) for b in range(count)]

    def wait_bucket(self, exchange: int, bucket: int, count: int) -> Any:
        """Bucket `bucket`'s result (of `count`), once it is done; the buckets must be waited for in order. Fails
        after `timeout` seconds without progress."""
        marks = self._current.get(exchange)
        if marks is not None and bucket == 0:
            marks[2] = time.perf_counter()
        with self._done:
            done, since = -1, time.monotonic()
            while bucket not in self._results.get(exchange, {}):
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise RuntimeError(f"{self._name}: the exchange is closed (its RDMAStrategy was closed)")
                if len(self._results.get(exchange, {})) != done:
                    done, since = len(self._results.get(exchange, {})), time.monotonic()
                left = since + self._timeout - time.monotonic()
                if left <= 0:
                    raise errors.TimeoutError(
                        f"{self._name}: bucket {bucket} of {count} not done after {self._timeout:g} s "
                        f"({bucket + done} done)"
                    )
                self._done.wait(min(left, 1.0))
            result = self._results[exchange].pop(bucket)
            if bucket < count - 1:
                return result
            del self._results[exchange]
            self._expected[exchange] = 0
        if marks is not None:
            marks[3] = time.perf_counter()
            self.timeline.append(marks)
        return result


_PIPELINES: weakref.WeakSet[BucketPipeline] = weakref.WeakSet()


def pipelines() -> list[BucketPipeline]:
    """Every live BucketPipeline (benchmarks read their timelines)."""
    return list(_PIPELINES)


def timed_exchange(fn: Callable[..., Any], engine_of: Callable[[], Engine]) -> Callable[..., Any]:
    """`fn` (the body of an exchange op a training step runs: an allreduce, a bucket's wait, a push, a pull),
    adding its seconds, work and waits, to the engine of the moment's ``traffic()["exchange_seconds"]``: what a
    step spends beyond them and its compute is the hops into and out of TensorFlow, the assignments and Keras.
    `engine_of` is asked at each call, never kept: a traced step outlives an elastic group's engine, which must
    be freed once the group re-forms."""

    def timed(*args: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            engine_of().count_exchange(time.perf_counter() - began)

    return timed


class GradientAllreduce:
    """Averages (or sums) a list of tensors across members inside a compiled function.

    ``None`` entries pass through; tensors of other dtypes travel as float32 and come back in their own dtype.
    IndexedSlices (an Embedding's gradient) travel as their rows and indices, gathered from every member in rank
    order -- the IndexedSlices one process computes for the global batch, duplicates and all, which the optimizer
    then applies as it would there -- unless `sparse_as_dense` (Horovod's switch) makes them dense first.

    With `overlap_bytes` > 0 (inside a compiled function) the gradients go in buckets of that many
    bytes, last layer first: each bucket's allreduce starts as soon as backprop has produced its
    gradients (a start op hands it to a communication thread) and a wait op per bucket, in bucket order,
    collects it, so the update of one bucket's variables need not wait for the later buckets. Each element
    is still reduced by exactly one ring (bucket boundaries fall between tensors), so workers stay
    bit-identical. (Sparse gradients go in one exchange after backprop, with the dense ones.)
    """

    def __init__(
        self, collectives: Collectives, average: bool = True, overlap_bytes: int = 0, sparse_as_dense: bool = False
    ):
        self.collectives, self.average, self.overlap_bytes = collectives, average, overlap_bytes
        self.sparse_as_dense = sparse_as_dense
        self._exchanges = itertools.count()
        self._pipeline: BucketPipeline | None = None

    def __call__(self, grads: Sequence[Any]) -> list[Any]:
        import tensorflow as tf

        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx or self.collectives.size == 1:
            return list(grads)
        sparse = [] if self.sparse_as_dense else [i for i in idx if isinstance(grads[i], tf.IndexedSlices)]
        idx = [i for i in idx if i not in sparse]
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]
        wire = [g if g.dtype.name in _FLOAT_KINDS else tf.cast(g, tf.float32) for g in dense]
        out = list(grads)
        if sparse:
            reduced, gathered = self._with_sparse(wire, [grads[i] for i in sparse])
            for i, g in zip(sparse, gathered, strict=True):
                out[i] = g
        elif self.overlap_bytes > 0 and not tf.executing_eagerly() and all(g.shape.is_fully_defined() for g in wire):
            reduced = self._overlapped(wire)
        else:
            reduced = self._in_one(wire)
        for i, g, r in zip(idx, dense, reduced, strict=True):
            r.set_shape(g.shape)
            out[i] = r if r.dtype == g.dtype else tf.cast(r, g.dtype)
        return out

    def _in_one(self, wire: list[Any]) -> list[Any]:
        import tensorflow as tf

        reduced = tf.numpy_function(
            timed_exchange(self._reduce, lambda: self.collectives.engine),
            wire,
            Tout=[g.dtype for g in wire],
            stateful=True,
            name="rdkeras_allreduce",
        )
        return [reduced] if not isinstance(reduced, (list, tuple)) else list(reduced)  # (eagerly, one comes bare)

    def _with_sparse(self, wire: list[Any], slices: list[Any]) -> tuple[list[Any], list[Any]]:
        """The dense gradients reduced and the sparse ones gathered, in one exchange (one op: the members' rings
        are used in the same order everywhere)."""
        import tensorflow as tf

        parts = [t for s in slices for t in (s.values, tf.cast(s.indices, tf.int64))]

        def exchange(*arrays: np.ndarray) -> list[np.ndarray]:
            reduced = self._reduce(*arrays[: len(wire)]) if wire else []
            rest = arrays[len(wire) :]
            for values, indices in zip(rest[::2], rest[1::2], strict=True):
                values, indices = self.collectives.gather_rows_many([values, indices])
                reduced += [values / values.dtype.type(self.collectives.size) if self.average else values, indices]
            return reduced

        outs = tf.numpy_function(
            timed_exchange(exchange, lambda: self.collectives.engine),
            [*wire, *parts],
            Tout=[t.dtype for t in [*wire, *parts]],
            stateful=True,
            name="rdkeras_allreduce_sparse",
        )
        outs = list(outs)
        gathered = []
        for k, s in enumerate(slices):
            values, indices = outs[len(wire) + 2 * k], outs[len(wire) + 2 * k + 1]
            values.set_shape([None, *s.values.shape[1:]])
            indices.set_shape([None])
            gathered.append(tf.IndexedSlices(values, tf.cast(indices, s.indices.dtype), s.dense_shape))
        return outs[: len(wire)], gathered

    def reset(self) -> None:
        """Drops the buckets in flight (an elastic job's group re-formed)."""
        if self._pipeline is not None:
            self._pipeline.reset()

    def stop(self) -> None:
        """Stops the bucket pipeline's threads (the strategy is closing)."""
        if self._pipeline is not None:
            self._pipeline.close()

    def _reduce(self, *arrays: np.ndarray) -> list[np.ndarray]:
        # The inputs are views of TensorFlow's buffers; the outputs are 64-byte
        # aligned views of registered memory, which TensorFlow aliases.
        reduced = self.collectives.allreduce(list(arrays), average=self.average, compress=True)
        return [r.reshape(a.shape) for r, a in zip(reduced, arrays, strict=True)]  # views (0-d stays 0-d)

    def _overlapped(self, wire: list[Any]) -> list[Any]:
        import tensorflow as tf

        if self._pipeline is None:
            self._pipeline = BucketPipeline(
                self._reduce_bucket,
                "allreduce-buckets",
                self.collectives.engine.timeout,
                prepare=lambda _exchange, bucket, arrays: self.collectives.prepare(arrays, f"grads{bucket}", True),
                lanes=EXCHANGE_LANES,
            )
        pipeline, exchange = self._pipeline, next(self._exchanges)  # one exchange per trace
        buckets = reverse_buckets([g.shape.num_elements() * g.dtype.size for g in wire], self.overlap_bytes)
        tickets = pipeline.start_ops(exchange, buckets, wire, "rdkeras_allreduce_start")
        # One wait op per bucket, in bucket order: what follows a bucket (the copy back to a GPU, the optimizer's
        # update of its variables) may run while later buckets are still on the wire.
        out: list[Any] = [None] * len(wire)
        for b, members in enumerate(buckets):

            def wait(*_inputs: np.ndarray, b: int = b) -> list[np.ndarray]:
                return list(pipeline.wait_bucket(exchange, b, len(buckets)))

            # The bucket's gradients are inputs too: TensorFlow keeps them alive until the bucket is done.
            reduced = tf.numpy_function(
                timed_exchange(wait, lambda: self.collectives.engine),
                [tickets[b]] + [wire[i] for i in members],
                Tout=[wire[i].dtype for i in members],
                stateful=True,
                name=f"rdkeras_allreduce_wait{b}",
            )
            for i, r in zip(members, reduced, strict=True):
                out[i] = r
        return out

    def _reduce_bucket(self, exchange: int, bucket: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        # A ring per bucket: its outputs stay valid until that bucket's next-but-one exchange.
        reduced = self.collectives.allreduce(arrays, average=self.average, purpose=f"grads{bucket}", compress=True)
        return [r.reshape(a.shape) for r, a in zip(reduced, arrays, strict=True)]
