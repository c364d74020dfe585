"""An elastic job's membership: the one collaborator a parallelism consults about who is in the group.

A :class:`~rdkeras.parallel.base.Parallelism` carries one (``parallel.membership``; None outside an elastic
job). It owns this worker's :class:`~rdkeras.elastic.group.ElasticGroup` -- the talk with the launcher's agent
-- and answers what :mod:`rdkeras.fitting` and the custom-loop API (:mod:`rdkeras.elastic.loop`) ask: whether
an error is the loss of a worker, what to do after it (:meth:`Membership.recover`), after a step, at an epoch
end (:meth:`Membership.admit`). A change yields the next group's engine (its rank and world), and
:meth:`Parallelism.rebind(engine) <rdkeras.parallel.base.Parallelism.rebind>` is the one call that moves the
parallelism onto it. Each change is recorded (:attr:`Membership.changes`: TensorBoard and the train app read
them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from rdkeras import keras_internals
from rdkeras._log import logger
from rdkeras.elastic.group import ElasticGroup, NewGroup
from rdkeras.errors import PeerError
from rdkeras.parallel.collectives import share_variables
from rdkeras.parallel.sharding import global_batches

if TYPE_CHECKING:
    from rdkeras.parallel.base import Parallelism


class Membership:
    """This worker's membership of an elastic job (see the module docstring).

    Args:
        group: This worker's elastic group (its worker id, the launcher's answers).
    """

    def __init__(self, group: ElasticGroup):
        self.group = group
        # One record per membership change (TensorBoard and the train app's summary read them): ``step``,
        # ``workers``, ``lost``, ``joined``, ``seconds``, ``generation``.
        self.changes: list[dict[str, Any]] = []
        self.seed = 0  # the seed global batches of arrays are shuffled by (rank 0's)
        self.welcome: tuple[float, float, int] | None = None  # a replacement taken in: (seed, epoch, source)

    @property
    def worker(self) -> int:
        return self.group.worker

    @property
    def joining(self) -> bool:
        """Whether this worker is a replacement not yet taken into the group."""
        return self.group.joining is not None

    @property
    def chiefs_lost(self) -> int:
        return self.group.chiefs_lost

    @staticmethod
    def check(mode: str, global_batch: bool, shard: str) -> None:
        """Raises for data-parallel settings an elastic job cannot honour."""
        if shard != "none":
            raise NotImplementedError(
                f"shard={shard!r} in an elastic job: each worker holds the only copy of its shard of the optimizer "
                "state, and re-sharding it on a membership change is not built yet; use shard='none'"
            )
        if mode == "ps":
            raise ValueError(
                "an elastic job (launched with --min-workers) needs mode='allreduce': in parameter-server mode each "
                "worker holds the only current copy of its shard of the optimizer state, which dies with it"
            )
        if not global_batch:
            raise ValueError(
                "an elastic job (launched with --min-workers) needs global_batch=True: the same global batch is "
                "split over whoever is left, so a loss changes nothing in what a step computes"
            )

    # -- what fitting and the custom-loop API ask --------------------------------------------------

    def lost_a_worker(self, parallel: Parallelism, error: BaseException) -> bool:
        """Whether `error`, raised by a step, is the loss of a worker this job can go on without."""
        return parallel.engine.backend.failure is not None or isinstance(error, PeerError) or "PeerError" in str(error)

    def recover(self, parallel: Parallelism, model: Any) -> bool:
        """Re-forms the group after a loss and gives every survivor the state of the one that applied the most
        steps; returns whether that state includes the step in flight here (else it runs again)."""
        steps = int(model.optimizer.iterations.numpy())
        group = self.regroup(parallel, steps)
        variables = keras_internals.state_variables(model)
        share_variables(parallel.collectives, variables, [group.source] * len(variables))
        return steps < group.steps

    def retry(self, parallel: Parallelism, model: Any, collective: Callable[[], Any]) -> Any:
        """Runs `collective` (an epoch end's sharing of logs or state); a worker lost during it makes the group
        re-form and run it again."""
        while True:
            try:
                return collective()
            except Exception as e:
                if not self.lost_a_worker(parallel, e):
                    raise
                self.recover(parallel, model)

    def stepped(self, parallel: Parallelism) -> None:
        """After each step: the new group's rank 0 tells the launcher when its first step ended."""
        self.group.stepped(parallel.engine)

    def regroup(self, parallel: Parallelism, steps: int) -> NewGroup:
        """Leaves this group (after a loss, or to take replacements in) for the next one the launcher decides,
        this worker's last commit being `steps`; `parallel` is rebound to it. Returns what the new group is (its
        source: whose state to take). Collective over the survivors."""
        engine, group = self.group.reform(parallel.engine, steps)
        parallel.rebind(engine)
        self.changes.append({"step": group.steps, "workers": engine.world_size, "lost": group.lost,
                             "joined": group.joined, "seconds": group.took_s,
                             "generation": group.generation})  # fmt: skip
        if engine.rank == 0 and group.lost:
            lost = ", ".join(map(str, group.lost))
            logger.warning(
                f"elastic: lost worker {lost} ({group.reason}); {engine.world_size} workers go on from step "
                f"{group.steps} (generation {group.generation}, re-formed in {group.took_s:.2f} s)"
            )
        if engine.rank == 0 and group.joined:
            logger.warning(
                f"elastic: worker {', '.join(map(str, group.joined))} joined; {engine.world_size} workers go on "
                f"from step {group.steps} (generation {group.generation})"
            )
        return group

    def joiners_waiting(self, parallel: Parallelism) -> bool:
        """Whether replacements wait to join (rank 0 asks the launcher and tells the others; collective)."""
        waiting = parallel.engine.rank == 0 and self.group.joiners_waiting(parallel.engine)
        (flag,) = parallel.collectives.broadcast([np.asarray([float(waiting)])])
        return bool(flag[0])

    def admit(self, parallel: Parallelism, model: Any, next_epoch: int) -> None:
        """At an epoch end (collective): takes in the replacements waiting to join, if any -- the group re-forms
        with them, and hands them where training stands (the data's seed, the next epoch) and its state."""
        if not self.joiners_waiting(parallel):
            return
        group = self.regroup(parallel, int(model.optimizer.iterations.numpy()))
        where = np.asarray([float(self.seed), next_epoch, 0.0])
        (_,) = parallel.collectives.broadcast([where], root=group.source)
        variables = keras_internals.state_variables(model)
        share_variables(parallel.collectives, variables, [group.source] * len(variables))

    # -- a replacement -------------------------------------------------------------------------------

    def join(self, parallel: Parallelism) -> NewGroup:
        """A replacement: leaves its solitary engine for the group's once the group takes it in (the caller
        then receives the group's state from ``group.source``)."""
        assert self.group.joining is not None
        address, port, lobby_world = self.group.joining
        alone = parallel.engine
        settings = alone.successor()
        token = settings.pop("token")
        settings["transport"] = "auto"  # (alone it chose shm; the group may span hosts)
        alone.close()
        engine, group = self.group.join(address, port, lobby_world, token, settings, max(alone.timeout, 3600))
        self.group.joining = None
        parallel.rebind(engine)
        return group

    def join_fit(self, parallel: Parallelism, model: Any) -> None:
        """A replacement in ``fit``: joins the group and learns where training stands."""
        group = self.join(parallel)
        (where,) = parallel.collectives.broadcast([np.zeros(3)], root=group.source)
        self.welcome = (where[0], where[1], group.source)
        keras_internals.set_initial_epoch(model, int(where[1]))
        logger.info(f"elastic: worker {self.worker} joined as rank {parallel.engine.rank} of "
                    f"{parallel.engine.world_size}, at epoch {int(where[1]) + 1}")  # fmt: skip

    def take_welcome(self, parallel: Parallelism, model: Any) -> bool:
        """At the start of a replacement's ``fit`` (collective): the state of the group's source, as it is now;
        False where there is no replacement to welcome (the parallelism shares its state as usual)."""
        if self.welcome is None:
            return False
        from rdkeras import fitting

        source = int(self.welcome[2])
        self.welcome = None
        for optimizer in fitting.optimizers_of(model):
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
        variables = keras_internals.state_variables(model)
        share_variables(parallel.collectives, variables, [source] * len(variables))
        return True

    # -- fit's data ----------------------------------------------------------------------------------

    def keep_global_batches(self, parallel: Parallelism, a: dict) -> None:
        """Every worker iterates the whole global batches (the step takes its rows by the world of the moment);
        arrays become a PyDataset of global batches shuffled alike everywhere."""
        sharding = parallel.sharding
        if a["validation_split"] and a["validation_data"] is None and sharding.shardable_arrays(a["x"]):
            (a["x"], a["y"], a["sample_weight"]), a["validation_data"] = keras_internals.train_validation_split(
                (a["x"], a["y"], a["sample_weight"]), a["validation_split"]
            )
            a["validation_split"] = 0.0
        if a["x"] is not None and sharding.shardable_arrays(a["x"]):
            if self.welcome is not None:  # a replacement: the group's seed and epoch
                seed, epoch = int(self.welcome[0]), int(self.welcome[1])
            else:
                drawn = np.random.default_rng().integers(1 << 52, size=1).astype(np.float64)
                seed, epoch = int(parallel.collectives.broadcast([drawn])[0][0]), 0
            self.seed = seed
            a["x"] = global_batches(a["x"], a["y"], a["sample_weight"], a["batch_size"] or 32, a["shuffle"],
                                    seed, parallel.engine.world_size, epoch)  # fmt: skip
            if a["validation_data"] is not None and a["validation_batch_size"] is None:
                a["validation_batch_size"] = a["batch_size"] or 32
            a["y"] = a["sample_weight"] = a["batch_size"] = None
            a["shuffle"] = False
