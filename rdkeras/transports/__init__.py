"""Transports: the one place a backend is chosen by name.

What lives where:

- this package holds the registry (here), the one interface every transport
  implements (``base.py``: :class:`~rdkeras.transports.base.Backend`), and the
  Python baselines: their common base (``baseline.py``, ``baseline_channels.py``),
  ``grpc.py`` (gRPC) and ``rpc.py`` (RPC messages over a native transport);
- the native transports (shm, tcp, shm+tcp, verbs) are C++, one folder each in
  ``csrc/transport/``, behind the engine in ``csrc/engine/`` and reached
  through ``rdkeras._engine``.

The registry maps a name to a factory, a viability check and what other code
may need to know about a transport (its :class:`~rdkeras.transports.base.Capabilities`).
``rdkeras.Engine`` checks it once (``check_viable``), makes the backend with the
spec's ``create`` and never looks at the name itself; it then holds the transport's
capabilities (``Engine.capabilities``), which other code asks instead of branching
on the name. Adding a backend is one ``register(BackendSpec(...))`` call (as
tensorpipe and gloo register theirs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rdkeras import _engine
from rdkeras.transports.base import Backend, BackendConfig, Capabilities, TransportOptions


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend: how to tell whether it can run here, how to make one, and what it can do."""

    name: str
    summary: str
    why_not_viable: Callable[[], str]  # "" when it can run in this process
    create: Callable[[BackendConfig], Backend]
    capabilities: Capabilities


_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> None:
    """Adds a backend under ``spec.name`` (a name may be registered once)."""
    if spec.name in _REGISTRY or spec.name == "auto":
        raise ValueError(f"a transport named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def names() -> tuple[str, ...]:
    """Every registered transport, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> BackendSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; choose one of auto, {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def check_viable(name: str) -> BackendSpec:
    """Transport `name`'s spec, once it is known to run in this process: the one viability check (the engine
    makes it before any connection)."""
    spec = get(name)
    if why := spec.why_not_viable():
        raise _engine.EngineError(
            f"transport={name!r} is not viable here: {why} (`rdkeras doctor` explains; use 'auto', 'shm' or 'tcp')"
        )
    return spec


def auto_facts() -> str:
    """What this rank contributes to ``transport="auto"``: the native transports viable here."""
    return ",".join(n for n in ("verbs",) if n in _REGISTRY and not _REGISTRY[n].why_not_viable())


def choose_auto(hosts: Sequence[str], facts: Sequence[str]) -> tuple[str, str]:
    """(transport, reason) for ``transport="auto"`` from every rank's host identity and auto_facts().

    shm when every rank shares one host (a memcpy beats any NIC's loopback), else verbs when
    every rank can use it, else shm+tcp where some host has several ranks (shm within each
    host, tcp between them), else tcp.
    """
    distinct = set(hosts)
    if len(distinct) == 1:
        return "shm", f"all {len(hosts)} rank(s) on one host"
    if all("verbs" in f.split(",") for f in facts):
        return "verbs", f"{len(distinct)} hosts, RDMA on every rank"
    why = _engine.verbs_why_not_viable()
    no_verbs = "verbs not viable on every rank" + (f" (here: {why})" if why else "")
    if len(distinct) < len(hosts) and "shm+tcp" in names():
        return "shm+tcp", f"{len(distinct)} hosts, {len(hosts)} ranks: shm within a host, tcp between; {no_verbs}"
    return "tcp", f"{len(distinct)} hosts; {no_verbs}"


def _native(name: str) -> Callable[[BackendConfig], Backend]:
    def make(config: BackendConfig) -> Backend:
        o = config.options
        return _engine.Engine(
            config.rank,
            config.world_size,
            name,
            config.arena_bytes,
            config.timeout,
            advertise_host=config.advertise_host,
            bind_host=config.bind_host,
            ib_device=o.ib_device,
            ib_port=o.ib_port,
            ib_gid_index=o.ib_gid_index,
            nt_threshold=o.nt_threshold,
            heartbeat_timeout=config.heartbeat_timeout,
            progress_timeout=config.progress_timeout,
        )

    return make


def _compiled(name: str) -> Callable[[], str]:
    def check() -> str:
        return "" if name in _engine.native_transports() else f"this build of rdkeras has no {name} transport"

    return check


def _grpc(config: BackendConfig) -> Backend:
    from rdkeras.transports.grpc import GrpcBackend  # grpcio loads only when asked for

    return GrpcBackend(config)


register(
    BackendSpec(
        "shm",
        "one host: peers map each other's memory",
        _compiled("shm"),
        _native("shm"),
        # a flag seen in ~1 us, a memcpy at ~10 GB/s
        Capabilities("shm", copies_on_own_cores=True, costs=(1e-6, 0.1e-9, 0.2e-9)),
    )
)
register(
    BackendSpec("tcp", "one-sided semantics over TCP sockets", _compiled("tcp"), _native("tcp"), Capabilities("tcp"))
)
register(
    BackendSpec(
        "shm+tcp",
        "several hosts: shm between the ranks of one host, tcp between hosts",
        _compiled("shm+tcp"),
        _native("shm+tcp"),
        Capabilities("shm+tcp"),
    )
)
register(
    BackendSpec(
        "verbs",
        "InfiniBand/RoCE RDMA over RC queue pairs",
        _engine.verbs_why_not_viable,  # says what is missing: the build, the library or a device
        _native("verbs"),
        Capabilities("verbs", costs=(3e-6, 0.1e-9, 0.2e-9)),  # an RDMA write and its flag; ~100 Gbit/s
    )
)
register(
    BackendSpec(
        "grpc",
        "the RPC baseline: TensorProto-style messages over gRPC",
        lambda: "",
        _grpc,
        Capabilities("grpc", composes_rings=False),
    )
)


def _rpc(inner: str) -> Callable[[BackendConfig], Backend]:
    def make(config: BackendConfig) -> Backend:
        from rdkeras.transports.rpc import RpcBackend  # protobuf loads only when asked for

        return RpcBackend(config, inner, _native(inner)(config))  # over the native transport, as configured

    return make


# The RPC baseline over each native transport (the seed's gRPC.RDMA): viable where that transport is.
for _inner in ("shm", "tcp", "verbs"):
    register(
        BackendSpec(
            f"rpc+{_inner}",
            f"the RPC baseline carried over {_inner}: serialized messages, frames, parsing on arrival",
            get(_inner).why_not_viable,
            _rpc(_inner),
            # The frames move as the inner transport's bytes do; the ring is the baseline's own, flat.
            Capabilities(f"rpc+{_inner}", False, get(_inner).capabilities.copies_on_own_cores),
        )
    )

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendSpec",
    "Capabilities",
    "TransportOptions",
    "check_viable",
    "choose_auto",
    "get",
    "names",
    "register",
]
