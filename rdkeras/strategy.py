"""RDMAStrategy: unchanged Keras code, trained on every worker of the job.

strategy = rdkeras.RDMAStrategy()            # cluster from the environment
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss=..., metrics=[...])
model.fit(ds, epochs=...)                    # plain Keras fit
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from rdkeras import cluster as cluster_lib
from rdkeras.engine import Engine
from rdkeras.parallel.data import DataParallel


class RDMAStrategy:
    """Distributes Keras models compiled inside :meth:`scope` over the job's workers.

    Args:
        parallelism: "data" (each worker trains the whole model on its shard), "model"
            (a pipeline: each worker trains the layers `placement` gives it) or "hybrid"
            (world_size / stages replicas of a `stages`-worker pipeline, data-parallel
            among replicas).
        transport: "auto" (default; also ``RDKERAS_TRANSPORT``), "shm", "tcp" or "grpc".
        mode: data-parallel gradient exchange, "allreduce" (default; also ``RDKERAS_DATA_MODE``).
        bucket_bytes: bytes the ring allreduce moves per pass.
        timeout: seconds any wait may take before it fails naming the peer.
        seed: shuffling seed shared by all workers.
        placement: model/hybrid: layer-name glob -> pipeline stage, e.g. ``{"conv*": 0, "fc*": 1}``;
            unplaced layers follow their producer.
        micro_batches: model/hybrid: split each batch into this many micro-batches (GPipe schedule).
        stages: hybrid: workers per pipeline (default: the number of stages `placement` names).
    """

    def __init__(
        self,
        parallelism: str = "data",
        transport: str | None = None,
        mode: str | None = None,
        bucket_bytes: int = 64 << 20,
        timeout: float | None = None,
        seed: int = 1234,
        placement: dict[str, int] | None = None,
        micro_batches: int = 1,
        stages: int | None = None,
    ):
        if parallelism not in ("data", "model", "hybrid"):
            raise ValueError(f"parallelism must be 'data', 'model' or 'hybrid', got {parallelism!r}")
        if parallelism != "data" and not placement:
            raise ValueError(
                f"parallelism={parallelism!r} needs a placement: layer-name patterns -> workers, "
                "e.g. placement={'conv*': 0, 'dense*': 1}"
            )
        if parallelism == "data" and placement:
            raise ValueError("placement is for parallelism='model' or 'hybrid'; data parallelism places nothing")
        if placement is not None:
            placement = dict(placement)  # also accepts an OmegaConf DictConfig
        c = cluster_lib.resolve()
        self.cluster = c
        self.engine = Engine(
            c.rank,
            c.world_size,
            transport=transport,
            master_addr=c.master_addr,
            master_port=c.master_port,
            timeout=timeout,
        )
        self.parallelism = parallelism
        if parallelism == "data":
            mode = mode or os.environ.get("RDKERAS_DATA_MODE") or "allreduce"
            self._parallel: Any = DataParallel(self.engine, mode, bucket_bytes, seed)
        else:
            from rdkeras.parallel.model import ModelParallel

            if parallelism == "hybrid":
                stages = stages or (max(placement.values()) + 1)
            elif stages not in (None, c.world_size):
                raise ValueError(f"parallelism='model' runs one {c.world_size}-stage pipeline; stages={stages}")
            self._parallel = ModelParallel(self.engine, placement, stages, micro_batches, bucket_bytes, seed)

    @property
    def num_workers(self) -> int:
        return self.engine.world_size

    @property
    def worker_index(self) -> int:
        return self.engine.rank

    @property
    def is_chief(self) -> bool:
        return self.engine.rank == 0

    @property
    def transport(self) -> str:
        return self.engine.transport

    @contextlib.contextmanager
    def scope(self) -> Iterator[RDMAStrategy]:
        """Models compiled inside this block train distributed."""
        import keras

        original = keras.Model.compile
        parallel = self._parallel

        def compile(model: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001
            result = original(model, *args, **kwargs)
            parallel.attach(model)
            return result

        keras.Model.compile = compile
        try:
            yield self
        finally:
            keras.Model.compile = original

    def plan_text(self) -> str:
        """Model/hybrid parallelism: the cut edges of the current plan, as a table ('' otherwise)."""
        return self._parallel.plan_text() if hasattr(self._parallel, "plan_text") else ""

    def distribute(self, model: Any) -> Any:
        """Distributes a model compiled outside :meth:`scope`."""
        return self._parallel.attach(model)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> RDMAStrategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
