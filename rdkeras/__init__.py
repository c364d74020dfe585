"""rdkeras: RDMA-style one-sided transfers for distributed Keras training."""

from rdkeras.engine import TRANSPORTS, Engine
from rdkeras.errors import (
    AuthenticationError,
    EngineError,
    PeerError,
    RemoteAccessError,
    ReplicasDivergedError,
    TimeoutError,  # noqa: A004
)
from rdkeras.parallel.options import DataParallelOptions, ParallelOptions, PipelineOptions
from rdkeras.strategy import DistributedGradientTape, RDMAStrategy

__version__ = "0.1.0"

__all__ = [
    "TRANSPORTS",
    "AuthenticationError",
    "DataParallelOptions",
    "DistributedGradientTape",
    "Engine",
    "EngineError",
    "ParallelOptions",
    "PeerError",
    "PipelineOptions",
    "RDMAStrategy",
    "RemoteAccessError",
    "ReplicasDivergedError",
    "TimeoutError",
    "elastic",
    "introspect",
    "launch",
]


def __getattr__(name: str):
    # Lazily, so that `python -m rdkeras.launch` does not find the module imported already.
    if name == "elastic":  # rdkeras.elastic.State / run, for custom loops
        import importlib

        return importlib.import_module("rdkeras.elastic")
    if name == "introspect":  # rdkeras.introspect.inspect(strategy): the read-only view of a job
        import importlib

        return importlib.import_module("rdkeras.introspect")
    if name == "launch":
        import importlib

        return importlib.import_module("rdkeras.launch")  # a callable module: rdkeras.launch(fn, num_workers=N)
    raise AttributeError(f"module 'rdkeras' has no attribute {name!r}")
