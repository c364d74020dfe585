"""The errors rdkeras raises. The engine's classes come from the C++ extension."""

from rdkeras._engine import EngineError, PeerError, RemoteAccessError, TimeoutError  # noqa: A004


class AuthenticationError(EngineError):
    """A peer could not prove it belongs to this job (wrong job token)."""


__all__ = ["AuthenticationError", "EngineError", "PeerError", "RemoteAccessError", "TimeoutError"]
