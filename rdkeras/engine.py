"""The engine's Python face: a connected set of ranks and the channels between them.

    with Engine(transport="shm") as eng:          # rank, world, rendezvous from RDKERAS_*
        if eng.rank == 0:
            tx = eng.static_channel("act", src=0, dst=1, shape=(32, 128), dtype="float32")
            tx.send(x)
        else:
            rx = eng.static_channel("act", src=0, dst=1, shape=(32, 128), dtype="float32")
            y = rx.recv()            # a view into registered memory: no copy

The face runs the rendezvous (rdkeras.rendezvous) and names channels and rings;
everything else is the backend's (rdkeras.transports.base.Backend), chosen by
name in one place (rdkeras.transports): the native engine for shm, tcp and
verbs (rdkeras._engine, C++), the RPC baseline for grpc. A benchmark flips the
transport and nothing else.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdkeras import _engine, cluster, flight, hang_watch, jobtoken, reports, transports
from rdkeras import options as options_lib
from rdkeras._log import logger
from rdkeras.channels import ChannelMaker, _nbytes, as_buffer
from rdkeras.errors import EngineError, PeerError, TimeoutError, peer_error  # noqa: A004
from rdkeras.rendezvous import Store, transport_key
from rdkeras.transports.base import Backend, BackendConfig, TransportOptions

TRANSPORTS = ("auto", *transports.names())


def host_identity() -> str:
    """Equal for processes that can reach each other's shm: the engine's own formula (socket_util.h)."""
    return _engine.host_identity()


class Engine(ChannelMaker):
    """A process's endpoint in a job of `world_size` ranks.

    Every argument left out comes from the environment: the job's shape from
    :func:`rdkeras.cluster.resolve` (the launcher's ``RDKERAS_*`` variables, TF_CONFIG, torchrun,
    SLURM), the rest from :func:`rdkeras.options.from_env` (or `settings`, already read).

    Args:
        rank: This process's rank.
        world_size: Number of ranks.
        transport: "auto", "shm" (one host), "tcp", "shm+tcp" (shm within a host, tcp between),
            "verbs", or a baseline: "grpc", "rpc+shm", "rpc+tcp", "rpc+verbs" (default: ``RDKERAS_TRANSPORT``
            or "auto", which picks shm when every rank is on this host, else verbs where every rank
            has RDMA, else shm+tcp where a host has several ranks, else tcp).
        master_addr: Address of the rendezvous store.
        master_port: Its port.
        token: The job token all ranks share (default: ``rdkeras.jobtoken.resolve``:
            ``RDKERAS_JOB_TOKEN``, ``RDKERAS_JOB_TOKEN_FILE``, or this user's secret file
            keyed by the job). The local launcher generates one per job.
        timeout: Seconds any wait may take before it fails naming the peer
            (``RDKERAS_TIMEOUT``, default 300).
        heartbeat_timeout: Seconds a peer may stay silent before it is declared stalled (stopped, hung,
            swapped out) and named to every rank (``RDKERAS_HEARTBEAT_TIMEOUT``, default 30; 0: no
            heartbeat). The native transports beat from a thread that runs no Python, so a long step
            beats and a stopped process does not.
        arena_bytes: Registered address space to reserve (``RDKERAS_ARENA_BYTES``).
        options: Transport settings (default: from ``RDKERAS_IB_DEVICE``, ``RDKERAS_IB_PORT``,
            ``RDKERAS_IB_GID_INDEX``, ``RDKERAS_NT_THRESHOLD``; see TransportOptions).
        settings: The ``RDKERAS_*`` settings, if the caller read them already (:mod:`rdkeras.options`).
        store: A client of the job's store, connected already as this rank (an elastic group re-forming:
            :mod:`rdkeras.elastic`); the engine closes it with itself, but not when the engine fails to start.

    The rendezvous store is hosted by rank 0, or by a launcher where ``RDKERAS_STORE=launcher``
    (the launcher then reports workers that die, so a death during start-up is named at once).

    Attributes:
        backend: The transport's :class:`~rdkeras.transports.base.Backend` underneath.
        store: The rendezvous store (setup-time key-value exchange between ranks).
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        transport: str | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        token: str | bytes | None = None,
        timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        rendezvous_timeout: float | None = None,
        arena_bytes: int | None = None,
        options: TransportOptions | None = None,
        settings: options_lib.Options | None = None,
        store: Store | None = None,
    ):
        settings = options_lib.from_env() if settings is None else settings
        self.rank, self.world_size, master_addr, master_port = cluster.job_shape(
            rank, world_size, master_addr, master_port
        )
        self.transport = str(settings.transport if transport is None else transport)
        self.timeout = options_lib.check_timeout(settings.timeout if timeout is None else timeout)
        # Start-up is never bounded more loosely than any other wait (an explicit `timeout` of 5 s means 5).
        if rendezvous_timeout is None:
            rendezvous_timeout = min(settings.rendezvous_timeout, self.timeout)
        self.rendezvous_timeout = options_lib.check_timeout(rendezvous_timeout, "rendezvous_timeout")
        self._hosts: list[str] | None = None
        self.heartbeat_timeout = options_lib.check_heartbeat(
            settings.heartbeat_timeout if heartbeat_timeout is None else heartbeat_timeout
        )
        arena_bytes = int(settings.arena_bytes if arena_bytes is None else arena_bytes)
        if self.transport != "auto":
            transports.check_viable(self.transport)  # an unknown or unusable one fails here, before any connection
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if token is None:  # RDKERAS_JOB_TOKEN, a token file, or this user's secret keyed by the job
            token = jobtoken.resolve(self.world_size, cluster.job_key(), settings)
        if self.world_size > 1 and master_port == 0:
            raise EngineError("no rendezvous port: set RDKERAS_MASTER_PORT (and RDKERAS_MASTER_ADDR)")
        token_bytes = token.encode() if isinstance(token, str) else bytes(token)
        options = settings.transport_options if options is None else options

        self._names: set[str] = set()
        self._closed = False
        self._exchange_s = 0.0  # inside the training step's exchange ops (timed_exchange)
        self._stop_watching: Callable[[], None] = _nothing
        # RDKERAS_STORE=launcher: the launcher hosts the store (and reports workers that die), else rank 0.
        hosted_by = settings.store
        self._token = token_bytes  # (an elastic group's next engine proves the same token)
        self.store_address = master_addr
        self.store = store or Store(
            self.rank,
            self.world_size,
            master_addr,
            master_port,
            token_bytes,
            self.timeout,
            serve=None if hosted_by == "rank0" else False,
            connect_timeout=self.rendezvous_timeout,
        )
        try:
            if self.transport == "auto":
                self.transport = self._choose_transport()
            # Listeners bind the address this rank reaches rank 0 from: the job's network, not 0.0.0.0.
            host = self.store.local_host
            config = BackendConfig(
                self.rank,
                self.world_size,
                self.timeout,
                arena_bytes,
                advertise_host=host,
                bind_host=host,
                options=options,
                heartbeat_timeout=self.heartbeat_timeout,
                progress_timeout=-1.0 if settings.progress_timeout is None else settings.progress_timeout,
            )
            spec = transports.check_viable(self.transport)  # ("auto" chose among the viable ones)
            self.capabilities = spec.capabilities  # what the collectives may ask of it
            self.backend: Backend = spec.create(config)
            descriptors = self._gather_at_start("endpoints", self.backend.descriptor.encode())
            # Peers prove they hold a key derived from the token; no secret is in the store or on the wire.
            # While waiting for peers, the store says whether one of them already failed.
            self.backend.connect(
                [d.decode() for d in descriptors], transport_key(token_bytes), self.store.check, self.rendezvous_timeout
            )
            self.store.on_failure = self.backend.report_failure  # ranks waiting on the transport hear it too
            self._stop_watching = hang_watch.start(self.backend, reports.on_uncaught_exception(self.stop_on_error))
        except BaseException as e:
            if isinstance(e, PeerError) and e.rank is not None:
                self.store.abort(e.rank, str(e))  # the others' waits name the rank that failed
            if store is None:
                self.store.close()
            raise
        _OPEN.add(self)

    def stop_on_error(self, error: BaseException) -> None:
        """This rank stops on `error` (uncaught, or leaving a ``with`` block): unless it names another rank's
        failure, it is this rank's own, and the others stop waiting for this rank at once, naming it. The
        launcher hears it through the failure report (rdkeras.reports)."""
        blamed = getattr(error, "rank", None)
        if isinstance(error, PeerError) and blamed is not None and blamed != self.rank:
            return  # a failure elsewhere: close() reports it
        if (known := self.backend.failure) is not None and known[0] != self.rank:
            return  # the error is that failure, wrapped (TensorFlow wraps what its ops raise): close() reports it
        why = f"uncaught {type(error).__name__}: {error}"[:500]
        self.backend.report_failure(self.rank, why)
        self.store.abort(self.rank, why)
        reports.write(self.rank, self.rank, why)

    def _gather_at_start(self, name: str, value: bytes) -> list[bytes]:
        """Every rank's `value`, within the rendezvous timeout; a rank that never arrives is named."""
        try:
            return self.store.all_gather(name, value, timeout=self.rendezvous_timeout)
        except TimeoutError as e:
            missing = getattr(e, "ranks", [])
            if not missing:
                raise
            ranks = ", ".join(map(str, missing))
            raise peer_error(
                missing[0],
                f"rank{'s' if len(missing) > 1 else ''} {ranks} never reached the rendezvous within "
                f"{self.rendezvous_timeout:g} s: not started, died during start-up, or started with another "
                "RDKERAS_MASTER_ADDR/PORT or world size (RDKERAS_RENDEZVOUS_TIMEOUT waits longer)",
            ) from None

    def hosts(self) -> list[str]:
        """Every rank's host identity (equal where ranks share shared memory), by rank. Collective the first
        time (every rank asks at the same point); remembered after."""
        if self._hosts is None:
            self._hosts = [v.decode() for v in self._gather_at_start("hosts", host_identity().encode())]
        return list(self._hosts)

    def _choose_transport(self) -> str:
        """transport="auto": every rank's host and viable transports decide (rdkeras.transports.choose_auto);
        logged once, on rank 0."""
        mine = f"{host_identity()}|{transports.auto_facts()}"
        facts = [v.decode().split("|", 1) for v in self._gather_at_start("transport-facts", mine.encode())]
        choice, reason = transports.choose_auto([h for h, _ in facts], [f for _, f in facts])
        if self.rank == 0:
            logger.info(f"transport=auto chose {choice}: {reason}")
        return choice

    # -- registered memory and one-sided access ---------------------------------

    def empty(self, shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray:
        """An uninitialized array in registered memory (64-byte aligned)."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"empty: shape {shape} has a negative dimension")
        nbytes = _nbytes(shape, dtype)
        return self.backend.alloc(nbytes).view(dtype).reshape(shape)

    def register(self, array: Any) -> int:
        """Registers `array`'s memory for peers to write and read; returns the key they address it by. The engine
        keeps a reference to `array` until :meth:`deregister`, so the memory cannot be freed under a peer's write.
        Read-only buffers are refused."""
        buf = as_buffer(array)
        if memoryview(buf).readonly:
            raise ValueError(
                "register: the buffer is read-only, and peers write into registered memory "
                "(pass a writable array, e.g. np.array(x) or np.require(x, requirements='W'))"
            )
        return self.backend.register(buf)

    def deregister(self, key: int) -> None:
        """Withdraws a registration: the key is stale from now on, everywhere."""
        self.backend.deregister(key)

    def write(self, peer: int, src: Any, key: int, offset: int = 0) -> None:
        """One-sided write of `src`'s bytes into `peer`'s region `key` at `offset`."""
        self.backend.write(peer, as_buffer(src), key, offset)

    def read(self, peer: int, dst: Any, key: int, offset: int = 0) -> None:
        """One-sided read of len(dst) bytes from `peer`'s region `key` at `offset`."""
        buf = as_buffer(dst)
        self.backend.read(peer, buf, key, offset)
        self.backend.count_received(memoryview(buf).nbytes)

    def count_received(self, nbytes: int) -> None:
        """Adds to ``traffic()["bytes_received"]``: for protocols whose peers write into this
        rank's memory one-sidedly (the transport sees only the writer)."""
        self.backend.count_received(int(nbytes))

    def write_flag(self, peer: int, key: int, offset: int, value: int) -> None:
        """Sets an 8-byte flag, ordered after every earlier write to `peer`."""
        self.backend.write_flag(peer, key, offset, value)

    def flush(self, peer: int) -> None:
        """Waits until earlier operations to `peer` completed; raises errors it reported."""
        self.backend.flush(peer)

    def wait_flag(self, buffer: Any, offset: int, value: int, peer: int) -> None:
        """Waits until the 8-byte flag at `offset` in local `buffer` is >= value."""
        self.backend.wait_flag(buffer, offset, value, peer)

    def counters(self) -> dict[str, int]:
        """Tensor tracker counters: registrations, bytes_registered, cache_hits, pool_*."""
        return self.backend.counters()

    def traffic(self) -> dict[str, float]:
        """What this rank moved so far: bytes_written, bytes_read, writes, reads, flags (as the
        initiator), bytes_received (what arrived here for it: channel messages, ring chunks,
        reads), wait_seconds (blocked on peers) and exchange_seconds (inside the training step's exchange
        ops: their work and waits, see :meth:`count_exchange`)."""
        return {**self.backend.traffic(), "exchange_seconds": self._exchange_s}

    def count_exchange(self, seconds: float) -> None:
        """Adds `seconds` spent inside a training step's exchange op to ``traffic()["exchange_seconds"]``
        (:func:`rdkeras.parallel.collectives.timed_exchange`)."""
        self._exchange_s += seconds

    # -- channels ----------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineError(f"{what}: the engine is closed")

    def exchange(self, name: str, value: bytes | None, sources: Sequence[int] | None = None) -> list[bytes]:
        """The one set-up primitive past the engine's face (the rendezvous store stays behind it): this rank
        publishes `value` under `name` (nothing where None) and gets what each rank of `sources` (default: every
        rank) published under it, in that order, waiting within the engine's timeout; a rank that failed
        meanwhile is named. Collective among the ranks involved; each name is used once."""
        self._check_open(f"exchange {name!r}")
        if value is not None:
            self.store.set(f"{name}/{self.rank}", bytes(value))
        ranks = list(range(self.world_size)) if sources is None else [int(r) for r in sources]
        return self.store.get([f"{name}/{r}" for r in ranks], waiting_for=ranks) if ranks else []

    def tell_host(self, key: str, value: bytes) -> None:
        """Leaves `value` under `key` for the store's host (an elastic job's launcher; ranks use exchange)."""
        self.store.set(key, bytes(value))

    def host_says(self, key: str) -> bytes | None:
        """What the store's host (an elastic job's launcher) left under `key`, None if nothing yet; no wait."""
        return self.store.peek(key)

    def successor(self) -> dict[str, Any]:
        """The keyword arguments of this worker's next Engine (an elastic group's): these settings, the job token."""
        return dict(
            transport=self.transport,
            timeout=self.timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            rendezvous_timeout=self.rendezvous_timeout,
            token=self._token,
        )

    def barrier(self, name: str = "barrier") -> None:
        self.store.barrier(name)

    def close(self) -> None:
        """Waits (briefly) for the other ranks, then closes connections.

        After a failure it waits for nobody: it reports the failed rank to the store (so the
        ranks waiting there name it too) and closes.
        """
        if self._closed:
            return
        if isinstance(error := sys.exc_info()[1], Exception):
            self.stop_on_error(error)  # closed while an error propagates (a finally): not a clean leave
        self._closed = True
        _OPEN.discard(self)
        self._stop_watching()
        self._stop_watching = _nothing  # (it held this engine: a cycle that kept its memory until a gc)
        self.backend.begin_close()  # another thread's wait ends now, not at the barrier's end
        try:
            if failure := self.backend.failure:
                flight.dump(self.backend, self.rank, failure)
                reports.write(self.rank, failure[0], failure[2], reporter=failure[1])
                self.store.abort(failure[0], failure[2])
            else:
                self.store.barrier("close", timeout=min(self.timeout, 30.0))
        except EngineError:
            pass  # a peer is gone; close anyway
        finally:
            self.backend.close()
            self.store.close()

    def abandon(self) -> Store:
        """Leaves a group that lost a member (an elastic job re-forming): tells the store the failure this engine
        saw (a stall is known only to the peers that saw it), closes the transport and frees its memory at once --
        nobody waited for, no report written -- and hands the caller the store client, still connected."""
        if self._closed:
            raise EngineError("abandon: the engine is closed")
        if (failure := self.backend.failure) is not None:
            self.store.abort(failure[0], failure[2])
        self._closed = True
        _OPEN.discard(self)
        self._stop_watching()
        self._stop_watching = _nothing  # (it held this engine: a cycle that kept its memory until a gc)
        self.backend.begin_close()
        self.backend.close()
        return self.store

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None and not self._closed and isinstance(error, Exception):
            self.stop_on_error(error)  # leaving the block on an error: the others must not wait for this rank
        self.close()


_OPEN: weakref.WeakSet[Engine] = weakref.WeakSet()  # engines not closed yet


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit (also after an uncaught exception): an engine left open is closed, so
    its rank says goodbye, or reports the failure it saw, instead of just vanishing."""
    for engine in list(_OPEN):
        engine.close()


def _nothing() -> None:
    pass
