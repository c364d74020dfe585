"""Elastic custom training loops: Horovod's ``hvd.elastic.run``, for an rdkeras job.

``fit`` needs nothing of this (:mod:`rdkeras.fitting.elastic` recovers it). A loop of one's own
keeps what it must not lose in a :class:`State` -- the model, the optimizer and plain values such
as the epoch and the batch -- commits it now and then, and runs inside :func:`run`::

    state = rdkeras.elastic.State(strategy, model, optimizer, epoch=0, batch=0)

    @rdkeras.elastic.run
    def train(state):
        while state.epoch < epochs:
            while state.batch < steps:
                x, y = global_batch(state.epoch, state.batch)  # the same on every worker
                strategy.run(step, args=strategy.local_rows((x, y)))
                state.batch += 1
                state.commit()
            state.epoch, state.batch = state.epoch + 1, 0

    train(state)

A commit is a copy in this process's memory (every worker of a data-parallel job holds the whole
state; nothing crosses the wire). When a worker is lost, every survivor restores its last commit,
the group re-forms without the lost worker, every member takes the commit of the survivor that
made the most (a commit on some survivors and not yet on others is kept, not lost), the callbacks
registered with :meth:`State.register_reset_callbacks` run, and ``train(state)`` is called again:
it goes on from the commit. With ``--max-restarts``, a replacement calling ``train(state)`` waits to
be taken in at the group's next commit and starts from the state it receives.
"""

from __future__ import annotations

import copy
import functools
import pickle
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from rdkeras._log import logger

if TYPE_CHECKING:
    from rdkeras.strategy import RDMAStrategy

T = TypeVar("T")

_OWN = ("commit", "commits", "restore", "sync", "register_reset_callbacks")


class State:
    """What an elastic custom loop must not lose (Horovod's ``hvd.elastic.KerasState``).

    Args:
        strategy: The job's ``RDMAStrategy`` (data parallelism).
        model: A Keras model: its weights are kept.
        optimizer: Its optimizer (default: ``model.optimizer``, if compiled): its variables are kept; an
            optimizer not built yet is built for the model's trainable variables, so that every commit
            holds the same variables.
        **values: Plain values (numbers, strings, picklable objects) kept too, read and set as
            attributes (``state.epoch``).
    """

    commits: int  # commits made so far (the group's, after a re-form)
    _strategy: RDMAStrategy
    _values: dict[str, Any]  # the plain values, by name
    _variables: list[Any]  # the model's weights and the optimizer's variables, each once
    _committed: tuple[list[np.ndarray], dict[str, Any]]  # the last commit: variables' values, plain values
    _reset_callbacks: list[Callable[[], None]]

    def __init__(self, strategy: RDMAStrategy, model: Any = None, optimizer: Any = None, **values: Any):
        if strategy.parallelism != "data":
            raise ValueError(f"an elastic State needs parallelism='data', not {strategy.parallelism!r}")
        clash = sorted(name for name in values if name in _OWN or name.startswith("_"))
        if clash:
            raise ValueError(f"{', '.join(clash)}: names State uses itself; keep these values under other names")
        if optimizer is None and model is not None:
            optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            if model is None:
                raise ValueError("an optimizer that is not built yet needs the model whose variables it trains")
            optimizer.build(model.trainable_variables)
        self._values = dict(values)
        self._strategy = strategy
        kept = [*(model.weights if model is not None else []), *(optimizer.variables if optimizer is not None else [])]
        self._variables = list({id(v): v for v in kept}.values())  # (fixed from here: the optimizer is built)
        self._reset_callbacks = []
        self.commits = 0
        self._committed = self._snapshot()

    def __getattr__(self, name: str) -> Any:  # (only what is not an attribute of the object itself)
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"State has no value {name!r}: name it when creating the State ({name}=...)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_values", {}):
            self._values[name] = value
        elif name.startswith("_") or name == "commits":
            super().__setattr__(name, value)
        else:
            raise AttributeError(f"State has no value {name!r}: name it when creating the State ({name}=...)")

    # -- what a loop calls ----------------------------------------------------------------------

    def commit(self) -> None:
        """Keeps the state as it is now (in this process's memory): after a loss, training goes on from here.
        Call it on every worker at the same points of the loop (a step's end). In an elastic job it is also
        where replacements waiting to join are taken in (a broadcast of one flag)."""
        self._committed = self._snapshot()
        self.commits += 1
        parallel = self._parallel
        membership = parallel.membership
        if membership is None:
            return
        membership.stepped(parallel)
        if membership.joiners_waiting(parallel):
            self._sync(membership.regroup(parallel, self.commits).source)
            self._reset()

    def restore(self) -> None:
        """Puts back the last commit (this process's)."""
        variables, values = self._committed
        for v, value in zip(self._variables, variables, strict=True):
            v.assign(value)
        self._values = copy.deepcopy(values)

    def sync(self, root: int = 0) -> None:
        """Gives every worker `root`'s state (collective), and commits it."""
        self._sync(root)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called (without arguments) after each change of membership, before the loop goes on:
        where the number of workers matters (a learning rate scaled by it, a dataset of one's own)."""
        self._reset_callbacks.extend(callbacks)

    # -- inside ----------------------------------------------------------------------------------------

    @property
    def _parallel(self) -> Any:
        return self._strategy._data_parallel("an elastic State")

    def _snapshot(self) -> tuple[list[np.ndarray], dict[str, Any]]:
        variables = [np.array(v.numpy(), copy=True) for v in self._variables]
        return variables, copy.deepcopy(self._values)

    def _sync(self, root: int) -> None:
        """Every member takes `root`'s state (its last commit, after a restore), commit count included."""
        collectives = self._parallel.collectives
        if collectives.size > 1:
            self._strategy.broadcast_variables(self._variables, root)
            mine = np.frombuffer(pickle.dumps((self._values, self.commits)), np.uint8)
            (size,) = collectives.broadcast([np.asarray([mine.size], np.float64)], root=root)
            theirs = mine if collectives.engine.rank == root else np.zeros(int(size[0]), np.uint8)
            (raw,) = collectives.broadcast([theirs], root=root)
            self._values, self.commits = pickle.loads(raw.tobytes())
        self._committed = self._snapshot()

    def _reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorates ``func(state, *args, **kwargs)``, a custom training loop, to survive the loss of workers in an
    elastic job (launched with ``--min-workers``): see the module's docstring. The first call gives every worker
    rank 0's state; outside an elastic job that is all it adds."""

    @functools.wraps(func)
    def elastic(state: State, *args: Any, **kwargs: Any) -> T:
        parallel = state._parallel
        if parallel.membership is not None and parallel.membership.joining:  # a replacement
            state._sync(parallel.membership.join(parallel).source)
            logger.info(f"elastic: joined as rank {parallel.engine.rank} of {parallel.engine.world_size}, at "
                        f"commit {state.commits}")  # fmt: skip
            return _retrying(func, state, args, kwargs)
        return _retrying(func, state, args, kwargs, first_sync=True)

    return elastic


def _retrying(func: Callable[..., T], state: State, args: Any, kwargs: Any, first_sync: bool = False) -> T:
    parallel = state._parallel
    membership = parallel.membership
    while True:
        try:
            if first_sync:
                state._sync(0)
                first_sync = False
            return func(state, *args, **kwargs)
        except Exception as e:
            if membership is None or not membership.lost_a_worker(parallel, e):
                raise
        state.restore()  # (out of the except block: the failure's traceback is dropped, and what it held)
        state._sync(membership.regroup(parallel, state.commits).source)
        state._reset()
