"""A worker's side of an elastic job: after a member is lost, leave the old group and join the next.

:meth:`ElasticGroup.reform` is called with the engine that saw the failure. It reports the
failure to that generation's store, says this worker is ready (with the optimizer steps it
applied: its last commit), waits for the launcher's answer (:mod:`rdkeras.launch_agent`),
drops the old engine -- its transport closed and its memory freed, nothing of it reused --
and starts an engine for the new group, on the new generation's store. A member lost while
the new group starts makes it re-form again, from the new store.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from rdkeras import reports
from rdkeras._log import logger
from rdkeras.elastic.protocol import ADMIT, FIRST_STEP, JOINERS, JOINING, NEXT, READY
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
    joined: list[int]  # replacements admitted (worker ids)


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
        # A replacement: (the lobby's address, port, world) until the group takes it in (rdkeras.launch_agent).
        self.joining: tuple[str, int, int] | None = None
        self._first_step_pending = False
        # The group's chief (its rank 0's worker id; generation 0's is worker 0, a replacement learns it when it
        # joins), and how many chiefs this worker has seen lost: a new chief finishes what the lost one was saving.
        self.chief: int | None = 0
        self.chiefs_lost = 0

    def reform(self, engine: Engine, steps: int) -> tuple[Engine, NewGroup]:
        """Leaves `engine`'s group (after a failure, or to take replacements in) and returns an engine for the
        next one, and what it is."""
        began = time.monotonic()
        settings = engine.successor()
        token, address, rank = settings.pop("token"), engine.store_address, engine.rank
        store = engine.abandon()  # (the failure it saw told to the old store first)
        while True:
            ready = {"steps": int(steps), "worker": self.worker, "transport": settings["transport"]}
            store.set(f"{READY}{rank}", json.dumps(ready).encode())
            try:
                (raw,) = store.get([NEXT], timeout=self.reform_timeout, despite_failure=True)
            except EngineError as e:
                store.close()
                raise ElasticError(f"no answer from the launcher about the next group: {e}") from None
            store.close()
            decided = json.loads(raw)
            new, group = self._start(decided, token, address, settings, began)
            if new is not None:
                return new, group
            store, rank = group, decided["members"].index(self.worker)  # re-form from the half-started group

    def join(self, address: str, port: int, lobby_world: int, token: bytes, settings: dict,
             timeout: float) -> tuple[Engine, NewGroup]:  # fmt: skip
        """A replacement: waits in the launcher's lobby until the group takes it in (at an epoch end), and
        returns an engine in that group."""
        began = time.monotonic()
        lobby = Store(self.worker, lobby_world, address, port, token, timeout, serve=False)
        try:
            lobby.set(f"{JOINING}{self.worker}", b"1")
            (raw,) = lobby.get([f"{ADMIT}{self.worker}"], timeout=timeout, despite_failure=True)
        except EngineError as e:
            raise ElasticError(f"worker {self.worker} was not taken into the group within {timeout:g} s: {e}") from None
        finally:
            lobby.close()
        decided = json.loads(raw)
        if decided.get("finished"):
            raise ElasticError(f"the job finished before worker {self.worker} could join it")
        while True:
            new, group = self._start(decided, token, address, settings, began)
            if new is not None:
                return new, group
            rank = decided["members"].index(self.worker)  # (it holds no state yet: never the source)
            group.set(f"{READY}{rank}", json.dumps({"steps": -1, "worker": self.worker}).encode())
            (raw,) = group.get([NEXT], timeout=self.reform_timeout, despite_failure=True)
            group.close()
            decided = json.loads(raw)

    def _start(self, decided: dict, token: bytes, address: str, settings: dict, began: float) -> Any:
        """(an engine in the group `decided` describes, the group), or (None, that group's store) when a member
        was lost while it started (the caller waits there for the next decision)."""
        if "error" in decided:
            if (blamed := decided.get("blamed")) is not None:  # (its launcher then waits for no teardown of ours)
                reports.write(self.worker, int(blamed), decided["error"])
            raise ElasticError(decided["error"])
        rank = decided["members"].index(self.worker)
        world, port = len(decided["members"]), int(decided["port"])
        settings = {**settings, "transport": decided.get("transport") or settings["transport"]}  # the group's
        nxt = Store(rank, world, address, port, token, settings["timeout"], serve=False,
                    connect_timeout=self.reform_timeout)  # fmt: skip
        try:
            new = Engine(rank, world, master_addr=address, master_port=port, token=token, store=nxt, **settings)
        except PeerError as e:
            logger.warning(f"elastic: the next group lost a member while it started ({e}); re-forming again")
            if e.rank is not None:
                nxt.abort(e.rank, str(e))
            return None, nxt
        self.generation = int(decided["generation"])
        self._first_step_pending = rank == 0
        if self.chief is not None and decided["members"][0] != self.chief:
            self.chiefs_lost += 1
        self.chief = int(decided["members"][0])
        return new, NewGroup(
            self.generation,
            list(decided["members"]),
            int(decided["source"]),
            int(decided["steps"]),
            list(decided["lost"]),
            str(decided["reason"]),
            time.monotonic() - began,
            list(decided.get("joined", [])),
        )

    def joiners_waiting(self, engine: Engine) -> bool:
        """Whether replacements wait to join (asked of the store: call it on one rank and share the answer)."""
        return engine.host_says(JOINERS) is not None

    def stepped(self, engine: Engine) -> None:
        """After each step: the new group's rank 0 tells the launcher when its first step ended (the recovery
        time the launcher prints)."""
        if self._first_step_pending:
            self._first_step_pending = False
            engine.tell_host(FIRST_STEP, repr(time.time()).encode())
