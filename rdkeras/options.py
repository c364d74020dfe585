"""Every ``RDKERAS_*`` setting, read from the environment in one place.

The environment is read here and in :mod:`rdkeras.cluster` (where this process
sits in the job: ``RDKERAS_RANK``/``WORLD_SIZE``/``MASTER_*``, TF_CONFIG,
torchrun's and SLURM's variables) and nowhere else; everything below the Python
face gets its settings passed in (a CI test keeps it so). An explicit argument
(``RDMAStrategy(timeout=...)``, ``Engine(transport=...)``) always wins over the
environment.

================================  =====================================================================
variable                          setting
================================  =====================================================================
``RDKERAS_TRANSPORT``             transport: auto, shm, tcp, shm+tcp, verbs, or a baseline
``RDKERAS_TIMEOUT``               seconds any wait may take before it fails naming the peer
``RDKERAS_HEARTBEAT_TIMEOUT``     seconds a silent (stopped, hung) peer is waited for (0: no heartbeat)
``RDKERAS_FLIGHT_DIR``            a folder where each rank dumps its last collectives on a failure (``rdkeras
                                  postmortem DIR`` reads them)
``RDKERAS_PROGRESS_TIMEOUT``      seconds a collective waits before it names a live member that never entered
                                  it (default max(30, timeout / 6); 0: never)
``RDKERAS_RENDEZVOUS_TIMEOUT``    seconds the ranks wait for each other at start-up
``RDKERAS_ARENA_BYTES``           registered address space each process reserves
``RDKERAS_STORE``                 who hosts the rendezvous store: rank0 or launcher
``RDKERAS_MIN_WORKERS``           an elastic job (its launcher sets it): fewest workers it goes on with
``RDKERAS_JOIN``                  an elastic job's replacement: its worker id (it waits to be taken in)
``RDKERAS_DATA_MODE``             data-parallel exchange: allreduce or ps
``RDKERAS_JOB_TOKEN``             the job's shared secret (:mod:`rdkeras.jobtoken`)
``RDKERAS_JOB_TOKEN_FILE``        a file holding it
``RDKERAS_LOG``                   rdkeras's messages on stderr from this level (info, ...)
``RDKERAS_GPU``                   which GPUs a worker uses: auto, all, none, or indices
``RDKERAS_GPU_MEMORY_GROWTH``     1 (default) or 0: allocate GPU memory as needed
``RDKERAS_IB_DEVICE``             verbs: device name ("": the first with an active port)
``RDKERAS_IB_PORT``               verbs: port (0: the first active one)
``RDKERAS_IB_GID_INDEX``          verbs: GID table index
``RDKERAS_NT_THRESHOLD``          bytes from which copies stream their stores (0: never)
``RDKERAS_CACHE``                 where data sets fetched once and the built TensorFlow ops are kept
``RDKERAS_NATIVE_OPS``            1 (default) or 0: the pipeline's transfers as numpy_function hops
``RDKERAS_REPORT_DIR``            where a worker reports what ended it (its launcher sets it)
================================  =====================================================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rdkeras.transports.base import TransportOptions

DEFAULT_TIMEOUT = 300.0
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
DEFAULT_RENDEZVOUS_TIMEOUT = 120.0
DEFAULT_ARENA_BYTES = 16 << 30  # address space only; pages cost memory once touched


@dataclass(frozen=True)
class Options:
    """The ``RDKERAS_*`` settings of this process (the module docstring lists them)."""

    transport: str = "auto"
    timeout: float = DEFAULT_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    progress_timeout: float | None = None  # None: max(30 s, timeout / 6), the engine's default
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
    arena_bytes: int = DEFAULT_ARENA_BYTES
    store: str = "rank0"
    min_workers: int = 0  # > 0: an elastic job (rdkeras.elastic)
    join: int | None = None  # an elastic job's replacement: its worker id
    data_mode: str = "allreduce"
    job_token: str | None = None
    job_token_file: str | None = None
    log: str | None = None
    gpu: str = "auto"
    gpu_memory_growth: bool = True
    transport_options: TransportOptions = field(default_factory=TransportOptions)
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "rdkeras")
    report_dir: Path | None = None
    flight_dir: Path | None = None  # where a failing rank dumps its flight record (rdkeras.flight)
    config_dir: Path = field(default_factory=lambda: Path.home() / ".config")  # $XDG_CONFIG_HOME
    native_ops: bool = True  # rdkeras.tf_ops's kernels, where they can be built
    compiler: str | None = None  # $CXX: what builds them


def from_env(env: Mapping[str, str] | None = None) -> Options:
    """The settings in `env` (default: this process's environment); a malformed value raises
    ValueError naming the variable and what it takes."""
    env = os.environ if env is None else env

    def text(name: str) -> str | None:
        value = env.get(name, "").strip()
        return value or None

    def whole(name: str, default: int) -> int:
        value = text(name)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a whole number") from None
        if number < 0:
            raise ValueError(f"{name}={number} must not be negative")
        return number

    def choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
        value = text(name) or default
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: choose {' or '.join(allowed)}")
        return value

    defaults = Options()
    timeout, heartbeat = text("RDKERAS_TIMEOUT"), text("RDKERAS_HEARTBEAT_TIMEOUT")
    rendezvous, progress = text("RDKERAS_RENDEZVOUS_TIMEOUT"), text("RDKERAS_PROGRESS_TIMEOUT")
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return Options(
        transport=text("RDKERAS_TRANSPORT") or defaults.transport,
        timeout=defaults.timeout if timeout is None else check_timeout(timeout, "RDKERAS_TIMEOUT"),
        rendezvous_timeout=(
            defaults.rendezvous_timeout
            if rendezvous is None
            else check_timeout(rendezvous, "RDKERAS_RENDEZVOUS_TIMEOUT")
        ),
        heartbeat_timeout=(
            defaults.heartbeat_timeout if heartbeat is None else check_heartbeat(heartbeat, "RDKERAS_HEARTBEAT_TIMEOUT")
        ),
        progress_timeout=None if progress is None else check_progress(progress, "RDKERAS_PROGRESS_TIMEOUT"),
        arena_bytes=whole("RDKERAS_ARENA_BYTES", defaults.arena_bytes),
        store=choice("RDKERAS_STORE", defaults.store, ("rank0", "launcher")),
        min_workers=whole("RDKERAS_MIN_WORKERS", defaults.min_workers),
        join=None if text("RDKERAS_JOIN") is None else whole("RDKERAS_JOIN", 0),
        data_mode=choice("RDKERAS_DATA_MODE", defaults.data_mode, ("allreduce", "ps")),
        job_token=env.get("RDKERAS_JOB_TOKEN") or None,
        job_token_file=text("RDKERAS_JOB_TOKEN_FILE"),
        log=text("RDKERAS_LOG"),
        gpu=text("RDKERAS_GPU") or defaults.gpu,
        gpu_memory_growth=(text("RDKERAS_GPU_MEMORY_GROWTH") or "1").lower() not in ("0", "false", "no"),
        transport_options=TransportOptions(
            ib_device=text("RDKERAS_IB_DEVICE") or "",
            ib_port=whole("RDKERAS_IB_PORT", 0),
            ib_gid_index=whole("RDKERAS_IB_GID_INDEX", 0),
            nt_threshold=whole("RDKERAS_NT_THRESHOLD", TransportOptions.nt_threshold),
        ),
        cache_dir=Path(text("RDKERAS_CACHE") or home / ".cache" / "rdkeras"),
        report_dir=Path(folder) if (folder := text("RDKERAS_REPORT_DIR")) else None,
        flight_dir=Path(folder) if (folder := text("RDKERAS_FLIGHT_DIR")) else None,
        config_dir=Path(text("XDG_CONFIG_HOME") or home / ".config"),
        native_ops=(text("RDKERAS_NATIVE_OPS") or "1").lower() not in ("0", "false", "no"),
        compiler=text("CXX"),
    )


def _seconds(value: float | str, what: str) -> float:
    """`value` as a float; ValueError naming `what` where it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not a number of seconds") from None


def check_timeout(value: float | str, what: str = "timeout") -> float:
    """`value` as seconds > 0 (a finite number); ValueError naming `what` otherwise."""
    seconds = _seconds(value, what)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what}={value!r}: a wait needs a finite number of seconds > 0")
    return seconds


def check_heartbeat(value: float | str, what: str = "heartbeat_timeout") -> float:
    """`value` as seconds a peer may stay silent: finite and > 0, or 0 for no heartbeat."""
    seconds = _seconds(value, what)
    if seconds == 0:
        return 0.0
    if not math.isfinite(seconds) or seconds < 1:
        raise ValueError(f"{what}={value!r}: a heartbeat timeout is at least 1 s (or 0: no heartbeat)")
    return seconds


def check_progress(value: float | str, what: str = "progress_timeout") -> float:
    """`value` as seconds a collective waits before it looks for a hung member: finite and > 0, or 0 for never."""
    seconds = _seconds(value, what)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what}={value!r}: a progress timeout is a finite number of seconds > 0 (or 0: never)")
    return seconds


def log_level(env: Mapping[str, str] | None = None) -> str | None:
    """``RDKERAS_LOG`` alone (read at import, where another variable's error must not surface)."""
    env = os.environ if env is None else env
    return env.get("RDKERAS_LOG", "").strip() or None


def quiet_tensorflow_logs(level: int = 2) -> None:
    """Hides TensorFlow's C++ start-up lines below `level` (2: INFO and WARNING; 3: errors too), unless the
    user chose a level; processes started from this one inherit it."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", str(level))


def keras_backend(env: Mapping[str, str] | None = None) -> str:
    """The backend Keras will load, without importing it: ``KERAS_BACKEND``, else the ``backend`` of
    ``$KERAS_HOME/keras.json`` (``~/.keras``), else tensorflow (Keras's default)."""
    import json

    env = os.environ if env is None else env
    chosen = env.get("KERAS_BACKEND", "").strip()
    if chosen:
        return chosen
    home = Path(env.get("KERAS_HOME") or Path.home() / ".keras")
    try:
        return str(json.loads((home / "keras.json").read_text()).get("backend") or "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"
