"""RDMAStrategy: unchanged Keras code, trained on every worker of the job.

strategy = rdkeras.RDMAStrategy()            # cluster from the environment
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss=..., metrics=[...])
model.fit(ds, epochs=..., batch_size=256)    # plain Keras fit; 256 is the global batch

The names a tf.distribute user reaches for exist too: ``num_replicas_in_sync``,
``cluster_resolver``, ``experimental_distribute_dataset``,
``distribute_datasets_from_function``, ``run``, ``reduce``, and for custom
training loops :meth:`RDMAStrategy.allreduce`, :meth:`broadcast_variables` and
:class:`DistributedGradientTape`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from rdkeras import cluster as cluster_lib
from rdkeras import fitting, keras_internals
from rdkeras import options as env_options
from rdkeras.custom_loops import CustomLoops, DistributedGradientTape  # noqa: F401 (rdkeras exports the tape)
from rdkeras.engine import Engine
from rdkeras.model_state import ModelState
from rdkeras.parallel import canonical
from rdkeras.parallel.base import Parallelism
from rdkeras.parallel.options import DataParallelOptions, ParallelOptions, PipelineOptions, from_flat

# RDMAStrategy's keywords that are a parallelism's options, with their defaults: a thin layer over
# rdkeras.parallel.options, whose classes check them (once).
_PARALLEL_KEYWORDS = {
    "parallelism": "data",
    "bucket_bytes": 64 << 20,
    "global_batch": True,
    **{f.name: f.default for f in dataclasses.fields(DataParallelOptions)},
    "mode": None,
    **{f.name: f.default for f in dataclasses.fields(PipelineOptions)},
}


class RDMAStrategy(CustomLoops, ModelState):
    """Distributes Keras models compiled inside :meth:`scope` over the job's workers.

    Args:
        parallelism: "data" (each worker trains the whole model on its part of every batch), "pipeline"
            (also "model": each worker trains the layers `placement` gives it, a stage of a pipeline) or
            "hybrid" (world_size / stages replicas of a `stages`-worker pipeline, data-parallel among replicas).
        transport: "auto" (default; also ``RDKERAS_TRANSPORT``), "shm", "tcp", "shm+tcp", "verbs", or a
            baseline ("grpc", "rpc+shm", "rpc+tcp", "rpc+verbs"); see :class:`rdkeras.Engine`.
        mode: data-parallel gradient exchange, "allreduce" (default; also ``RDKERAS_DATA_MODE``) or "ps".
        bucket_bytes: bytes the ring allreduce moves per pass.
        timeout: seconds any wait may take before it fails naming the peer (also ``RDKERAS_TIMEOUT``).
        heartbeat_timeout: seconds a worker may stay silent (stopped, hung, swapped out) before every other
            worker fails naming it (default 30; also ``RDKERAS_HEARTBEAT_TIMEOUT``; 0: no heartbeat).
        rendezvous_timeout: seconds the workers wait for each other at start-up; the error names the ones
            that never arrived (default 120; also ``RDKERAS_RENDEZVOUS_TIMEOUT``).
        placement: model/hybrid: layer-name glob -> pipeline stage, e.g. ``{"conv*": 0, "fc*": 1}``;
            unplaced layers follow their producer. None or "auto": the layers are cut into `stages`
            contiguous stages balanced by each layer's forward+backward time, measured on a dry run when
            the model is attached (the cut, the stages' costs and the expected speed-up are in :attr:`plan`).
        micro_batches: pipeline/hybrid: split each batch into this many micro-batches.
        schedule: pipeline/hybrid: "1f1b" (default; one forward, one backward, as PipeDream-Flush and
            Megatron: a stage keeps at most as many micro-batches' activations as there are stages) or
            "gpipe" (every forward, then every backward: all micro-batches' activations kept). The same
            gradients either way.
        defer_weight_gradients: pipeline/hybrid with micro-batches: compute the weight gradients of plain
            Dense and Conv1D/2D/3D layers (linear, ReLU, sigmoid, tanh) once a step over every micro-batch's
            rows, after the last backward pass, rather than once per micro-batch (default True): the same sum,
            at a fraction of the cost on a CPU, in the time the pipeline drains. Their inputs and output
            gradients are kept until then (the plan says how many bytes).
        alternate_layers: pipeline/hybrid, automatic cut, an even number of micro-batches: the layer at a cut
            may alternate between the two stages by micro-batch (odd ones on the later stage) where the stages,
            timed whole, measure 5% faster so (default False: the measured step gain is inconsistent).
        split_layers: pipeline/hybrid, automatic cut: a convolution or Dense layer at a cut may be split
            between the two stages by the rows of each micro-batch (the later stage runs it for the last k of
            every micro-batch's rows) where the stages, timed whole, measure 5% faster so (default False).
            Not with `alternate_layers`.
        stages: model/hybrid: workers per pipeline (default: the number of stages `placement` names; for
            model parallelism, all workers). Hybrid without a placement needs it.
        global_batch: ``batch_size`` (and a dataset's batches) are the global batch, split over the
            data-parallel replicas, as in tf.distribute and keras.distribution (default). False:
            Horovod's convention, ``batch_size`` per replica.
        overlap_bytes: data parallelism: gradient bucket size with which the exchange overlaps backprop
            (0: one exchange after the backward pass; None: the transport's default -- off where this
            process's own cores move the bytes, 4 MiB elsewhere). Also settable later, for models
            attached afterwards.
        cluster: where this process sits in the job (default: :func:`rdkeras.cluster.resolve`, from the
            environment), as tf.distribute's strategies take a ``cluster_resolver``.
        algorithm: data parallelism: the allreduce, "auto" (default: hierarchical where several hosts run the
            same number of workers each -- sum inside each host, shards across hosts, share inside each host --
            else one ring; small tensors by recursive doubling), "ring", "hierarchical" or "doubling".
        compression: data parallelism: None (default), "fp16" or "bf16": float32 gradients cross host
            boundaries as that 16-bit type, summed in float32 at every hop (Horovod's ``Compression.fp16``);
            weights and everything else travel exact.
        compress_within_hosts: compress inside a host too (default False).
        sparse_as_dense: data parallelism: exchange sparse gradients (an Embedding's IndexedSlices) as dense
            tensors by allreduce, as Horovod's switch does (default False: their rows and indices are gathered from
            every worker, and the optimizer applies the IndexedSlices one process computes).
        shard: data parallelism: what each worker keeps only 1/N of -- "none" (default), "optimizer" (the
            optimizer state, ZeRO stage 1), "gradients" (the averaged gradients too, stage 2) or "parameters" (each
            layer's weights too, gathered for each call: stage 3); the same steps as one process
            (:mod:`rdkeras.parallel.sharded_optimizer`, :mod:`rdkeras.parallel.sharded_parameters`).
    """

    def __init__(
        self,
        parallelism: str = "data",
        transport: str | None = None,
        mode: str | None = None,
        bucket_bytes: int = 64 << 20,
        timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        rendezvous_timeout: float | None = None,
        placement: dict[str, int] | str | None = None,
        micro_batches: int = 1,
        schedule: str = "1f1b",
        defer_weight_gradients: bool = True,
        alternate_layers: bool = False,
        split_layers: bool = False,
        stages: int | None = None,
        global_batch: bool = True,
        overlap_bytes: int | None = None,
        cluster: cluster_lib.Cluster | None = None,
        algorithm: str = "auto",
        compression: str | None = None,
        compress_within_hosts: bool = False,
        sparse_as_dense: bool = False,
        shard: str = "none",
        options: ParallelOptions | None = None,
    ):
        settings = env_options.from_env()
        given = {k: v for k, v in locals().items() if k in _PARALLEL_KEYWORDS and v != _PARALLEL_KEYWORDS[k]}
        if options is None:
            options = from_flat(**{**given, "mode": given.get("mode") or settings.data_mode})  # checked, once
        elif set(given) - {"parallelism"} or canonical(parallelism) not in ("data", canonical(options.parallelism)):
            raise ValueError(
                f"give the parallelism's settings either as options=ParallelOptions(...) or as keywords, not both "
                f"(also given: {', '.join(sorted(given))})"
            )
        keras_internals.check()
        c = cluster_lib.resolve() if cluster is None else cluster
        cluster_lib.export_local_rank(c)
        self.cluster = c
        options = options.resolved()
        options.check_workers(c.world_size)
        self.options = options
        parallelism = options.parallelism
        membership = None
        if settings.min_workers and c.world_size > 1:
            if parallelism != "data":
                raise ValueError(
                    f"parallelism={parallelism!r} in an elastic job (launched with --min-workers): a lost stage "
                    "cannot be replaced from the others yet; use parallelism='data', or launch without --min-workers"
                )
            if settings.store != "launcher":
                raise ValueError("an elastic job needs its launcher to host the store (RDKERAS_STORE=launcher)")
            from rdkeras.elastic import ElasticGroup
            from rdkeras.elastic.membership import Membership

            group = ElasticGroup(c.rank, settings.min_workers)
            if settings.join is not None:  # a replacement: alone until the group takes it in (at fit)
                group.joining, group.chief = (c.master_addr, c.master_port, c.world_size), None
                c = dataclasses.replace(c, rank=0, world_size=1, master_port=0)
                settings = dataclasses.replace(settings, store="rank0")
            membership = Membership(group)
        engine = Engine(
            c.rank,
            c.world_size,
            transport=transport,
            master_addr=c.master_addr,
            master_port=c.master_port,
            timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
            rendezvous_timeout=rendezvous_timeout,
            settings=settings,
        )
        self.parallelism = parallelism
        data, pipeline = options.data, options.pipeline
        try:
            if parallelism == "data":
                from rdkeras.parallel.data_parallel import DataParallel

                assert data is not None  # (ParallelOptions gives data parallelism its default options)
                self._parallel: Parallelism = DataParallel(
                    engine,
                    data.mode,
                    options.bucket_bytes,
                    options.global_batch,
                    algorithm=data.algorithm,
                    compression=data.compression,
                    compress_within_hosts=data.compress_within_hosts,
                    membership=membership,
                    sparse_as_dense=data.sparse_as_dense,
                    shard=data.shard,
                )
                self.overlap_bytes = data.overlap_bytes
            else:
                from rdkeras.parallel.model_parallel import ModelParallel

                assert pipeline is not None  # (as data above)
                self._parallel = ModelParallel(
                    engine,
                    pipeline,  # no placement: ModelParallel measures the layers and cuts them when the model arrives
                    pipeline.stages if parallelism == "model" else options.stages,
                    options.bucket_bytes,
                    options.global_batch,
                )
        except BaseException:
            engine.close()
            raise
        self._closed = False
        keras_internals.route_trainer_methods(self._route)
        keras_internals.hold_remat()  # keras.RematScope's layers in traced steps (released at close)

    # -- where this process sits ------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine of the group this worker is in (an elastic job's changes when a worker is lost)."""
        return self._parallel.engine

    @property
    def membership_changes(self) -> list[dict[str, Any]]:
        """An elastic job's membership changes so far, oldest first: ``step`` (optimizer steps applied when the
        group re-formed), ``workers`` (after it), ``lost`` and ``joined`` (worker ids: first ranks), ``seconds``
        (this worker's time to re-form), ``generation``. Empty outside an elastic job."""
        membership = self._parallel.membership
        return list(membership.changes) if membership is not None else []

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

    @property
    def num_replicas_in_sync(self) -> int:
        """Data-parallel replicas each global batch is split over (workers; pipelines for model/hybrid)."""
        return self._parallel.replicas

    @property
    def cluster_resolver(self) -> Any:
        """TensorFlow's ClusterResolver for this job (task_type, task_id, cluster_spec, num_accelerators)."""
        return self.cluster.cluster_resolver()

    @property
    def overlap_bytes(self) -> int | None:
        """Data parallelism: the gradient bucket size with which the exchange overlaps backprop, for
        models attached from now on (0: off; None: the transport's default)."""
        return self._data_parallel("overlap_bytes").overlap_bytes if self.parallelism == "data" else None

    @overlap_bytes.setter
    def overlap_bytes(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"overlap_bytes must be None or a whole number >= 0, got {value!r}")
        self._data_parallel("overlap_bytes").overlap_bytes = value

    @property
    def collectives(self) -> Any:
        """Data parallelism: the :class:`~rdkeras.parallel.collectives.Collectives` of this strategy's
        workers (allreduce, broadcast and row gathering of numpy arrays; collective calls)."""
        return self._collectives()

    # -- models -------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[RDMAStrategy]:
        """Models compiled inside this block train distributed (also models loaded with
        ``keras.models.load_model``, which compiles them)."""
        self._check_open()
        import tensorflow as tf

        created: list[Any] = []
        metrics: list[Any] = []

        def record(next_creator: Any, **kwargs: Any) -> Any:
            variable = next_creator(**kwargs)
            created.append(variable)
            metric = keras_internals.metric_creating_variable()
            if metric is not None and all(metric is not m for m in metrics):
                metrics.append(metric)
            return variable

        with keras_internals.on_compile(self._parallel.attach), tf.variable_creator_scope(record):
            yield self
        self._share_created(created)
        if self.parallelism == "data" and self.num_workers > 1:  # a custom loop's metrics report every replica's rows
            owned = {id(m) for model in self._parallel.models for m in model.metrics}  # (fit merges those itself)
            fitting.merge_results([m for m in metrics if id(m) not in owned], self._collectives())

    def _share_created(self, created: list[Any]) -> None:
        """Variables created in the scope start from the chief's values, as tf.distribute's do (a custom loop's
        model and optimizer); those of models compiled there are left to ``fit``, which shares them anyway."""
        if self.parallelism != "data" or self.num_workers == 1:
            return
        from rdkeras.parallel.collectives import share_new_variables

        fitted = {id(w.value) for m in self._parallel.models for w in keras_internals.state_variables(m)}
        share_new_variables(self._collectives(), [v for v in created if id(v) not in fitted], "in strategy.scope()")

    def distribute(self, model: Any) -> Any:
        """Distributes a model compiled outside :meth:`scope`."""
        self._check_open()
        return self._parallel.attach(model)

    @property
    def plan(self) -> Any:
        """What crosses the wire each step: the data-parallel gradient exchange (an ``ExchangePlan``) or
        the model-parallel cut edges (a ``Plan``); None before a model is attached (or trained, for model
        parallelism). ``plan.text()`` prints it."""
        return self._parallel.plan

    def plan_text(self) -> str:
        """The current plan as text ('' when there is none yet)."""
        return self._parallel.plan_text()

    def _route(self, model: Any, name: str) -> Callable[..., Any] | None:
        """Keras's own fit/evaluate/predict of a model: rdkeras's policy for a model distributed here; for an
        undistributed model's fit in a multi-worker job, an error (each worker would train its own copy)."""
        parallel = fitting.parallel_of(model)
        if parallel is self._parallel:
            return fitting.route(model, name)
        if parallel is None and name == "fit" and self.num_workers > 1:
            return lambda *args, **kwargs: self._undistributed_fit(model)
        return None

    def _undistributed_fit(self, model: Any) -> None:
        raise RuntimeError(
            f"model.fit on {model.name!r}, which was compiled outside strategy.scope(), while this "
            f"RDMAStrategy spans {self.num_workers} workers: each worker would train its own copy. Build and "
            "compile the model inside `with strategy.scope():` (load_model there too), or call "
            "strategy.distribute(model) after compiling it"
        )

    def check_replicas(self, model: Any = None) -> None:
        """Checks that every data-parallel replica holds the same state (eager; collective): the model's
        non-trainable float state (BatchNormalization's statistics) is averaged where it differs; any other
        variable that differs raises ``ReplicasDivergedError`` on every worker, naming it. ``fit`` runs this
        at every epoch end. `model`: default, every model trained under this strategy."""
        parallel = self._data_parallel("check_replicas")
        for m in [model] if model is not None else parallel.models:
            parallel.check_replicas(m, when="at strategy.check_replicas()")

    def _collectives(self) -> Any:
        return self._data_parallel("allreduce/broadcast for custom loops").collectives

    def _data_parallel(self, what: str) -> Any:
        """The DataParallel this strategy runs; raises naming `what` needs it."""
        from rdkeras.parallel.data_parallel import DataParallel

        if not isinstance(self._parallel, DataParallel):
            raise ValueError(f"{what} needs parallelism='data'")
        return self._parallel

    # -- lifetime ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RDMAStrategy is closed: create a new one")

    def close(self) -> None:
        """Returns every distributed model to plain Keras and leaves the job."""
        if self._closed:
            return
        self._closed = True
        keras_internals.unroute_trainer_methods(self._route)
        keras_internals.release_remat()
        self._parallel.detach_all()
        self.engine.close()

    def __enter__(self) -> RDMAStrategy:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None and not self._closed and isinstance(error, Exception):
            self.engine.stop_on_error(error)  # leaving the block on an error: the others must not wait for this rank
        self.close()
