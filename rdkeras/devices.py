"""Which device a worker computes on: one GPU per worker, chosen by its local rank.

Every launch path gives a worker its local rank (the launcher and torchrun as
``LOCAL_RANK``, SLURM as ``SLURM_LOCALID``, TF_CONFIG by the tasks on its host;
``RDMAStrategy()`` exports ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` where they are
missing); :func:`use_local_gpu` makes only that worker's GPU visible to TensorFlow,
with memory growth, before TensorFlow initializes its devices. ``rdkeras.train``
calls it in each worker; in your own script call it before building a model
(``RDMAStrategy`` will, once it does).

Settings (:mod:`rdkeras.options`):

- ``RDKERAS_GPU``: ``auto`` (default): with G visible GPUs, local rank L uses
  GPU ``L % G`` (several workers share a GPU when there are more workers than
  GPUs); ``all``: leave every GPU visible (TensorFlow's default); ``none``: CPU
  only; ``2`` or ``0,1``: exactly those GPU indices.
- ``RDKERAS_GPU_MEMORY_GROWTH``: ``1`` (default): allocate GPU memory as needed,
  so workers sharing a GPU fit; ``0``: TensorFlow's default (take most of it).

A GPU already fenced off by the scheduler (``CUDA_VISIBLE_DEVICES`` from SLURM's
``--gpus-per-task`` or a Kubernetes device plugin) shows as the only one, and
``auto`` picks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rdkeras import options
from rdkeras.errors import EngineError


@dataclass(frozen=True)
class DeviceChoice:
    gpus: tuple[int, ...]  # indices into the GPUs TensorFlow lists; () for the CPU
    names: tuple[str, ...]  # their TensorFlow names, e.g. "/physical_device:GPU:1"
    visible: int  # GPUs TensorFlow listed before the choice
    memory_growth: bool
    note: str = ""  # why the choice could not be applied, if it could not

    def describe(self) -> str:
        if not self.gpus:
            what = "CPU" + (f" (RDKERAS_GPU=none; {self.visible} GPU(s) hidden)" if self.visible else "")
        else:
            what = ", ".join(f"GPU:{i}" for i in self.gpus) + f" of {self.visible}"
            what += ", memory growth" if self.memory_growth else ""
        return what + (f"; {self.note}" if self.note else "")


def choose(local_rank: int, local_world_size: int, num_gpus: int, setting: str = "auto") -> tuple[int, ...]:
    """The GPU indices a worker uses (pure: no TensorFlow), per ``RDKERAS_GPU`` = `setting`."""
    setting = (setting or "auto").strip().lower()
    if num_gpus == 0 or setting == "none":
        return ()
    if setting == "all":
        return tuple(range(num_gpus))
    if setting == "auto":
        if not 0 <= local_rank < max(local_world_size, 1):
            raise EngineError(f"local rank {local_rank} is not in a node of {local_world_size} workers")
        return (local_rank % num_gpus,)
    try:
        picked = tuple(int(p) for p in setting.split(","))
    except ValueError:
        raise EngineError(f"RDKERAS_GPU must be auto, all, none or GPU indices like 0,1; got {setting!r}") from None
    bad = [i for i in picked if not 0 <= i < num_gpus]
    if bad:
        raise EngineError(f"RDKERAS_GPU={setting}: no GPU {bad[0]} here ({num_gpus} visible: 0..{num_gpus - 1})")
    return picked


def use_local_gpu(
    local_rank: int | None = None,
    local_world_size: int | None = None,
    *,
    settings: options.Options | None = None,
    tf_config: Any = None,
) -> DeviceChoice:
    """Makes this worker's GPU(s) the only ones TensorFlow uses; returns what was chosen.

    Args:
        local_rank: This worker's index on its node (default: :func:`rdkeras.cluster.resolve`'s).
        local_world_size: Workers on its node (default: the cluster's).
        settings: The ``RDKERAS_*`` settings (default: read from the environment).
        tf_config: ``tf.config`` (a fake one in tests).
    """
    settings = options.from_env() if settings is None else settings
    if local_rank is None or local_world_size is None:
        from rdkeras import cluster

        place = cluster.resolve()
        local_rank = place.local_rank if local_rank is None else local_rank
        local_world_size = place.local_world_size if local_world_size is None else local_world_size
    if tf_config is None:
        import tensorflow as tf

        tf_config = tf.config
    gpus = list(tf_config.list_physical_devices("GPU"))
    growth, setting = settings.gpu_memory_growth, settings.gpu
    picked = choose(local_rank, local_world_size, len(gpus), setting)
    names = tuple(gpus[i].name for i in picked)
    if not gpus or (setting.strip().lower() == "all" and not growth):
        return DeviceChoice(picked, names, len(gpus), growth and bool(picked))
    try:
        if setting.strip().lower() != "all":
            tf_config.set_visible_devices([gpus[i] for i in picked], "GPU")
        if growth:
            for i in picked:
                tf_config.experimental.set_memory_growth(gpus[i], True)
    except RuntimeError as e:  # TensorFlow initialized its devices already
        note = f"not applied: TensorFlow had initialized its devices ({e}); choose before building a model"
        return DeviceChoice(picked, names, len(gpus), growth, note)
    return DeviceChoice(picked, names, len(gpus), growth and bool(picked))
