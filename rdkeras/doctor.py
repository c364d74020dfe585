"""``rdkeras doctor``: what this machine can do, and why not where it can't.

Versions, which transports are viable here (and why a transport is not), the
GPUs TensorFlow sees and which one each local rank would use,
RDMA devices/ports/GIDs through pyverbs where rdma-core is installed,
shared-memory and CMA permissions, and what ``transport="auto"`` would pick.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.metadata
import os
import platform
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from rdkeras import options


@dataclass
class Check:
    name: str
    viable: bool
    detail: str


# ibv_port_state and ibv_mtu (infiniband/verbs.h)
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_MTUS = {1: "256", 2: "512", 3: "1024", 4: "2048", 5: "4096"}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_shm() -> Check:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.memfd_create(b"rdkeras-doctor", 1)  # MFD_CLOEXEC
    if fd < 0:
        return Check("shm", False, f"memfd_create failed: {os.strerror(ctypes.get_errno())}")
    os.close(fd)
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read())
    except OSError:
        scope = None
    if scope in (2, 3):
        cma = (
            f"CMA blocked (kernel.yama.ptrace_scope={scope}): memory outside the arena cannot be reached; "
            "arena transfers still work"
        )
    elif scope == 1:
        cma = "CMA allowed between workers (ptrace_scope=1; rdkeras sets PR_SET_PTRACER_ANY)"
    else:
        cma = "CMA allowed (no Yama restriction)"
    return Check("shm", True, f"memfd arenas ok; {cma}; one host only")


def import_pyverbs():
    """pyverbs from this environment, or else Debian's python3-pyverbs when it matches this Python.

    Debian installs it under /usr/lib/python3/dist-packages; a folder holding
    only a link to it makes it importable without the rest of dist-packages.
    """
    try:
        import pyverbs  # type: ignore[import-not-found]

        return pyverbs
    except ImportError:
        pass
    import sys
    import tempfile

    system = "/usr/lib/python3/dist-packages/pyverbs"
    if not os.path.isdir(system):
        raise ImportError("pyverbs is not installed (Debian: apt install python3-pyverbs)")
    shim = tempfile.mkdtemp(prefix="rdkeras-pyverbs-")
    os.symlink(system, os.path.join(shim, "pyverbs"))
    sys.path.append(shim)
    import pyverbs  # type: ignore[import-not-found]

    return pyverbs


def check_verbs() -> tuple[Check, list[str]]:
    """Viability of the verbs transport, and device lines from pyverbs where it is present."""
    lines: list[str] = []
    name = ctypes.util.find_library("ibverbs") or "libibverbs.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return Check(
            "verbs", False, "libibverbs.so.1 not found (install rdma-core: apt install ibverbs-providers libibverbs1)"
        ), lines
    try:
        import_pyverbs()
        from pyverbs.device import Context, get_device_list  # type: ignore[import-not-found]

        for dev in get_device_list():
            dev_name = dev.name.decode()
            with Context(name=dev_name) as ctx:
                attr = ctx.query_device()
                for port in range(1, attr.phys_port_cnt + 1):
                    p = ctx.query_port(port)
                    state = _PORT_STATES.get(p.state, str(p.state))
                    mtu = _MTUS.get(p.active_mtu, str(p.active_mtu))
                    lines.append(f"{dev_name} port {port}: {state}, active MTU {mtu}, {p.gid_tbl_len} GID slots")
                    for index in range(min(p.gid_tbl_len, 4)):
                        try:
                            gid = ctx.query_gid(port, index)
                        except Exception:  # an unpopulated GID slot
                            continue
                        if str(gid) != "0000:0000:0000:0000:0000:0000:0000:0000":
                            lines.append(f"  GID[{index}] {gid}")
    except ImportError as e:
        lines.append(f"pyverbs not importable ({e}): devices counted via libibverbs")
    except Exception as e:  # pyverbs raises PyverbsRDMAError when there is no device
        lines.append(f"pyverbs: {e}")
    lib.ibv_get_device_list.restype = ctypes.c_void_p
    count = ctypes.c_int(0)
    devices = lib.ibv_get_device_list(ctypes.byref(count))
    if devices:
        lib.ibv_free_device_list(ctypes.c_void_p(devices))
    if count.value <= 0:
        return Check(
            "verbs",
            False,
            "no RDMA device (ibv_get_device_list found none; for SoftRoCE: "
            "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <if>)",
        ), lines
    from rdkeras import _engine

    why = _engine.verbs_why_not_viable()
    return Check("verbs", not why, why or f"{count.value} RDMA device(s): RC queue pairs, one-sided WRITE/READ"), lines


@contextlib.contextmanager
def _without_banners() -> Iterator[None]:
    """TensorFlow's C++ start-up lines (printed to fd 2 by each library it loads, whatever the log level) left
    out of the report; any other line it prints still shows."""
    from rdkeras._workers import is_banner

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not is_banner(line)]
            sys.stderr.buffer.write(b"".join(kept))
            sys.stderr.flush()


def gpu_lines(local_world_size: int | None = None) -> list[str]:
    """The GPUs TensorFlow sees, and which one each local rank would use (rdkeras.devices)."""
    from rdkeras import cluster, devices

    options.quiet_tensorflow_logs()
    with _without_banners():
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
    built = tf.sysconfig.get_build_info()
    cuda = f"built with CUDA {built['cuda_version']}" if built.get("is_cuda_build") else "a CPU-only build"
    if not gpus:
        hint = "" if built.get("is_cuda_build") else "; on a GPU node: pip install 'rdkeras[and-cuda]'"
        return [f"none visible to TensorFlow ({cuda}{hint}); workers compute on the CPU"]
    lines = []
    for i, gpu in enumerate(gpus):
        details = tf.config.experimental.get_device_details(gpu)
        lines.append(f"GPU:{i} {details.get('device_name', gpu.name)} (compute {details.get('compute_capability')})")
    place = cluster.resolve()
    workers = local_world_size or (place.local_world_size if place.source != "single" else len(gpus))
    setting = options.from_env().gpu
    for rank in range(workers):
        picked = devices.choose(rank, workers, len(gpus), setting)
        where = ", ".join(f"GPU:{g}" for g in picked) or "CPU"
        lines.append(f"  with {workers} workers on this node, local rank {rank} uses {where} (RDKERAS_GPU={setting})")
    return lines


def run() -> int:
    from rdkeras import _engine

    print(f"rdkeras {_version('rdkeras')}  (native transports in this build: {', '.join(_engine.native_transports())})")
    print(
        f"python {platform.python_version()}, numpy {_version('numpy')}, tensorflow "
        f"{_version('tensorflow-cpu') if _version('tensorflow') == 'not installed' else _version('tensorflow')}, "
        f"keras {_version('keras')}, grpcio {_version('grpcio')}"
    )
    print(f"host {socket.gethostname()}: {os.cpu_count()} cores, Linux {platform.release()}")
    verbs, device_lines = check_verbs()
    checks = [
        check_shm(),
        Check("tcp", True, "sockets; any number of hosts"),
        Check("grpc", _version("grpcio") != "not installed", "the RPC baseline (grpcio)"),
        verbs,
    ]
    print("\ntransports:")
    for c in checks:
        print(f"  {c.name:<6} {'viable' if c.viable else 'not viable'}: {c.detail}")
    if device_lines:
        print("\nRDMA devices:")
        for line in device_lines:
            print(f"  {line}")
    print("\nGPUs:")
    for line in gpu_lines():
        print(f"  {line}")
    print(
        "\ntransport=auto would pick: shm when every worker is on this host, otherwise "
        + ("verbs when every worker can use it, else tcp" if verbs.viable else "tcp")
    )
    return 0
