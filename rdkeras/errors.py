"""The errors rdkeras raises; they are the C++ extension's classes (Python and C++ raise the same ones), and
ReplicasDivergedError, an EngineError of Python's own."""

import re

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


# How TensorFlow quotes a PeerError its op raised: a numpy_function's traceback ends in the exception's line (a
# blank line after it), a native op's Aborted status follows "rdkeras send (NODE): " with the message.
_QUOTED = re.compile(r"^(?:rdkeras\._engine\.)?PeerError: (.*?)\s*(?:\n\s*\n|\n\t|\Z)", re.M | re.S)
_NATIVE = re.compile(r"rdkeras (?:send|recv) \([^)]*\): (.*?)\s*(?:\n|\Z)")
_RANK = re.compile(r"\brank (\d+)\b")


def unwrapped(error: BaseException, failure: tuple | None = None, rank: int | None = None) -> PeerError | None:
    """The PeerError inside `error`, an exception TensorFlow made of it (``UnknownError`` from a numpy_function,
    ``AbortedError`` from rdkeras's native ops), which has lost its class and ``.rank``: a PeerError with the
    message it had and the failed rank -- that of the engine's `failure` record (failed rank, reporter, why) when
    it names a rank other than this one (`rank`), else the first rank the message names. None when `error` is a
    PeerError already or quotes none."""
    if isinstance(error, PeerError):
        return None
    text = str(error)
    quoted = _QUOTED.findall(text)
    if quoted:
        message = quoted[-1]
    elif failure is not None and failure[0] != rank and (native := _NATIVE.search(text)):
        message = native.group(1)
    else:
        return None
    if failure is not None and failure[0] != rank:
        failed: int | None = int(failure[0])
    else:
        failed = int(named.group(1)) if (named := _RANK.search(message)) else None
    return peer_error(failed, message)


__all__ = [
    "AuthenticationError",
    "EngineError",
    "PeerError",
    "RemoteAccessError",
    "ReplicasDivergedError",
    "TimeoutError",
    "peer_error",
    "unwrapped",
]
