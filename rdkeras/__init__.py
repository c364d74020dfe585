"""rdkeras: RDMA-style one-sided transfers for distributed Keras training."""

from rdkeras.engine import TRANSPORTS, Engine
from rdkeras.errors import AuthenticationError, EngineError, PeerError, RemoteAccessError, TimeoutError  # noqa: A004
from rdkeras.launch import launch
from rdkeras.strategy import RDMAStrategy

__version__ = "0.1.0"

__all__ = [
    "TRANSPORTS",
    "AuthenticationError",
    "Engine",
    "EngineError",
    "PeerError",
    "RDMAStrategy",
    "RemoteAccessError",
    "TimeoutError",
    "launch",
]
