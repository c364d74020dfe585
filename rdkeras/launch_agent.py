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

With ``max_restarts`` K, each loss (K in all) also asks the launcher for a replacement
(:meth:`ElasticAgent.take_spawns`), with a new id. It waits in the *lobby* (a store of its own,
every id a rank there, the same token to prove) until the group reaches an epoch end: the
agent sets ``elastic/joiners`` in the current store, the group's rank 0 sees it there and the
group agrees to re-form (every member says it is ready, as after a loss); the next generation
is the members followed by the joiners, published in the old store and as ``admit/ID`` in the
lobby. The group then hands the joiner where training stands and its state. A replacement that never joins
-- it exits first, it does not reach the lobby within ``join_timeout`` (it is then told not to join), or the job
finishes while it waits -- is reported (:attr:`ElasticAgent.unjoined`) and the group goes on without it; it
counts among the K.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rdkeras._log import logger
from rdkeras.elastic.protocol import ADMIT, ENDED, EXITED, FIRST_STEP, JOINERS, JOINING, NEXT, READY
from rdkeras.rendezvous import StoreServer

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
    joined: list[int] = field(default_factory=list)  # replacements admitted (worker ids)
    step: int = -1  # optimizer steps the new group starts from
    published_at: float = 0.0
    first_step_at: float = 0.0  # wall-clock time of the new group's first step

    @property
    def recovery_s(self) -> float:
        """From the failure to the new group's first step (NaN until it ran)."""
        return self.first_step_at - self.failed_at if self.first_step_at else float("nan")

    def line(self) -> str:
        went_on = f"{len(self.members)} worker{'s' * (len(self.members) > 1)} ({', '.join(map(str, self.members))})"
        if self.joined:
            took = f"; its first step {self.recovery_s:.2f} s after the group stopped" if self.first_step_at else ""
            who = ", ".join(map(str, self.joined))
            return f"worker {who} joined as a replacement; {went_on} went on from step {self.step}{took}"
        who = ", ".join(map(str, self.lost))
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
        max_restarts: Replacements to start in all (each after a loss).
        join_timeout: Seconds a replacement has, from its start, to reach the lobby.
        say: Prints a line for the launcher's user at once (a replacement that will not join).
    """

    host: str
    port: int
    token: bytes
    world_size: int
    min_workers: int
    reform_timeout: float = 30.0
    arrival_timeout: float = 120.0
    max_restarts: int = 0
    join_timeout: float = 120.0
    say: Callable[[str], None] | None = None
    changes: list[Change] = field(default_factory=list)
    error: str | None = None
    # Replacements that never joined: worker id -> which worker it replaced, what happened, what it was told.
    unjoined: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.world_size:
            raise ValueError(f"min_workers must be in 1..{self.world_size}, got {self.min_workers}")
        self.generation = 0
        self.members = list(range(self.world_size))  # worker ids, by rank in the current generation
        self._lock = threading.Lock()
        self._exited: dict[int, str] = {}  # worker id -> how it ended (the launcher's process watch)
        self._finished: set[int] = set()  # worker ids that exited 0
        self.store = StoreServer(self.host, self.port, self.token, self.world_size, self.arrival_timeout)
        self.home = self.store  # generation 0's, on the job's port: the other nodes' launchers connect to it
        self._old: list[StoreServer] = []
        # Replacements: the lobby where they wait (ids N..N+K-1 as its ranks), those to start, those waiting.
        self.lobby = (StoreServer(self.host, 0, self.token, self.world_size + self.max_restarts)
                      if self.max_restarts > 0 else None)  # fmt: skip
        self._next_id = self.world_size
        self._spawns: list[int] = []
        self._replacing: dict[int, int] = {}  # replacement id -> the lost worker it replaces
        self._started: dict[int, float] = {}  # replacement id -> when the launcher was told to start it
        self._joiners: list[int] = []
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
            if worker in self._started and not self._joined(worker):
                self._not_joining(worker, f"it exited before joining ({how})")
            rank = self.members.index(worker) if worker in self.members else None
            store = self.store
        if rank is not None:
            store.abort(rank, f"worker {worker} {how}")

    def take_spawns(self, base_env: dict[str, str]) -> list[tuple[int, dict[str, str]]]:
        """The replacements the launcher should start now (each once): (worker id, its environment, from a
        worker's `base_env`): the lobby as its rendezvous, its id as its rank there, ``RDKERAS_JOIN``."""
        with self._lock:
            spawns, self._spawns = self._spawns, []
            self._started.update(dict.fromkeys(spawns, time.monotonic()))
        assert self.lobby is not None or not spawns
        return [(worker, {**base_env, "RDKERAS_RANK": str(worker), "LOCAL_RANK": str(worker),
                          "RDKERAS_WORLD_SIZE": str(self.world_size + self.max_restarts),
                          "LOCAL_WORLD_SIZE": str(self.world_size + self.max_restarts),
                          "RDKERAS_MASTER_PORT": str(self.lobby.port if self.lobby else 0),
                          "RDKERAS_JOB_TOKEN": self.token.decode(),  # (its rendezvous differs: keyed, it would too)
                          "RDKERAS_JOIN": str(worker)}) for worker in spawns]  # fmt: skip

    def finished(self) -> bool:
        """Whether every member of the current group exited 0 (the job is done; replacements still waiting are
        told so and may be stopped)."""
        with self._lock:
            return all(w in self._finished for w in self.members)

    def settle(self) -> None:
        """Stops re-forming (the workers ended) and reports the replacements that never joined."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        for worker in self._joiners:  # the job ended before they could join
            if self.lobby is not None:
                self.lobby.put(f"{ADMIT}{worker}", json.dumps({"finished": True}).encode())
        with self._lock:
            for worker in sorted(self._started):
                if not self._joined(worker) and worker not in self.unjoined:
                    after = time.monotonic() - self._started[worker]
                    where = ("while it waited in the lobby for an epoch end" if worker in self._joiners
                             else f"before it reached the lobby ({after:.1f} s after its start)")  # fmt: skip
                    self._not_joining(worker, f"the job finished {where}")

    def close(self) -> None:
        self.settle()
        for store in [*self._old, self.store, *([self.lobby] if self.lobby else [])]:
            store.close(arrivals=False)  # (the workers ended: nobody is on the way)

    def _joined(self, worker: int) -> bool:
        return worker in self.members or any(worker in change.joined for change in self.changes)

    def _not_joining(self, worker: int, why: str) -> None:
        """Reports replacement `worker`, which will not join (called with the lock held)."""
        if worker in self._joiners:
            self._joiners.remove(worker)
        replaced = f"(started for lost worker {self._replacing[worker]}) " if worker in self._replacing else ""
        self.unjoined[worker] = f"{replaced}never joined the group: {why}"
        line = f"elastic: replacement worker {worker} {self.unjoined[worker]}; {len(self.members)} workers go on"
        logger.warning(line)
        if self.say is not None:
            self.say(line)

    def _late_joiners(self) -> None:
        """Replacements that did not reach the lobby within the bound are told not to join, and reported."""
        now = time.monotonic()
        with self._lock:
            late = [w for w, at in self._started.items() if now - at > self.join_timeout and w not in self.unjoined
                    and not self._joined(w) and w not in self._joiners and w not in self._exited]  # fmt: skip
            for worker in late:
                if self.lobby is not None and self.lobby.value(f"{JOINING}{worker}") is not None:
                    continue  # it just arrived: taken in at the next epoch end
                why = f"it did not reach the lobby within {self.join_timeout:g} s of its start (--join-timeout)"
                if self.lobby is not None:
                    told = {"error": f"worker {worker} {why[3:]}: the group went on without it"}
                    self.lobby.put(f"{ADMIT}{worker}", json.dumps(told).encode())
                self._not_joining(worker, f"{why}; it was told not to join")

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            self._remote_exits()
            failure = self.store.failure
            if failure is not None and self.error is None:
                try:
                    self._reform(failure)
                except Exception as e:  # never leave the survivors waiting without an answer
                    self._fail(f"re-forming the group failed: {type(e).__name__}: {e}")
            elif self.error is None and self.lobby is not None:
                self._late_joiners()
                self._admit_joiners()
            change = self.changes[-1] if self.changes else None
            if change is not None and not change.first_step_at:
                if (at := self.store.value(FIRST_STEP)) is not None:
                    change.first_step_at = float(at.decode())
                    how = self._how_they_ended(change.lost, dict.fromkeys(range(len(change.lost)), ""))
                    if len(how) == len(change.lost):
                        change.reason = "; ".join(sorted(set(how.values())))
                    logger.info(f"elastic: {change.line()}")

    def _remote_exits(self) -> None:
        """Bad exits another node's launcher saw (it posts them in generation 0's store) count as seen here."""
        with self._lock:
            unseen = [w for w in range(self.world_size) if w not in self._exited]
        for worker in unseen:
            if (code := self.home.value(f"{EXITED}{worker}")) is not None:
                self.exited(worker, int(code))

    def _how_they_ended(self, workers: list[int], lost: dict[int, str]) -> dict[int, str]:
        """Of `lost` (positions in `workers`), those whose exit a launcher saw, with how they ended."""
        self._remote_exits()
        with self._lock:
            return {r: self._exited[workers[r]] for r in lost if workers[r] in self._exited}

    def _fail(self, message: str, blamed: int | None = None) -> None:
        """Ends the job: every survivor raises `message`, and (where one worker is to blame, `blamed`) reports it to
        the launcher, which then waits no longer for its exit than for any worker that said why it stops."""
        self.error = message
        self.home.put(ENDED, message.encode())
        self.store.put(
            NEXT, json.dumps({"error": message, **({"blamed": blamed} if blamed is not None else {})}).encode()
        )
        for worker in self._joiners:
            if self.lobby is not None:
                self.lobby.put(f"{ADMIT}{worker}", json.dumps({"error": message}).encode())
        logger.error(f"elastic: {message}")

    def _admit_joiners(self) -> None:
        """Replacements in the lobby are announced to the group; once every member said it is ready (the group
        agreed at an epoch end), the next generation takes them in."""
        assert self.lobby is not None
        with self._lock:
            waiting = [w for w in range(self.world_size, self._next_id)
                       if w not in self._joiners and w not in self._exited and w not in self.members
                       and w not in self.unjoined and self.lobby.value(f"{JOINING}{w}") is not None]  # fmt: skip
            self._joiners += waiting
            joiners = [w for w in self._joiners if w not in self._exited]
            self._joiners = joiners
        world = len(self.members)
        announced = self.store.value(JOINERS) is not None
        if not joiners and not announced:
            return
        if not announced:
            self.store.put(JOINERS, json.dumps(joiners).encode())
        if all(self.store.value(f"{READY}{r}") is not None for r in range(world)):
            # (every joiner announced may have gone since: the group then re-forms as it was)
            self._publish(list(range(world)), {}, time.time(), joiners)

    def _reform(self, failure: dict) -> None:
        failed_at = time.time()
        store, world, members = self.store, len(self.members), list(self.members)
        deadline = time.monotonic() + self.reform_timeout
        stall_check = time.monotonic() + STALL_GRACE_S
        lost: dict[int, str] = {}
        while True:
            self._remote_exits()
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
                    "hung worker cannot be replaced while it lives; the job ends",
                    members[failed],
                )
                return
            alive = [r for r in range(world) if r not in lost and r not in finished]
            if len(alive) < self.min_workers:
                until = time.monotonic() + 1.0  # a launcher's word on how they ended (a signal, an exit code) beats
                while len(how := self._how_they_ended(members, lost)) < len(lost) and time.monotonic() < until:
                    time.sleep(0.02)  # the store's (another node's launcher posts it in generation 0's)
                lost.update(how)
                who = ", ".join(f"worker {members[r]} ({how})" for r, how in sorted(lost.items()))
                self._fail(f"lost {who}: {len(alive)} left, fewer than --min-workers {self.min_workers}",
                           members[min(lost)] if lost else None)  # fmt: skip
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
        self._publish(alive, lost, failed_at, [])
        with self._lock:
            for r in sorted(lost):
                if self._next_id < self.world_size + self.max_restarts:
                    self._spawns.append(self._next_id)
                    self._replacing[self._next_id] = members[r]
                    self._next_id += 1

    def _publish(self, alive: list[int], lost: dict[int, str], failed_at: float, joiners: list[int]) -> None:
        """Starts the next generation's store and tells the group (and the joiners) who is in it."""
        store, members = self.store, list(self.members)
        ready = {r: json.loads(store.value(f"{READY}{r}") or b"{}") for r in alive}
        steps = {r: ready[r].get("steps", 0) for r in alive}
        source = max(alive, key=lambda r: (steps[r], -r))
        new_members = [members[r] for r in alive] + joiners
        nxt = StoreServer(self.host, 0, self.token, len(new_members), self.reform_timeout)
        change = Change(
            self.generation + 1,
            [members[r] for r in sorted(lost)],
            "; ".join(sorted(set(lost.values()))) or ("joined" if joiners else "the replacements announced left"),
            new_members,
            failed_at,
            step=int(steps[source]),
            joined=list(joiners),
        )
        with self._lock:
            self.generation += 1
            self.members = new_members
            self.store = nxt
            self._old.append(store)
            self._joiners = [w for w in self._joiners if w not in joiners]
        if lost or joiners:  # (not a re-forming whose joiners all left before it: nothing changed)
            self.changes.append(change)
        decided = json.dumps(
            {
                "generation": self.generation,
                "port": nxt.port,
                "members": new_members,
                "source": alive.index(source),
                "steps": int(steps[source]),
                "lost": change.lost,
                "joined": joiners,
                "reason": change.reason,
                "transport": ready[source].get("transport"),  # the group's (a replacement alone chose its own)
            }
        ).encode()
        store.put(NEXT, decided)
        for worker in joiners:
            assert self.lobby is not None
            self.lobby.put(f"{ADMIT}{worker}", decided)
        change.published_at = time.time()
