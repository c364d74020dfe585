"""Collectives over the engine's rings: allreduce (by the algorithm :mod:`.algorithms` picks), broadcast,
means and row gathering, among a set of members.

Everything here is collective: every member calls it in the same order with
equally shaped arguments (the ring checks nothing the caller can get wrong
silently only because all workers run the same program).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import numpy as np

from rdkeras.channels import Ring
from rdkeras.engine import Engine
from rdkeras.parallel.collectives import algorithms
from rdkeras.parallel.collectives.algorithms import Doubling, hierarchy_pass_bytes, host_groups
from rdkeras.parallel.options import ALGORITHMS, COMPRESSIONS
from rdkeras.transports.base import ShardingRing

_FLOAT_KINDS = ("float32", "float64")
_WIRE = {"fp16": "float16", "bf16": "bfloat16"}
KEPT_BYTES = 1 << 20  # from_owners above this runs on a ring released after it
CHUNK_BYTES = 32 << 20  # the most a from_owners call moves at once
LARGE_PURPOSE = "broadcast"  # the ring of such calls


def _chunks(arrays: Sequence[np.ndarray], limit: int) -> Iterator[list[tuple[int, int, int]]]:
    """`arrays` in consecutive calls of at most `limit` bytes on the wire: each a list of (array, first, last
    element) ranges of the flattened arrays, the larger arrays split."""
    chunk: list[tuple[int, int, int]] = []
    used = 0
    for i, a in enumerate(arrays):
        item = wire_dtype(a.dtype).itemsize
        step = max(1, limit // item)
        for lo in range(0, max(a.size, 1), step):
            hi = min(a.size, lo + step)
            if chunk and used + (hi - lo) * item > limit:
                yield chunk
                chunk, used = [], 0
            chunk.append((i, lo, hi))
            used += (hi - lo) * item
    if chunk:
        yield chunk


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """The ring's dtype for `dtype`: float32/float64 as they are, narrower floats as float32, and
    integers and booleans as float64 (exact below 2**53)."""
    dtype = np.dtype(dtype)
    if dtype.name in _FLOAT_KINDS:
        return dtype
    return np.dtype(np.float32) if dtype.kind == "f" or dtype.name == "bfloat16" else np.dtype(np.float64)


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
        self._algorithms: list[algorithms.Algorithm] = []  # the priority list, once chosen
        self._groups: list[list[int]] = []
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
        on the hosts (:func:`.algorithms.priorities` checks what was asked for, in one place)."""
        if self._chosen is None:
            capabilities = self.engine.capabilities
            groups = [list(self.members)]
            if self.size > 1 and capabilities.composes_rings and (self.requested != "ring" or self.compression):
                hosts = self._hosts if self._hosts is not None else self.engine.hosts()
                groups = host_groups(hosts, self.members)
                self._multi_host = len(groups) > 1
            self._algorithms = algorithms.priorities(self.requested, groups, capabilities, self.compression)
            if self.size == 1:
                self._algorithms = [algorithms.Ring("asked for" if self.requested == "ring" else "one member")]
            self._groups = groups
            large = algorithms.choose(self._algorithms, groups, 1 << 62, capabilities)
            if large.name == "hierarchical":
                grid = algorithms.grid_groups(groups)
                self._hierarchy = HierarchicalAllreduce(self, grid, grid=grid != groups)
            self.doubling_below = next(
                (a.below or 0 for a in self._algorithms if isinstance(a, Doubling) and a.below is not None), 0
            )
            self._chosen = (large.name, large.why(groups))
        return self._chosen

    def algorithm_for(self, nbytes: int) -> str:
        """The algorithm a call of `nbytes` (padded) runs (collective the first time, as :attr:`algorithm`): the
        first of the priority list enabled for that size."""
        self.algorithm  # noqa: B018 (chosen once)
        if self.size == 1:
            return "ring"
        return algorithms.choose(self._algorithms, self._groups, nbytes, self.engine.capabilities).name

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

    # -- the two halves of a ring allreduce, over one flat buffer of `size` equal shards (sharded optimizers) --

    def shard_elements(self, count: int, dtype: np.dtype | str) -> int:
        """Elements of each member's shard of a flat buffer of `count` elements of `dtype`: an equal share,
        rounded up to whole 64-byte lines (pad the buffer to ``size`` times this)."""
        line = max(1, 64 // np.dtype(dtype).itemsize)
        return -(-count // (self.size * line)) * line

    def reduce_scatter(
        self, flat: np.ndarray | Sequence[np.ndarray], average: bool = True, purpose: str = "shards"
    ) -> np.ndarray:
        """This member's shard (the ``position``-th of ``size`` equal ones) of the sum -- the mean with
        `average` -- of every member's flat float32/float64 buffer of ``size * shard_elements`` elements, given
        whole or as its consecutive parts (read where they lie): a view of registered memory, valid until the
        next-but-one call for this purpose. Each member sends and receives (N-1)/N of the buffer, half an
        allreduce's bytes."""
        parts = [np.ascontiguousarray(p).reshape(-1) for p in ([flat] if isinstance(flat, np.ndarray) else flat)]
        if not parts or len({p.dtype for p in parts}) > 1:
            raise TypeError("reduce_scatter: a buffer, or its consecutive parts, all of one dtype")
        dtype, size = parts[0].dtype, sum(p.size for p in parts)
        self._check_shards(dtype, size, "reduce_scatter")
        ring = self._ring(purpose, dtype.name, size * dtype.itemsize, "ring")
        if len(parts) > 1 and hasattr(ring.end, "reduce_scatter_parts"):
            return cast(ShardingRing, ring.end).reduce_scatter_parts(parts, average)
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if hasattr(ring.end, "reduce_scatter"):
            return cast(ShardingRing, ring.end).reduce_scatter(flat, average)
        shard = flat.size // self.size  # a backend without one: the allreduce's share
        (total,) = ring([flat], average)
        return total[self.position * shard : (self.position + 1) * shard]

    def allgather(self, shard: np.ndarray, purpose: str = "shards") -> np.ndarray:
        """Every member's `shard` (equal sizes, a multiple of 64 bytes; any dtype) concatenated in member order:
        a view of registered memory, valid until the next-but-one call for this purpose. Each member sends and
        receives (N-1)/N of the result."""
        shard = np.ascontiguousarray(shard).reshape(-1)
        if shard.nbytes % 64:
            raise ValueError(f"allgather: a shard of {shard.nbytes} bytes; shards must be whole 64-byte lines")
        ring = self._ring(purpose, shard.dtype.name, shard.nbytes * self.size, "ring")
        if hasattr(ring.end, "allgather"):
            return cast(ShardingRing, ring.end).allgather(shard)
        full = np.zeros(shard.size * self.size, wire_dtype(shard.dtype))  # a backend without one: an exact sum
        full[self.position * shard.size : (self.position + 1) * shard.size] = shard
        (total,) = ring([full], False)
        return total.astype(shard.dtype)

    def _check_shards(self, dtype: np.dtype, size: int, what: str) -> None:
        if dtype.name not in _FLOAT_KINDS:
            raise TypeError(f"{what}: float32/float64 buffers only, got {dtype.name}")
        if size % self.size or (size * dtype.itemsize // self.size) % 64:
            raise ValueError(
                f"{what}: a buffer of {size} elements does not split into {self.size} shards of whole 64-byte "
                f"lines; pad it to {self.size} x shard_elements({size}) elements"
            )

    def from_owners(
        self, arrays: Sequence[np.ndarray], owners: Sequence[int], purpose: str | None = None
    ) -> list[np.ndarray]:
        """Every member gets each array from its owner (a rank): an exact sum in which only the owner
        contributes (the others add zeros). Any dtype; returns fresh arrays. A caller that moves a large state
        in several calls names their `purpose` (:data:`LARGE_PURPOSE`) and releases it after the last."""
        me = self.engine.rank
        if self.size == 1 or not arrays:
            return [np.array(a, copy=True) for a in arrays]
        arrays = [np.asarray(a) for a in arrays]
        out = [np.empty(a.shape, a.dtype) for a in arrays]
        # A large one (the weights at the start) on a ring of its own, released after, and in calls of at most
        # CHUNK_BYTES: its registered memory and its copies stay that size, however large the model.
        large = purpose is None and sum(a.size * wire_dtype(a.dtype).itemsize for a in arrays) > KEPT_BYTES
        purpose = purpose or (LARGE_PURPOSE if large else "sync")
        for chunk in _chunks(arrays, CHUNK_BYTES):
            wire = [
                arrays[i].reshape(-1)[lo:hi].astype(wire_dtype(arrays[i].dtype))
                if owners[i] == me
                else np.zeros(hi - lo, wire_dtype(arrays[i].dtype))
                for i, lo, hi in chunk
            ]
            for (i, lo, hi), summed in zip(chunk, self.allreduce(wire, average=False, purpose=purpose), strict=True):
                out[i].reshape(-1)[lo:hi] = summed
        if large:
            self.release(purpose)
        return out

    def release(self, purpose: str) -> None:
        """Drops the rings of `purpose`, here and in the hierarchical allreduce's groups; the next call for it
        makes new ones (collective, as every ring: every member releases at the same call)."""
        for key in [key for key in self._rings if key[0].split(":", 1)[1] == purpose]:
            del self._rings[key]
        if self._hierarchy is not None:
            self._hierarchy.inside.release(purpose)
            self._hierarchy.across.release(purpose)

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
            full = np.zeros((int(sizes.sum()), *array.shape[1:]), wire_dtype(array.dtype))
            full[start : start + len(array)] = array
            wire.append(full)
        summed = self.allreduce(wire, average=False, purpose="rows")
        return [s.astype(a.dtype) for s, a in zip(summed, arrays, strict=True)]


class HierarchicalAllreduce:
    """A sum over hosts of L members each, in the engine (``hierarchicalAllreduce``, csrc/engine/hierarchical.cc):
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
        message_s, byte_s, _ = collectives.engine.capabilities.costs
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
