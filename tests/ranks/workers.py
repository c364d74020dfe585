"""Functions that run inside each rank of a multi-process test (see conftest.run_ranks).

Each returns a JSON-able value the test asserts on.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, cast

import numpy as np

import rdkeras
from rdkeras.errors import EngineError

SIZES = [0, 1, 7, 4096, 64 << 20]

# A rank run as a thread of the test process (tests.conftest.run_threads) finds its Engine's arguments
# here; a rank run as a process finds them in its RDKERAS_* variables.
THREAD_RANK = threading.local()


def open_engine(**kwargs: Any) -> rdkeras.Engine:
    """This rank's Engine, whether the rank is a process or a thread."""
    return rdkeras.Engine(**{**getattr(THREAD_RANK, "engine", {}), **kwargs})


def _publish(eng: rdkeras.Engine, name: str, value: int) -> None:
    eng.store.set(name, str(value).encode())


def _fetch(eng: rdkeras.Engine, name: str, rank: int) -> int:
    return int(eng.store.get([name], waiting_for=[rank])[0])


def write_read_sizes() -> dict:
    """Rank 0 writes then reads back every size into rank 1's arena and external regions."""
    out: dict = {"checked": []}
    with open_engine() as eng:
        rng = np.random.default_rng(1234)
        payloads = {n: rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES}
        flags = eng.empty(8, np.uint64)
        flags[:] = 0
        _publish(eng, f"flags/{eng.rank}", eng.register(flags))
        peer_flags = _fetch(eng, f"flags/{1 - eng.rank}", 1 - eng.rank)
        if eng.rank == 1:
            regions = {"arena": eng.empty(max(SIZES) + 64), "external": np.zeros(max(SIZES) + 64, np.uint8)}
            for kind, buf in regions.items():
                _publish(eng, f"key/{kind}", eng.register(buf))
            step = 0
            for kind, buf in regions.items():
                for n in SIZES:
                    step += 1
                    eng.wait_flag(flags, 0, step, peer=0)  # "payload `step` is in place"
                    out["checked"].append([kind, n, bool(np.array_equal(buf[3 : 3 + n], payloads[n]))])
                    eng.write_flag(0, peer_flags, 0, step)  # "checked; go on"
        else:
            step = 0
            for kind in ("arena", "external"):
                key = _fetch(eng, f"key/{kind}", 1)
                for n in SIZES:
                    step += 1
                    eng.write(1, payloads[n], key, offset=3)
                    eng.write_flag(1, peer_flags, 0, step)
                    back = np.zeros(n, np.uint8)
                    eng.read(1, back, key, offset=3)
                    out["checked"].append([kind, n, bool(np.array_equal(back, payloads[n]))])
                    eng.wait_flag(flags, 0, step, peer=1)
    return out


def flag_ordering(iterations: int) -> dict:
    """Flags never overtake data: every flag the receiver sees comes with the whole payload."""
    sizes = [8, 4096, 1 << 20, 24 << 20]  # 24 MiB: glibc memcpy switches to non-temporal stores
    bad = 0
    with open_engine() as eng:
        peer = 1 - eng.rank
        data = eng.empty(max(sizes))
        flags = eng.empty(8, np.uint64)
        flags[:] = 0
        _publish(eng, f"data/{eng.rank}", eng.register(data))
        _publish(eng, f"flags/{eng.rank}", eng.register(flags))
        peer_data, peer_flags = _fetch(eng, f"data/{peer}", peer), _fetch(eng, f"flags/{peer}", peer)
        src = np.empty(max(sizes), np.uint8)
        for i in range(1, iterations + 1):
            n = sizes[i % len(sizes)] if i % 16 == 0 else sizes[i % 2]
            if eng.rank == 0:
                src[:n] = (np.arange(n) + i) % 251
                eng.write(1, src[:n], peer_data)
                eng.write_flag(1, peer_flags, 0, i)  # "payload i is complete"
                eng.wait_flag(flags, 8, i, peer=1)  # its ack
            else:
                eng.wait_flag(flags, 0, i, peer=0)
                expect = zlib.crc32(((np.arange(n) + i) % 251).astype(np.uint8))
                bad += zlib.crc32(data[:n]) != expect
                eng.write_flag(0, peer_flags, 8, i)
    return {"bad": int(bad), "iterations": iterations}


def access_errors() -> dict:
    """Out-of-bounds and stale-key accesses raise clear errors; the connection survives."""
    errors: dict = {}
    with open_engine() as eng:
        if eng.rank == 1:
            region = eng.empty(4096)
            region[:] = 0
            _publish(eng, "key", eng.register(region))
            stale = eng.register(eng.empty(64))
            eng.deregister(stale)
            _publish(eng, "stale", stale)
            outside = np.zeros(64, np.uint8)  # registered memory outside the arena: no place for a flag
            _publish(eng, "outside", eng.register(outside))
            eng.barrier("done")
            errors["after"] = int(region[100])
        else:
            key, stale, outside = _fetch(eng, "key", 1), _fetch(eng, "stale", 1), _fetch(eng, "outside", 1)
            attempts = {
                "write_oob": lambda: eng.write(1, np.ones(16, np.uint8), key, offset=4090),
                "read_oob": lambda: eng.read(1, np.zeros(8, np.uint8), key, offset=4096 + 8),
                "write_stale": lambda: eng.write(1, np.ones(16, np.uint8), stale),
                "read_stale": lambda: eng.read(1, np.zeros(16, np.uint8), stale),
                "flag_stale": lambda: eng.write_flag(1, stale, 0, 1),
                "flag_unaligned": lambda: eng.write_flag(1, key, 3, 1),
                "flag_outside": lambda: eng.write_flag(1, outside, 0, 1),
            }
            for name, attempt in attempts.items():
                try:
                    attempt()
                    eng.flush(1)  # target-side errors surface here at the latest
                    errors[name] = None
                except EngineError as e:
                    errors[name] = [type(e).__name__, str(e)]
            eng.write(1, np.full(1, 42, np.uint8), key, offset=100)  # still works
            eng.flush(1)
            eng.barrier("done")
    return errors


DTYPES = ["float32", "float64", "float16", "int8", "int32", "int64", "uint16", "bool", "complex64"]
SHAPES = [(), (1,), (3, 5), (2, 3, 4)]


def _tensor(i: int, dtype: str, shape: tuple) -> np.ndarray:
    rng = np.random.default_rng(i)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def channel_roundtrip(mode: str) -> dict:
    """Rank 0 -> rank 1 -> rank 0 for every dtype and shape; rank 0 checks equality."""
    mismatches = []
    with open_engine() as eng:
        for dtype in DTYPES:
            for shape in SHAPES:
                name = f"{mode}-{dtype}-{len(shape)}"
                if mode == "static":
                    there = eng.static_channel(f"{name}-fwd", 0, 1, shape, dtype)
                    back = eng.static_channel(f"{name}-bwd", 1, 0, shape, dtype)
                else:
                    there = eng.dynamic_channel(f"{name}-fwd", 0, 1)
                    back = eng.dynamic_channel(f"{name}-bwd", 1, 0)
                for step in range(3):
                    x = _tensor(step, dtype, shape)
                    if eng.rank == 0:
                        there.send(x)
                        y = back.recv()
                        if y.dtype != x.dtype or y.shape != x.shape or not np.array_equal(x, y):
                            mismatches.append([dtype, list(shape), step])
                    else:
                        back.send(there.recv().copy())
    return {"mismatches": mismatches}


def exchange_then_teardown(pairs: int, messages: int) -> dict:
    """Both ranks send to each other at once over a fresh pair of static channels, then drop them at once:
    the last release a receiver writes lands in a sender that is done sending (and must still hold it)."""
    errors = []
    with open_engine() as eng:
        for p in range(pairs):
            fwd = eng.static_channel(f"x{p}-fwd", 0, 1, (1024,), np.uint8)
            bwd = eng.static_channel(f"x{p}-bwd", 1, 0, (1024,), np.uint8)
            tx, rx = (fwd, bwd) if eng.rank == 0 else (bwd, fwd)
            try:
                for m in range(messages):
                    tx.send(np.full(1024, m % 251, np.uint8))
                    if int(rx.recv()[0]) != m % 251:
                        errors.append(["wrong payload", p, m])
            except EngineError as e:  # a release that hit a deregistered block is reported on a later write
                errors.append([type(e).__name__, p, str(e)])
                break
            del tx, rx, fwd, bwd
        eng.barrier("end")
    return {"errors": errors}


def _use_then_drop(count: int, use: Any) -> dict:
    """Runs ``use(eng, i)`` (which builds something peers write into, uses it once and drops it; returns
    what it found wrong) `count` times, then flushes to every peer: a write that hit a deregistered block
    is reported on a later write to that peer, or by the flush."""
    errors: list = []
    with open_engine() as eng:
        try:
            for i in range(count):
                errors += use(eng, i)
            for p in range(eng.world_size):
                if p != eng.rank:
                    eng.flush(p)
        except EngineError as e:
            errors.append([type(e).__name__, str(e)])
        eng.barrier("end")
    return {"errors": errors}


def ring_then_teardown(rings: int) -> dict:
    """Every rank runs one allreduce over a fresh ring, then drops it at once: the right member's ack of
    this rank's last chunk may land after this rank has its result (and the ring must still hold its block)."""

    def use(eng: rdkeras.Engine, i: int) -> list:
        out = eng.ring(f"r{i}", 4096)([np.full(1000, eng.rank + i, np.float32)])
        expected = sum(range(eng.world_size)) + eng.world_size * i
        return [] if float(out[0][0]) == expected else [["wrong sum", i, float(out[0][0]), expected]]

    return _use_then_drop(rings, use)


def ps_then_teardown(servers: int) -> dict:
    """One parameter-server step over fresh servers, each closed right after: a worker's last "pulled"
    flag into an owner's block may still be on its way when the owner is done."""
    from rdkeras.parallel.parameter_server import ParameterServer

    def use(eng: rdkeras.Engine, i: int) -> list:
        ps = ParameterServer(eng, f"ps{i}", overlap_bytes=0)
        grads = [np.full(256, eng.rank + i, np.float32) for _ in range(eng.world_size)]
        ps.setup([g.shape for g in grads], [g.dtype for g in grads])
        new = [float(v[0]) for v in ps.publish_and_pull(*ps.push_and_reduce(*grads))]
        ps.close()
        mean = (eng.world_size - 1) / 2 + i
        return [] if all(v == mean for v in new) else [["wrong mean", i, new, mean]]

    return _use_then_drop(servers, use)


def ps_many_small(steps: int = 3) -> dict:
    """Parameter servers for 190 small variables (Inception-v3's count) and two large ones: each step's averages,
    and the writes each push takes (small gradients go to each owner as one message)."""
    from rdkeras.parallel.parameter_server import FUSE_BELOW, ParameterServer

    shapes = [(3 + i % 7, 5) for i in range(190)] + [(FUSE_BELOW // 4 + 3,), (FUSE_BELOW // 4 * 2,)]
    with open_engine() as eng:
        n, r = eng.world_size, eng.rank
        ps = ParameterServer(eng, "many", overlap_bytes=0)
        ps.setup(shapes, [np.float32] * len(shapes))
        wrong, writes = [], []
        for step in range(steps):
            grads = [np.full(s, 100.0 * step + r + i / 1000, np.float32) for i, s in enumerate(shapes)]
            ps.step += 1
            before = eng.traffic()["writes"]
            ps.push(range(len(grads)), grads)
            writes.append(eng.traffic()["writes"] - before)
            ps.announce()
            for i, got in zip(ps.owned(len(grads)), ps.reduce(grads), strict=True):
                want = np.float32(100.0 * step + (n - 1) / 2 + i / 1000)
                if not np.allclose(got, want, rtol=1e-6):
                    wrong.append([step, i, float(got.ravel()[0]), float(want)])
            ps.publish_and_pull(*[np.zeros(shapes[i], np.float32) for i in ps.owned(len(grads))])
        others = [i for i in range(len(shapes)) if ps.owner[i] != r]
        large = [i for i in others if ps.sizes[i] >= FUSE_BELOW]
        owners = {ps.owner[i] for i in others if ps.sizes[i] < FUSE_BELOW}  # that own small ones
        ps.close()
        return {
            "wrong": wrong,
            "writes": writes,
            "large": len(large),
            "owners": len(owners),
            "small": len(others) - len(large),
        }


def dynamic_changing_shapes(steps: int) -> dict:
    """A dynamic channel whose shape changes every step (like a variable-length batch)."""
    wrong = 0
    with open_engine() as eng:
        ch = eng.dynamic_channel("seq", 0, 1)
        for i in range(steps):
            shape = (1 + i % 5, 3 + (7 * i) % 11, 4)
            x = _tensor(i, "float32", shape)
            if eng.rank == 0:
                ch.send(x)
            else:
                y = ch.recv()
                wrong += y.shape != shape or not np.array_equal(x, y)
        if eng.rank == 0:
            ch.flush()
    return {"wrong": int(wrong)}


def steady_state_registrations(steps: int) -> dict:
    """After a warm-up step, a loop of transfers registers nothing new."""
    with open_engine() as eng:
        st = eng.static_channel("st", 0, 1, (256, 256), "float32")
        dy = eng.dynamic_channel("dy", 0, 1)
        src = eng.empty((128, 64), np.float32)  # a tensor the tracker placed in registered memory
        user = np.ones((32, 32), np.float32)  # a user array outside it: registered once, then cached
        x = np.ones((256, 256), np.float32)
        before = None
        for i in range(steps + 2):
            if i == 2:  # two warm-up steps: the receiver holds one step's tensors while the next arrive
                before = eng.counters()
            if eng.rank == 0:
                st.send(x)
                src[:] = i
                dy.send(src)
                user[:] = i
                dy.send(user)
                dy.flush()
            else:
                st.recv()
                a, b = dy.recv(), dy.recv()
                assert (a == i).all() and (b == i).all()
        after = eng.counters()
    return {"before": before, "after": after}


def kill_peer_during_transfer(victim: int) -> dict:
    """The victim rank dies mid-stream; the other must fail naming it, quickly.

    Rank 0 streams 16 MB messages to rank 1. Victim 0: the receiver is left
    waiting for data. Victim 1: the sender is left waiting for a free slot
    (and, over tcp, blocked on a full socket).
    """
    with open_engine(timeout=60) as eng:
        ch = eng.static_channel("big", 0, 1, (16 << 20,), "uint8")
        x = np.ones(16 << 20, np.uint8)
        out = _until_killed(eng, victim, lambda: ch.send(x) if eng.rank == 0 else ch.recv())
    if out["error"] is not None:
        out["error"] = out["error"][:2]  # (kind, message)
    return out


def _until_killed(eng: rdkeras.Engine, victim: int, call: Callable[[], object]) -> dict:
    """Runs `call` again and again; `victim` kills itself before its fourth. The others return the error that
    ended them and the seconds since their last completed call."""
    t0 = time.monotonic()
    try:
        for i in range(1000):
            if eng.rank == victim and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            call()
            t0 = time.monotonic()
    except EngineError as e:
        return {"error": _error(e), "seconds": time.monotonic() - t0}
    return {"error": None}


def connect_only(timeout_s: float) -> dict:
    """Just joins the job (for rendezvous failures)."""
    try:
        with open_engine(timeout=timeout_s):
            return {"error": None}
    except EngineError as e:
        return {"error": [type(e).__name__, str(e)]}


def ring_allreduce(calls: int) -> dict:
    """Every rank contributes rank-dependent tensors; results must equal numpy's sum."""
    errors = []
    with open_engine() as eng:
        n, r = eng.world_size, eng.rank
        for dtype in ("float32", "float64"):
            # float32 in one pass, its 12 MB tensor summed with streaming stores; float64 in 8 KiB buckets (~80
            # passes a call: tensors split across buckets and chunks; more passes would only repeat them).
            shapes = [(3,), (1,), (17, 5), (1000,), (2, 2, 2), (64 << 10,)] + [(3 << 20,)] * (dtype == "float32")
            capacity = sum(int(np.prod(s)) * np.dtype(dtype).itemsize + 64 for s in shapes)
            bucket = 32 << 20 if dtype == "float32" else 8192
            ring = eng.ring(f"ring-{dtype}", capacity, bucket_bytes=bucket)
            previous = None
            for call in range(calls):

                def contribution(rank, i, s, call=call, dtype=dtype):
                    rng = np.random.default_rng(1000 * call + 10 * rank + i)
                    return rng.standard_normal(s).astype(dtype)

                inputs = [contribution(r, i, s) for i, s in enumerate(shapes)]
                average = call % 2 == 1
                outputs = ring(inputs, average)
                for i, s in enumerate(shapes):
                    expect = sum(contribution(k, i, s).astype(np.float64) for k in range(n))
                    if average:
                        expect = expect / n
                    got = outputs[i]
                    tol = 1e-5 if dtype == "float32" else 1e-12
                    if got.shape != s or got.dtype != dtype or not np.allclose(got, expect, rtol=tol, atol=tol):
                        errors.append([dtype, call, i])
                    if got.ctypes.data % 64:  # TensorFlow aliases aligned outputs
                        errors.append([dtype, call, i, "misaligned"])
                if previous is not None:  # the previous call's outputs survive one more call
                    errors += (
                        [[dtype, call, "clobbered"]]
                        if not all(np.array_equal(a, b) for a, b in zip(previous[0], previous[1], strict=True))
                        else []
                    )
                previous = (outputs, [o.copy() for o in outputs])
        # bit-identical results on every rank
        digest = zlib.crc32(b"".join(o.tobytes() for o in outputs))
        return {"errors": errors, "digest": digest}


def subgroup_rings() -> dict:
    """Ranks {2, 0} reduce in one ring (listed out of order), rank 1 alone in another."""
    with open_engine() as eng:
        members = [1] if eng.rank == 1 else [2, 0]
        ring = eng.ring(f"group-{members}", 1 << 20, members=members)
        mine = [np.full((5, 3), eng.rank + 1.0, np.float32), np.arange(7, dtype=np.float32) * (eng.rank + 1)]
        out = ring(mine, average=True)
        try:
            eng.ring("outsider", 1 << 20, members=[r for r in range(eng.world_size) if r != eng.rank])
            refused = ""
        except ValueError as e:
            refused = str(e)
        return {"out": [o.tolist() for o in out], "refused": refused}


def store_holds_no_secret() -> dict:
    """Rank 0 looks through everything the rendezvous store holds after set-up for the token and the
    transport key, raw or in hex (it may read its own store's table: this is the check)."""
    from rdkeras.rendezvous import transport_key

    with open_engine() as eng:
        eng.static_channel("x", 0, 1, (4,), "float32")
        eng.barrier("set-up done")
        if eng.rank != 0:
            return {}
        token = os.environ["RDKERAS_JOB_TOKEN"].encode()
        needles = [token, transport_key(token), transport_key(token).hex().encode()]
        values = [bytes.fromhex(v) for v in eng.store._server._data.values()]
        return {"values": len(values), "found": [i for i, n in enumerate(needles) if any(n in v for v in values)]}


def _error(e: BaseException) -> list:
    return [type(e).__name__, str(e), getattr(e, "rank", None)]


def workload_until_failure(kind: str, seconds: float) -> dict:
    """Runs one kind of traffic among all ranks until `seconds` pass or something fails.

    channels: static and dynamic channels around the ring (r -> r+1); ring: allreduce of
    a few MB; ps: the parameter-server step (rdkeras.parallel.parameter_server) on numpy gradients.
    Returns the error that ended it (type, message, PeerError.rank), if any.
    """
    steps = 0
    try:
        with open_engine() as eng:
            n, r = eng.world_size, eng.rank
            if kind == "channels":
                right, left = (r + 1) % n, (r - 1) % n
                # Created in an order that cannot deadlock: even ranks send first, odd ones receive first.
                pairs = [("st", (1 << 16,), "float32"), ("dy", None, None)]
                ends: dict = {}
                for name, shape, dtype in pairs:
                    order = [(r, right), (left, r)] if r % 2 == 0 else [(left, r), (r, right)]
                    for src, dst in order:
                        key = f"{name}/{src}->{dst}"
                        ends[(name, src == r)] = (
                            eng.static_channel(key, src, dst, shape, dtype)
                            if shape
                            else eng.dynamic_channel(key, src, dst)
                        )
                x = np.ones(1 << 16, np.float32)
                y = np.arange(1000 + r, dtype=np.float64)

                def step() -> None:
                    ends[("st", True)].send(x)
                    ends[("st", False)].recv()
                    ends[("dy", True)].send(y)
                    ends[("dy", False)].recv()

            elif kind == "ring":
                ring = eng.ring("grads", 8 << 20)
                grads = [np.full(1 << 19, r, np.float32), np.ones(1000, np.float32)]

                def step() -> None:
                    ring(grads, average=True)

            elif kind == "ps":
                from rdkeras.parallel.parameter_server import ParameterServer

                ps = ParameterServer(eng, "ps")
                shapes = [(256, 64), (64,), (64, 10), (10,)]
                ps.setup(shapes, [np.float32] * len(shapes))
                grads = [np.full(s, 1.0, np.float32) for s in shapes]

                def step() -> None:
                    mine = ps.push_and_reduce(*grads)
                    ps.publish_and_pull(*mine)

            else:
                raise ValueError(kind)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                step()
                steps += 1
    except EngineError as e:
        return {"error": _error(e), "steps": steps}
    return {"error": None, "steps": steps}


def ring_disagreement(odd_rank: int, how: str) -> dict:
    """Every rank calls the same ring, except `odd_rank`, whose tensors differ (`how`: size, dtype, split)."""
    try:
        with open_engine() as eng:
            ring = eng.ring("r", 1 << 20)
            arrays = [np.ones(100, np.float32), np.ones(28, np.float32)]
            if eng.rank == odd_rank:
                arrays = {
                    "size": [np.ones(100, np.float32), np.ones(29, np.float32)],
                    "dtype": [np.ones(100, np.float64), np.ones(28, np.float64)],
                    "split": [np.ones(28, np.float32), np.ones(100, np.float32)],  # same bytes, other layout
                }[how]
            ring(arrays)
            return {"error": None}
    except EngineError as e:
        return {"error": _error(e)}


def shard_disagreement(odd_rank: int, op: str) -> dict:
    """Every rank reduce-scatters (`op`: or allgathers) a buffer of the same size, except `odd_rank`."""
    try:
        with open_engine() as eng:
            end = cast(Any, eng.ring("r", 1 << 20).end)
            floats = 16 * (2 if eng.rank == odd_rank else 1)
            if op == "reduce_scatter":
                end.reduce_scatter(np.ones(floats * eng.world_size, np.float32))
            else:
                end.allgather(np.ones(floats, np.float32))
            return {"error": None}
    except EngineError as e:
        return {"error": _error(e)}


class _Variable:
    """What share_new_variables reads and writes of a variable, in numpy."""

    def __init__(self, value: np.ndarray):
        self.value = value
        self.shape, self.dtype = value.shape, value.dtype

    def numpy(self) -> np.ndarray:
        return self.value

    def assign(self, value: np.ndarray) -> None:
        self.value = np.array(value)


def new_variables(odd_rank: int) -> dict:
    """Every rank shares the variables it created; `odd_rank` (if any) created one more."""
    from rdkeras.parallel.collectives import Collectives, share_new_variables

    with open_engine() as eng:
        made = [_Variable(np.full(3, eng.rank, np.float32)), _Variable(np.full((2, 2), 10 * eng.rank, np.int64))]
        if eng.rank == odd_rank:
            made.append(_Variable(np.zeros(1, np.float32)))
        try:
            share_new_variables(Collectives(eng, 1 << 20), made, "in strategy.scope()")
        except ValueError as e:
            return {"error": str(e)}
        return {"values": [v.value.tolist() for v in made]}


def hosts_allreduce(
    hosts: list[str],
    algorithm: str,
    sizes: list[int],
    calls: int = 3,
    bucket: int = 1 << 16,
    compression: str | None = None,
    within: bool = False,
) -> dict:
    """`calls` allreduces (sums, then means) of float32 and float64 tensors of `sizes`, the ranks grouped into
    `hosts`, in passes of `bucket` bytes, compressed as asked; each call's inputs differ, so a result kept from an
    earlier call would show."""
    from rdkeras.parallel.collectives import Collectives

    with open_engine() as eng:
        collectives = Collectives(
            eng, bucket, algorithm=algorithm, hosts=hosts, compression=compression, compress_within_hosts=within
        )
        out: dict = {"algorithm": collectives.algorithm[0], "described": collectives.describe(), "calls": []}
        for call in range(calls):
            rng = np.random.default_rng(1000 * call + eng.rank)
            arrays = [rng.standard_normal(n).astype(np.float32 if i % 2 else np.float64) for i, n in enumerate(sizes)]
            average = call % 2 == 1
            reduced = collectives.allreduce(arrays, average=average, compress=True)
            out["calls"].append({"average": average, "sums": [r.tolist() for r in reduced]})
        return out


def wire_round_trip(values: list[float]) -> dict:
    """`values` (float32) through a one-member allreduce on each 16-bit wire type: what the wire keeps."""
    with open_engine() as eng:
        group = eng.doubling("one", 1 << 16)
        x = np.asarray(values, np.float32)
        return {wire: group([x], wire=wire)[0].view(np.uint32).tolist() for wire in ("float16", "bfloat16")}


def doubling_with_a_death(victim: int) -> dict:
    """5 ranks sum 1 KB by recursive doubling again and again; `victim` dies before its fourth call."""
    from rdkeras.parallel.collectives import Collectives

    with open_engine(timeout=60) as eng:
        collectives = Collectives(eng, 1 << 20, algorithm="doubling")
        x = np.ones(256, np.float32)
        return _until_killed(eng, victim, lambda: collectives.allreduce([x], average=False))


def hierarchical_with_a_death(victim: int) -> dict:
    """2 hosts x 2 ranks allreduce 8 MB hierarchically again and again; `victim` dies before its fourth call,
    while the others are inside theirs."""
    from rdkeras.parallel.collectives import Collectives

    with open_engine(timeout=60) as eng:
        collectives = Collectives(eng, 1 << 20, algorithm="hierarchical", hosts=["a", "a", "b", "b"])
        x = np.ones(2 << 20, np.float32)
        return _until_killed(eng, victim, lambda: collectives.allreduce([x], average=False))


def _comm(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread ended meanwhile
        return "(ended)"


def _resources(eng: rdkeras.Engine | None = None) -> dict:
    """What could leak: resident memory, file descriptors, threads, /dev/shm files, registrations."""
    import threading

    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    out = {
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
        "py_threads": threading.active_count(),
        "dev_shm": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0,
        # Which threads, when a count moves: Python's names, and the OS's for the engine's own.
        "thread_names": sorted(t.name for t in threading.enumerate()),
        "os_thread_names": sorted(_comm(t) for t in os.listdir("/proc/self/task")),
    }
    if eng is not None:
        c = eng.counters()
        out.update(
            registrations=c["registrations"] - c["deregistrations"],
            pool_bytes_reserved=c["pool_bytes_reserved"],
            pool_bytes_in_use=c["pool_bytes_in_use"],
        )
    return out


def _settled_resources(quiet_s: float = 0.2, limit_s: float = 2.0) -> dict:
    """`_resources()` once the OS thread count has held still for `quiet_s`: a thread whose
    Python side was joined may still be ending, and must not count as one that stays."""
    sample, deadline = _resources(), time.monotonic() + limit_s
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        now = _resources()
        if now["threads"] != sample["threads"] or "(ended)" in now["os_thread_names"]:
            still_since = time.monotonic()
        elif time.monotonic() - still_since >= quiet_s:
            return now
        sample = now
    return sample


def soak(steps: int, sample_every: int, warmup: int) -> dict:
    """Channels (static and dynamic), a ring allreduce and a parameter-server step, every step,
    for `steps` steps; samples the resources after `warmup` steps and every `sample_every`."""
    from rdkeras.parallel.parameter_server import ParameterServer

    samples = []
    with open_engine() as eng:
        n, r = eng.world_size, eng.rank
        right, left = (r + 1) % n, (r - 1) % n
        order = [(r, right), (left, r)] if r % 2 == 0 else [(left, r), (r, right)]
        st, dy = {}, {}
        for src, dst in order:
            st[src == r] = eng.static_channel(f"st/{src}->{dst}", src, dst, (256, 256), "float32")
        for src, dst in order:
            dy[src == r] = eng.dynamic_channel(f"dy/{src}->{dst}", src, dst)
        ring = eng.ring("grads", 4 << 20)
        ps = ParameterServer(eng, "ps")
        shapes = [(128, 64), (64,), (64, 10)]
        ps.setup(shapes, [np.float32] * 3)
        grads = [np.full(s, r + 1.0, np.float32) for s in shapes]
        x = np.full((256, 256), r, np.float32)
        checks = 0
        for step in range(steps):
            st[True].send(x)
            got = st[False].recv()
            checks += int(got[0, 0] == left)
            y = np.arange(1 + step % 97, dtype=np.float64) * r  # a new shape most steps
            dy[True].send(y)
            z = dy[False].recv()
            checks += int(z.shape == (1 + step % 97,) and (z.size < 2 or z[1] == left))
            (total,) = ring([np.full(1 << 16, r + 1.0, np.float32)])
            checks += int(total[0] == n * (n + 1) / 2)
            ps.publish_and_pull(*ps.push_and_reduce(*grads))
            if step + 1 == warmup or (step + 1 > warmup and (step + 1) % sample_every == 0):
                import gc

                gc.collect()
                samples.append({"step": step + 1, **_resources(eng)})
        dy[True].flush()
    return {"samples": samples, "checks": checks, "expected": 3 * steps}


def engine_cycles(cycles: int) -> dict:
    """Creates, uses and closes `cycles` engines in a row in this process (all ranks together)."""
    import gc

    before = after = None
    for i in range(cycles + 1):
        with open_engine() as eng:
            ring = eng.ring(f"r{i}", 1 << 16)
            ring([np.ones(100, np.float32)])
            if eng.world_size > 1:
                ch = eng.static_channel(f"c{i}", 0, 1, (64,), "float32")
                ch.send(np.ones(64, np.float32)) if eng.rank == 0 else ch.recv()
        del eng, ring
        gc.collect()
        if i == 0:  # the first engine warms up imports, pools and caches
            before = _settled_resources()
    # Python's join() returns once a thread's Python state is gone, a moment before the OS thread
    # itself has ended (the store's thread is joined so): one still ending is no leak.
    after, settle = _resources(), time.monotonic() + 2.0
    while after["threads"] > before["threads"] and time.monotonic() < settle:
        time.sleep(0.01)
        after = _resources()
    from rdkeras import engine as engine_module

    return {"before": before, "after": after, "open_engines": len(engine_module._OPEN)}


def connect_and_count_threads(timeout_s: float) -> dict:
    """Joins the job and says how many threads this process runs (rank 0 hosts the store)."""
    import threading

    try:
        with open_engine(timeout=timeout_s):
            return {"error": None, "threads": threading.active_count()}
    except EngineError as e:
        return {"error": [type(e).__name__, str(e)], "threads": threading.active_count()}


def resolved_rank() -> dict:
    """This process's rank as rdkeras resolves it (what the benchmarks pin a core by)."""
    from rdkeras import cluster

    return {"rank": cluster.resolve().rank}


OWNED = [((3000,), "float32", 1), ((7, 5), "float64", 0), ((1000,), "int64", -1), ((33,), "bool", 0),
         ((0, 4), "float32", 1), ((), "float32", 0), ((100,), "float16", 1)]  # fmt: skip


def owned_value(shape: tuple, dtype: str, rank: int) -> np.ndarray:
    """What rank `rank` holds of an array of OWNED (owners send theirs, the others something else)."""
    values = np.random.default_rng(rank).standard_normal(shape) * 1000
    return (values > 0) if dtype == "bool" else values.astype(dtype)


def from_owners_round_trip() -> dict:
    """Every array of OWNED from its owner (-1: the last rank), by Collectives.from_owners."""
    from rdkeras.parallel.collectives import Collectives

    with open_engine() as eng:
        collectives = Collectives(eng, 4096)
        owners = [o % eng.world_size for _, _, o in OWNED]
        got = collectives.from_owners([owned_value(s, d, eng.rank) for s, d, _ in OWNED], owners)
        return {"got": [[g.dtype.name, list(g.shape), g.astype(np.float64).ravel().tolist()] for g in got],
                "discarded": eng.counters()["pool_bytes_discarded"]}  # fmt: skip


def reduce_scatter_in_parts(sizes: list[int]) -> dict:
    """A float32 buffer reduce-scattered whole and as its consecutive parts of `sizes` elements (then padding)."""
    from rdkeras.parallel.collectives import Collectives

    with open_engine() as eng:
        collectives = Collectives(eng, 4096)
        per = collectives.shard_elements(sum(sizes), np.float32)
        flat = np.zeros(per * eng.world_size, np.float32)
        flat[: sum(sizes)] = np.random.default_rng(eng.rank).standard_normal(sum(sizes))
        cuts = np.cumsum([0, *sizes, flat.size - sum(sizes)])
        parts = [flat[a:b] for a, b in itertools.pairwise(cuts)]
        whole = np.array(collectives.reduce_scatter(flat, average=True))
        return {"whole": whole.tolist(), "parts": np.array(collectives.reduce_scatter(parts, average=True)).tolist()}


def shards_in_calls(per: int, limit: int) -> dict:
    """A float32 buffer of `per` elements a member reduce-scattered and its shard allgathered, in calls of at most
    `limit` bytes (collectives.in_calls) and in one call each: both results; and the buffer's shard reduce-scattered
    from its parts in calls."""
    from rdkeras.parallel.collectives import Collectives, allgather_in_calls, reduce_scatter_in_calls

    with open_engine() as eng:
        collectives = Collectives(eng, 4096)
        flat = np.random.default_rng(eng.rank).standard_normal(per * eng.world_size).astype(np.float32)
        out = {}
        for label, bound in (("calls", limit), ("one", 1 << 30)):
            mine = reduce_scatter_in_calls(collectives, flat, "grads", bound)
            out[label] = {
                "shard": mine.tolist(),
                "gathered": allgather_in_calls(collectives, mine + eng.rank, "w", bound).tolist(),
            }
        # The same buffer as a layer's gradients: parts of uneven sizes, one empty, none aligned to a call.
        cuts = [0, 7, 7, per + 5, per * eng.world_size]
        parts = [flat[a:b] for a, b in itertools.pairwise(cuts)]
        out["parts"] = reduce_scatter_in_calls(collectives, parts, "grads", limit).tolist()
        # A shard allgathered from its pieces: uneven, one empty, a call's worth spanning three of them.
        shard = np.array(out["calls"]["shard"], np.float32) + eng.rank
        cuts = [0, 3, 3, 250, 300, per]
        pieces = [shard[a:b] for a, b in itertools.pairwise(cuts)]
        out["gathered_from_pieces"] = allgather_in_calls(collectives, pieces, "w", limit).tolist()
        return out


def shard_round_trip(counts: list[int], transport_bucket: int = 4096, calls: int = 3) -> dict:
    """For each count: a flat float32 buffer padded to the members' shards, reduce-scattered (sums, then means),
    each member adding its rank to its shard, then allgathered; and one float64 buffer the same way."""
    from rdkeras.parallel.collectives import Collectives

    with open_engine() as eng:
        collectives = Collectives(eng, transport_bucket)
        out: dict = {"calls": []}
        for call in range(calls):
            for count in counts:
                for dtype in (np.float32, np.float64):
                    per = collectives.shard_elements(count, dtype)
                    flat = np.zeros(per * collectives.size, dtype)
                    flat[:count] = np.random.default_rng(1000 * call + eng.rank).standard_normal(count)
                    average = call % 2 == 1
                    mine = collectives.reduce_scatter(flat, average=average)
                    gathered = collectives.allgather(mine + eng.rank)
                    out["calls"].append(
                        {"count": count, "average": average, "per": per, "dtype": np.dtype(dtype).name,
                         "shard": mine.tolist(), "gathered": gathered.tolist()}
                    )  # fmt: skip
        return out
