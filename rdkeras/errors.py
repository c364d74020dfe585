"""The errors rdkeras raises; they are the C++ extension's classes (Python and C++ raise the same ones)."""

from rdkeras._engine import (
    AuthenticationError,
    EngineError,
    PeerError,
    RemoteAccessError,
    TimeoutError,  # noqa: A004
)

__all__ = ["AuthenticationError", "EngineError", "PeerError", "RemoteAccessError", "TimeoutError"]
