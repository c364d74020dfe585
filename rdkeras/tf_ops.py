"""rdkeras's native TensorFlow ops (``RdkerasSend`` / ``RdkerasRecv``), built on first use.

The ops library must be compiled against the TensorFlow the process imports (its headers and C++ ABI,
``tf.sysconfig``), which a wheel of rdkeras cannot know in advance: as PyTorch's and DeepSpeed's JIT
extensions do, the first process that needs it compiles ``csrc/tfops/rdma_ops.cc`` (a few seconds) into a
cache keyed by the source, TensorFlow's version and the flags -- ``ops/`` in ``$RDKERAS_CACHE``, else in
``~/.cache/rdkeras`` -- under a file lock, so the workers of a job build it once. The library reaches the
engine only through the C table of ``op_api.h``, whose address each op carries.

Where it cannot be built (no C++ compiler, ``RDKERAS_NATIVE_OPS=0``), :func:`load` returns None, says why
once, and rdkeras's ops stay ``tf.numpy_function`` hops (:mod:`rdkeras.ops`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rdkeras import options
from rdkeras._log import logger

SOURCES = ("rdma_ops.cc", "op_api.h")


def source_dir() -> Path:
    """The ops' sources: inside the package in a wheel (``rdkeras/tfops``), ``csrc/tfops`` in a checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "tfops", package.parent / "csrc" / "tfops"):
        if all((candidate / name).is_file() for name in SOURCES):
            return candidate
    raise FileNotFoundError(f"rdkeras's TensorFlow op sources ({', '.join(SOURCES)}) are not in {package}")


def cache_dir() -> Path:
    return options.from_env().cache_dir / "ops"


def _compiler() -> str:
    for name in (options.from_env().compiler, "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler (set CXX, or install g++)")


def _command(compiler: str, source: Path, out: Path) -> list[str]:
    import tensorflow as tf

    return [
        compiler, "-O2", "-shared", "-fPIC", "-w", *tf.sysconfig.get_compile_flags(), f"-I{source.parent}",
        str(source), "-o", str(out), *tf.sysconfig.get_link_flags(),
    ]  # fmt: skip


def build() -> Path:
    """The compiled library for this TensorFlow: built now unless the cache has it."""
    import tensorflow as tf

    sources = source_dir()
    compiler = _compiler()
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((sources / name).read_bytes())
    digest.update(" ".join([tf.__version__, *_command(compiler, Path("x"), Path("y"))]).encode())
    target = cache_dir() / f"rdma_ops-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine; the others wait for it
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run(
                _command(compiler, sources / "rdma_ops.cc", out), capture_output=True, text=True, timeout=600
            )
            if done.returncode != 0:
                raise RuntimeError(f"compiling {sources / 'rdma_ops.cc'} failed:\n{done.stderr[-3000:]}")
            os.replace(out, target)  # atomic: a reader never sees half a library
    return target


@functools.cache
def load() -> Any:
    """The loaded ops module (``.rdkeras_send``, ``.rdkeras_recv``), or None where it cannot be had."""
    if not options.from_env().native_ops:
        return None
    try:
        import tensorflow as tf

        return tf.load_op_library(str(build()))
    except Exception as e:  # the numpy_function hops still work: slower, never wrong
        logger.warning(f"rdkeras's native TensorFlow ops are unavailable, using numpy_function hops: {e}")
        return None


def api_address() -> int:
    """The address of the engine's C table the ops call (``rdkeras._engine.op_api()``)."""
    from rdkeras import _engine

    return int(_engine.op_api())
