"""One verdict across nodes (rdkeras.launch_nodes): node 0's launcher merges every node's ends into the job's
verdict, the others print it and exit with its status, and a launcher that cannot reach node 0's says so."""

from __future__ import annotations

import threading
import time

from rdkeras import launch_nodes
from rdkeras._workers import RankResult
from rdkeras.launch import Job, free_port

WHY = "it was killed by signal 9 (seen by node 1's launcher)"


def _env(job: Job, **more: str) -> dict[str, str]:
    return {"RDKERAS_RANK": str(job.ranks[0]), "RDKERAS_WORLD_SIZE": str(job.world_size),
            "RDKERAS_MASTER_ADDR": job.master_addr, "RDKERAS_MASTER_PORT": str(job.master_port),
            "RDKERAS_JOB_TOKEN": "a-shared-test-token", "RDKERAS_RENDEZVOUS_TIMEOUT": "5", **more}  # fmt: skip


def _lost(rank: int, ended: float) -> RankResult:
    """A live rank that lost rank 3 and said so."""
    report = {"rank": rank, "blamed": 3, "reporter": rank, "why": "rank 3 failed: " + WHY, "time": time.time()}
    return RankResult(rank, 1, "", ended_at=ended, report=report)


def test_the_launcher_without_the_victim_names_it_and_both_exit_alike():
    port = free_port()
    jobs = [Job(2, 2, node, "127.0.0.1", port) for node in (0, 1)]
    now = time.monotonic()
    victim = RankResult(3, -9, "", ended_at=now - 1.0)
    victim.tail.extend(["step 41\n", "step 42\n"])
    ends = {0: [_lost(0, now), _lost(1, now)], 1: [_lost(2, now - 0.5), victim]}
    nodes = [launch_nodes.NodeVerdict(job, _env(job)) for job in jobs]
    nodes[1].exited(3, -9)  # (told to the store once node 1's launcher reached it: here, maybe not yet)
    decided: dict[int, tuple[int, list[str]]] = {}
    threads = [threading.Thread(target=lambda n=n: decided.__setitem__(n, nodes[n].decide(ends[n]))) for n in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for n in nodes:
            n.close()
    assert decided[0] == decided[1], decided
    status, lines = decided[0]
    assert status == 1
    assert lines[0].startswith("worker rank 3 failed first (rank 3 failed: it was killed by signal 9"), lines[0]
    assert lines[0].endswith("its last output:\nstep 41\nstep 42"), lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["rank 0", "rank 1", "rank 2", "rank 3"]


def test_a_launcher_that_cannot_reach_node_0s_prints_its_own_verdict_and_says_so():
    job = Job(2, 2, 1, "127.0.0.1", free_port())  # nobody listens there
    node = launch_nodes.NodeVerdict(job, _env(job, RDKERAS_RENDEZVOUS_TIMEOUT="1"))
    try:
        began = time.monotonic()
        status, lines = node.decide([RankResult(2, 0, "", ended_at=time.monotonic()),
                                     RankResult(3, -9, "", ended_at=time.monotonic())])  # fmt: skip
    finally:
        node.close()
    assert time.monotonic() - began < launch_nodes.ACK_WAIT_S + 2
    assert status == 1
    assert lines[0].startswith("no verdict from node 0's launcher (could not reach the job's store at 127.0.0.1:")
    assert lines[0].endswith("this is node 1's own, from its workers alone"), lines[0]
    assert lines[1].startswith("worker rank 3 failed first (signal 9)"), lines[1]


def test_node_0s_launcher_does_not_wait_long_for_a_launcher_that_is_gone(monkeypatch):
    monkeypatch.setattr(launch_nodes, "GONE_S", 0.5)
    job = Job(2, 2, 0, "127.0.0.1", free_port())  # node 1's launcher never connects
    node = launch_nodes.NodeVerdict(job, _env(job))
    try:
        began = time.monotonic()
        status, lines = node.decide([_lost(0, time.monotonic()), _lost(1, time.monotonic())])
    finally:
        node.close()
    assert time.monotonic() - began < 5
    assert status == 1
    assert lines[0].startswith("worker rank 3 failed first (rank 3 failed: it was killed by signal 9 "), lines
    assert lines[4] == "rank 3: not known: node 1's launcher did not report", lines
    assert lines[-1].startswith("node 1's launcher did not report (gone, or still waiting for its workers)"), lines
