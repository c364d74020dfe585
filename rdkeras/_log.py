"""The package logger. A library adds no output of its own: the logger has a NullHandler, and
applications turn it on -- rdkeras's entry points (the launcher's workers, ``python -m
rdkeras.train``, the benchmarks, ``rdkeras doctor``) with :func:`to_stderr`, anyone else with
``RDKERAS_LOG=info`` (or ``warning``, ``debug``) or their own ``logging`` configuration."""

from __future__ import annotations

import logging

from rdkeras import options

logger = logging.getLogger("rdkeras")
logger.addHandler(logging.NullHandler())
_stderr: logging.Handler | None = None


def to_stderr(level: str | int = "INFO") -> None:
    """Prints rdkeras's messages as ``rdkeras: message`` on stderr from `level` up (once)."""
    global _stderr
    if _stderr is None:
        _stderr = logging.StreamHandler()
        _stderr.setFormatter(logging.Formatter("rdkeras: %(message)s"))
        logger.addHandler(_stderr)
        logger.propagate = False
    logger.setLevel(level.upper() if isinstance(level, str) else level)


if level := options.log_level():
    to_stderr(level)
