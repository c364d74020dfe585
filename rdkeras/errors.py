"""The errors rdkeras raises; they are the C++ extension's classes (Python and C++ raise the same ones), and
ReplicasDivergedError, an EngineError of Python's own."""

from rdkeras._engine import (
    AuthenticationError,
    EngineError,
    PeerError,
    RemoteAccessError,
    TimeoutError,  # noqa: A004
)


class ReplicasDivergedError(EngineError):
    """Data-parallel replicas hold different values of a variable that must be the same everywhere."""


def peer_error(rank: int | None, message: str) -> PeerError:
    """A PeerError whose ``.rank`` names the rank that failed (None where unknown)."""
    err = PeerError(message)
    err.rank = rank
    return err


__all__ = [
    "AuthenticationError",
    "EngineError",
    "PeerError",
    "RemoteAccessError",
    "ReplicasDivergedError",
    "TimeoutError",
    "peer_error",
]
