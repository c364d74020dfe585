"""The launcher's side of an elastic job: it hosts the store of every generation and decides who goes on.

Generation 0 is the job as launched: ranks 0..N-1, the store on the job's port. When a
member of generation g fails (the store records it: its connection dropped, a peer or the
launcher reported it), every survivor says so in that generation's store
(``elastic/ready/RANK``, with the optimizer steps it has applied) and waits for
``elastic/next``. The agent waits until every member still connected is ready -- a member
that exits meanwhile is lost too -- then starts generation g+1's store on a fresh port and
publishes it: its members (the survivors, in their old order: worker ids), its port, and
the member holding the most steps (the others take its state). Fewer survivors than
``min_workers``, a member that neither leaves nor answers within ``reform_timeout`` (stopped
or hung), or a failed member that is still connected (it stalled: nothing proves it is
gone) end the job instead: ``elastic/next`` then carries the error, which every survivor
raises.

The survivors' new rank is their index in the members. A worker's id is its rank in
generation 0 and never changes; the launcher's output and results use it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from rdkeras._log import logger
from rdkeras.rendezvous import StoreServer

READY = "elastic/ready/"
NEXT = "elastic/next"
FIRST_STEP = "elastic/first-step"  # set by the new group's rank 0 after its first step (wall-clock time)
# A failed member still connected this long after the failure is not dead: it stalled (or hung).
STALL_GRACE_S = 1.0


@dataclass
class Change:
    """One membership change: who left, when, and how long the group took to go on."""

    generation: int  # the new generation
    lost: list[int]  # worker ids
    reason: str
    members: list[int]  # worker ids of the new group, by new rank
    failed_at: float  # wall-clock time the launcher learned of the failure (or the worker's exit)
    step: int = -1  # optimizer steps the new group starts from
    published_at: float = 0.0
    first_step_at: float = 0.0  # wall-clock time of the new group's first step

    @property
    def recovery_s(self) -> float:
        """From the failure to the new group's first step (NaN until it ran)."""
        return self.first_step_at - self.failed_at if self.first_step_at else float("nan")

    def line(self) -> str:
        who = ", ".join(map(str, self.lost))
        went_on = f"{len(self.members)} worker{'s' * (len(self.members) > 1)} ({', '.join(map(str, self.members))})"
        took = f"; its first step {self.recovery_s:.2f} s after the loss" if self.first_step_at else ""
        return f"lost worker {who} ({self.reason}); {went_on} went on from step {self.step}{took}"


@dataclass
class ElasticAgent:
    """Hosts the stores of an elastic job and re-forms its group when members are lost.

    Args:
        host: The address the stores listen on ("" for every address).
        port: Generation 0's port (the job's rendezvous port).
        token: The job token.
        world_size: Workers at the start.
        min_workers: Fewest workers the job goes on with.
        reform_timeout: Seconds the survivors of a loss get to say they are ready.
        arrival_timeout: Generation 0's rendezvous timeout (see :class:`StoreServer`).
    """

    host: str
    port: int
    token: bytes
    world_size: int
    min_workers: int
    reform_timeout: float = 30.0
    arrival_timeout: float = 120.0
    changes: list[Change] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.world_size:
            raise ValueError(f"min_workers must be in 1..{self.world_size}, got {self.min_workers}")
        self.generation = 0
        self.members = list(range(self.world_size))  # worker ids, by rank in the current generation
        self._lock = threading.Lock()
        self._exited: dict[int, str] = {}  # worker id -> how it ended (the launcher's process watch)
        self._finished: set[int] = set()  # worker ids that exited 0
        self.store = StoreServer(self.host, self.port, self.token, self.world_size, self.arrival_timeout)
        self._old: list[StoreServer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rdkeras-elastic", daemon=True)
        self._thread.start()

    # -- what the launcher calls ----------------------------------------------------------

    def exited(self, worker: int, returncode: int) -> None:
        """The launcher saw worker `worker` exit with `returncode`."""
        with self._lock:
            if returncode == 0:
                self._finished.add(worker)
                return
            how = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
            self._exited[worker] = how
            rank = self.members.index(worker) if worker in self.members else None
            store = self.store
        if rank is not None:
            store.abort(rank, f"worker {worker} {how}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for store in [*self._old, self.store]:
            store.close(arrivals=False)  # (the workers ended: nobody is on the way)

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            failure = self.store.failure
            if failure is not None and self.error is None:
                try:
                    self._reform(failure)
                except Exception as e:  # never leave the survivors waiting without an answer
                    self._fail(f"re-forming the group failed: {type(e).__name__}: {e}")
            change = self.changes[-1] if self.changes else None
            if change is not None and not change.first_step_at:
                if (at := self.store.value(FIRST_STEP)) is not None:
                    change.first_step_at = float(at.decode())
                    how = self._how_they_ended(change.lost, dict.fromkeys(range(len(change.lost)), ""))
                    if len(how) == len(change.lost):
                        change.reason = "; ".join(sorted(set(how.values())))
                    logger.info(f"elastic: {change.line()}")

    def _how_they_ended(self, workers: list[int], lost: dict[int, str]) -> dict[int, str]:
        """Of `lost` (positions in `workers`), those whose exit the launcher saw, with how they ended."""
        with self._lock:
            return {r: self._exited[workers[r]] for r in lost if workers[r] in self._exited}

    def _fail(self, message: str) -> None:
        self.error = message
        self.store.put(NEXT, json.dumps({"error": message}).encode())
        logger.error(f"elastic: {message}")

    def _reform(self, failure: dict) -> None:
        failed_at = time.time()
        store, world, members = self.store, len(self.members), list(self.members)
        deadline = time.monotonic() + self.reform_timeout
        stall_check = time.monotonic() + STALL_GRACE_S
        lost: dict[int, str] = {}
        while True:
            connected = store.connected()
            ready = {r for r in range(world) if store.value(f"{READY}{r}") is not None}
            with self._lock:
                exited = {members.index(w): how for w, how in self._exited.items() if w in members}
                finished = {members.index(w) for w in self._finished if w in members}
            for r in range(world):
                if r in exited:
                    lost.setdefault(r, exited[r])
                elif r not in connected and r not in ready and r not in finished and r in store.arrived():
                    lost.setdefault(r, "its connection to the store closed")
            failed = int(failure["rank"])
            if failed not in lost and time.monotonic() >= stall_check and failed in connected:
                self._fail(
                    f"worker {members[failed]} failed but is still running ({failure['reason']}): a stopped or "
                    "hung worker cannot be replaced while it lives; the job ends"
                )
                return
            alive = [r for r in range(world) if r not in lost and r not in finished]
            if len(alive) < self.min_workers:
                time.sleep(0.1)  # the launcher's word on how they ended (a signal, an exit code) beats the store's
                lost.update(self._how_they_ended(members, lost))
                who = ", ".join(f"worker {members[r]} ({how})" for r, how in sorted(lost.items()))
                self._fail(f"lost {who}: {len(alive)} left, fewer than --min-workers {self.min_workers}")
                return
            if finished:
                self._fail(f"worker(s) {', '.join(str(members[r]) for r in sorted(finished))} finished while the "
                           "others lost a member: the group cannot re-form")  # fmt: skip
                return
            pending = [r for r in alive if r not in ready]
            if not pending and failed in lost:
                break
            if time.monotonic() > deadline:
                slow = pending or [failed]
                self._fail(
                    f"worker(s) {', '.join(str(members[r]) for r in slow)} did not rejoin within "
                    f"{self.reform_timeout:g} s after worker {members[failed]} failed (stopped or hung?)"
                )
                return
            time.sleep(0.005)
        steps = {r: json.loads(store.value(f"{READY}{r}") or b"{}").get("steps", 0) for r in alive}
        source = max(alive, key=lambda r: (steps[r], -r))
        nxt = StoreServer(self.host, 0, self.token, len(alive), self.reform_timeout)
        new_members = [members[r] for r in alive]
        change = Change(
            self.generation + 1,
            [members[r] for r in sorted(lost)],
            "; ".join(sorted(set(lost.values()))),
            new_members,
            failed_at,
            step=int(steps[source]),
        )
        with self._lock:
            self.generation += 1
            self.members = new_members
            self.store = nxt
            self._old.append(store)
        self.changes.append(change)
        store.put(
            NEXT,
            json.dumps(
                {
                    "generation": self.generation,
                    "port": nxt.port,
                    "members": new_members,
                    "previous": alive,
                    "source": alive.index(source),
                    "steps": int(steps[source]),
                    "lost": change.lost,
                    "reason": change.reason,
                }
            ).encode(),
        )
        change.published_at = time.time()
