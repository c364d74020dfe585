"""One verdict across nodes: every node's launcher prints the same root cause and exits with the same status.

Each launcher sees only its own workers: alone, the launcher of a node without the failed rank would blame one of
its own live ranks. So for a job of several nodes (not elastic), node 0's launcher hosts the job's store
(``RDKERAS_STORE=launcher``: the store outlives rank 0) and the others connect to it as its launcher clients (the
job token proven by HMAC, as the ranks do). A launcher reports a worker killed by a signal to the store (the others'
waits then name it), and once its workers ended posts how each ended, its last lines and its failure report under
``verdict/node-N``. Node 0's launcher waits for them (at most ``NODES_WAIT_S``; ``GONE_S`` once no launcher
that has not posted is connected), merges them into the job's verdict
(:func:`rdkeras.launch_verdict.verdict`: the reports of every rank, :func:`rdkeras.reports.cause`) and posts it as
``verdict/final``; every launcher prints it and exits with its status. A launcher that gets no verdict from node 0's
within ``FINAL_WAIT_S`` prints its own and says so. An elastic job (:mod:`rdkeras.launch_elastic`) shares its
verdict the same way, through generation 0's store of node 0's agent, judged by the agent's outcome.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

from rdkeras import cluster, jobtoken, options
from rdkeras._workers import RankResult
from rdkeras.errors import EngineError
from rdkeras.launch_verdict import verdict
from rdkeras.rendezvous import LAUNCHER, Store, StoreServer

if TYPE_CHECKING:
    from rdkeras.launch import Job

NODES_WAIT_S = 60.0  # node 0's launcher, for the other nodes' reports once its own workers ended
GONE_S = 5.0  # ... but no longer than this for a node whose launcher is not connected (dead, or never came)
FINAL_WAIT_S = NODES_WAIT_S + 30.0  # another node's launcher, for node 0's verdict (node 0 waits NODES_WAIT_S)
ACK_WAIT_S = 10.0  # node 0's launcher keeps the store up this long at most for the others to read the verdict
TAIL_LINES = 20  # of each rank's last output, what travels to node 0 (the blamed rank's is shown)
Judge = Callable[[list[RankResult]], tuple[int, list[str]]]  # every node's results -> (exit status, lines)


class NodeVerdict:
    """This node's part in the job's verdict. `worker_env` is one of the job's worker environments (the job's key
    and token settings); node 0's launcher starts the store here (or uses `server`, an elastic job's agent's),
    another's connects to it in the background."""

    env: ClassVar[dict[str, str]] = {"RDKERAS_STORE": "launcher"}  # what the workers need: the store is the launcher's

    def __init__(self, job: Job, worker_env: Mapping[str, str], server: StoreServer | None = None):
        self.job = job
        self._borrowed = server is not None  # (closed by its owner)
        settings = options.from_env(worker_env)
        self._token = jobtoken.resolve(job.world_size, cluster.job_key(worker_env), settings)
        self._server: StoreServer | None = None
        self._client: Store | None = None
        self._connecting: threading.Thread | None = None
        self._why_not = ""  # why there is no connection to node 0's launcher
        host = "" if job.master_addr in ("0.0.0.0", "") else job.master_addr
        if server is not None:
            self._server = server
        elif job.node_rank == 0:  # (before the workers start: they connect to it)
            self._server = StoreServer(host, int(job.master_port or 0), self._token, job.world_size,
                                       settings.rendezvous_timeout)  # fmt: skip
        else:
            self._connecting = threading.Thread(target=self._connect, args=(settings.rendezvous_timeout,), daemon=True)
            self._connecting.start()

    def _connect(self, timeout: float) -> None:
        try:
            store = Store(LAUNCHER, self.job.world_size, self.job.master_addr, int(self.job.master_port or 0),
                          self._token, timeout=FINAL_WAIT_S, serve=False, connect_timeout=timeout)  # fmt: skip
        except (EngineError, OSError) as e:
            self._why_not = str(e)
        else:
            self._client = store

    def exited(self, rank: int, returncode: int) -> None:
        """A worker of this node ended: one killed by a signal said nothing to anyone, so the store is told."""
        if returncode >= 0:
            return
        reason = f"it was killed by signal {-returncode} (seen by node {self.job.node_rank}'s launcher)"
        if self._server is not None:
            self._server.abort(rank, reason)
        elif self._client is not None:
            self._client.abort(rank, reason)

    @property
    def client(self) -> Store | None:
        """This launcher's connection to node 0's (None on node 0, or while not connected)."""
        return self._client

    def decide(self, results: list[RankResult], judge: Judge = verdict) -> tuple[int, list[str]]:
        """The job's exit status and the lines every launcher prints (without the "rdkeras.launch: " prefix):
        node 0's launcher `judge`s every node's results."""
        mine = json.dumps({"node": self.job.node_rank, "results": [_encode(r) for r in results]}).encode()
        if self._server is not None:
            return self._decide(mine, judge)
        assert self._connecting is not None
        self._connecting.join(timeout=ACK_WAIT_S)  # (the workers reached the store long before, or never did)
        if self._client is None:
            why = self._why_not or f"no connection to it within {ACK_WAIT_S:g} s after this node's workers ended"
        else:
            try:
                self._client.set(f"verdict/node-{self.job.node_rank}", mine)
                (final,) = self._client.get(["verdict/final"], timeout=FINAL_WAIT_S, despite_failure=True)
                self._client.set(f"verdict/read/{self.job.node_rank}", b"")
                found = json.loads(final)
                return int(found["status"]), list(found["lines"])
            except (EngineError, OSError, ValueError, KeyError) as e:
                why = str(e)
        status, lines = judge(results)
        return status, [f"no verdict from node 0's launcher ({why}); this is node {self.job.node_rank}'s own, from "
                        "its workers alone", *lines]  # fmt: skip

    def _decide(self, mine: bytes, judge: Judge) -> tuple[int, list[str]]:
        assert self._server is not None
        server = self._server
        server.put("verdict/node-0", mine)
        others = [f"verdict/node-{n}" for n in range(1, self.job.nnodes)]
        began = time.monotonic()
        while time.monotonic() < began + NODES_WAIT_S and (waiting := sum(server.value(k) is None for k in others)):
            if time.monotonic() > began + GONE_S and server.launchers() <= len(others) - waiting:
                break  # every launcher still connected has posted: the others' are gone
            time.sleep(0.05)
        posted = [json.loads(v) for k in ["verdict/node-0", *others] if (v := server.value(k)) is not None]
        results = [_decode(r) for node in posted for r in node["results"]]
        silent = [n for n in range(1, self.job.nnodes) if server.value(f"verdict/node-{n}") is None]
        per = self.job.per_node
        for n in silent:  # (a rank the reports blame may be one of theirs)
            unseen = f"not known: node {n}'s launcher did not report"
            results += [RankResult(n * per + i, None, "", unseen=unseen) for i in range(per)]
        status, lines = judge(sorted(results, key=lambda r: r.rank))
        if silent:
            nodes = ", ".join(map(str, silent))
            lines.append(f"node {nodes}'s launcher did not report (gone, or still waiting for its workers): this "
                         "verdict is from the other nodes' workers")  # fmt: skip
            status = status or 1
        server.put("verdict/final", json.dumps({"status": status, "lines": lines}).encode())
        readers = [f"verdict/read/{node['node']}" for node in posted if node["node"] != 0]
        end = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < end and any(server.value(k) is None for k in readers):
            time.sleep(0.05)
        return status, lines

    def close(self) -> None:
        if self._server is not None and not self._borrowed:
            self._server.close(arrivals=False)
        if self._client is not None:
            self._client.close()


def _encode(r: RankResult) -> dict:
    """What node 0's launcher needs of a rank's end: its wall-clock time (monotonic clocks differ by host)."""
    ended = time.time() - (time.monotonic() - r.ended_at) if r.ended_at != float("inf") else None
    tail = "".join(r.tail).splitlines(keepends=True)[-TAIL_LINES:]
    return {"rank": r.rank, "returncode": r.returncode, "killed": r.killed, "ended": ended,
            "tail": "".join(tail)[-8000:], "report": r.report}  # fmt: skip


def _decode(d: dict) -> RankResult:
    ended = float("inf") if d["ended"] is None else float(d["ended"])
    r = RankResult(int(d["rank"]), d["returncode"], "", ended_at=ended, report=d["report"], killed=bool(d["killed"]))
    r.tail.extend(str(d["tail"]).splitlines(keepends=True))
    return r
