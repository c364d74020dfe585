"""A worker's side of an elastic job: after a member is lost, leave the old group and join the next.

:meth:`ElasticGroup.reform` is called with the engine that saw the failure. It reports the
failure to that generation's store, says this worker is ready (with the optimizer steps it
applied: its last commit), waits for the launcher's answer (:mod:`rdkeras.elastic.agent`),
drops the old engine -- its transport closed and its memory freed, nothing of it reused --
and starts an engine for the new group, on the new generation's store. A member lost while
the new group starts makes it re-form again, from the new store.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from rdkeras._log import logger
from rdkeras.elastic.agent import FIRST_STEP, NEXT, READY
from rdkeras.engine import Engine
from rdkeras.errors import EngineError, PeerError
from rdkeras.rendezvous import Store


class ElasticError(EngineError):
    """The group could not go on (too few workers left, a member stopped); the message names the workers."""


@dataclass(frozen=True)
class NewGroup:
    """What the launcher decided: the group this worker is now part of."""

    generation: int
    members: list[int]  # worker ids, by rank
    source: int  # the rank whose state everyone takes (it applied the most steps)
    steps: int  # the steps it applied
    lost: list[int]  # worker ids
    reason: str
    took_s: float  # from this worker's failure to its new engine


class ElasticGroup:
    """This worker's membership of an elastic job.

    Args:
        worker: This worker's id (its rank when the job started).
        min_workers: Fewest workers the job goes on with (the launcher enforces it; kept for messages).
        reform_timeout: Seconds to wait for the launcher's decision.
    """

    def __init__(self, worker: int, min_workers: int, reform_timeout: float = 60.0):
        self.worker, self.min_workers, self.reform_timeout = worker, min_workers, reform_timeout
        self.generation = 0
        self._first_step_pending = False

    def reform(self, engine: Engine, steps: int) -> tuple[Engine, NewGroup]:
        """Leaves `engine`'s group (after a failure) and returns an engine for the next one, and what it is."""
        began = time.monotonic()
        failure = engine.backend.failure
        settings = dict(
            transport=engine.transport,
            timeout=engine.timeout,
            heartbeat_timeout=engine.heartbeat_timeout,
            rendezvous_timeout=engine.rendezvous_timeout,
        )
        token, address, rank = engine._token, engine.store_address, engine.rank
        if failure is not None:
            engine.store.abort(failure[0], failure[2])  # a stall is known only to the peers that saw it
        store = engine.abandon()
        while True:
            store.set(f"{READY}{rank}", json.dumps({"steps": int(steps), "worker": self.worker}).encode())
            try:
                (raw,) = store.get([NEXT], timeout=self.reform_timeout, despite_failure=True)
            except EngineError as e:
                store.close()
                raise ElasticError(f"no answer from the launcher about the next group: {e}") from None
            decided = json.loads(raw)
            if "error" in decided:
                store.close()
                raise ElasticError(decided["error"])
            rank = decided["members"].index(self.worker)
            world = len(decided["members"])
            nxt = Store(rank, world, address, int(decided["port"]), token, engine.timeout, serve=False,
                        connect_timeout=self.reform_timeout)  # fmt: skip
            store.close()
            try:
                new = Engine(rank, world, master_addr=address, master_port=int(decided["port"]), token=token,
                             store=nxt, **settings)  # type: ignore[arg-type]  # fmt: skip
            except PeerError as e:  # a member lost while the new group started: re-form from the new store
                logger.warning(f"elastic: the next group lost a member while it started ({e}); re-forming again")
                if e.rank is not None:
                    nxt.abort(e.rank, str(e))
                store = nxt
                continue
            self.generation = int(decided["generation"])
            self._first_step_pending = rank == 0
            return new, NewGroup(
                self.generation,
                list(decided["members"]),
                int(decided["source"]),
                int(decided["steps"]),
                list(decided["lost"]),
                str(decided["reason"]),
                time.monotonic() - began,
            )

    def stepped(self, engine: Engine) -> None:
        """After each step: the new group's rank 0 tells the launcher when its first step ended (the recovery
        time the launcher prints)."""
        if self._first_step_pending:
            self._first_step_pending = False
            engine.store.set(FIRST_STEP, repr(time.time()).encode())
