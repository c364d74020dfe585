"""The launcher's elastic agent deciding the next group, with bare store clients as its workers (no TensorFlow)."""

from __future__ import annotations

import json
import secrets
import threading

import pytest

from rdkeras.elastic import ElasticError, ElasticGroup
from rdkeras.elastic.protocol import ENDED, EXITED, NEXT, READY
from rdkeras.launch import free_port
from rdkeras.launch_agent import ElasticAgent
from rdkeras.rendezvous import LAUNCHER, Store

TOKEN = secrets.token_bytes(16)
HEX = secrets.token_hex(16).encode()  # (a replacement is handed the token in its environment)


def _job(world: int, min_workers: int) -> tuple[ElasticAgent, list[Store]]:
    agent = ElasticAgent("127.0.0.1", free_port(), TOKEN, world, min_workers, reform_timeout=5.0)
    stores = [Store(r, world, "127.0.0.1", agent.store.port, TOKEN, 10.0, serve=False) for r in range(world)]
    return agent, stores


def _ready_and_wait(stores: dict[int, Store], steps: dict[int, int]) -> dict[int, dict]:
    """Each survivor says it is ready with its steps and waits for the next group, as ElasticGroup does."""
    answers: dict[int, dict] = {}

    def one(rank: int) -> None:
        store = stores[rank]
        store.set(f"{READY}{rank}", json.dumps({"steps": steps[rank]}).encode())
        (raw,) = store.get([NEXT], timeout=10, despite_failure=True)
        answers[rank] = json.loads(raw)

    threads = [threading.Thread(target=one, args=(r,)) for r in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return answers


def _vanish(store: Store) -> None:
    store._sock.close()  # a process killed: no goodbye


def test_the_survivors_form_the_next_group_and_take_the_most_advanced_state():
    agent, stores = _job(3, 2)
    try:
        _vanish(stores[1])
        answers = _ready_and_wait({0: stores[0], 2: stores[2]}, {0: 5, 2: 6})
        assert answers[0] == answers[2]
        decided = answers[0]
        assert decided["generation"] == 1 and decided["members"] == [0, 2] and decided["lost"] == [1]
        assert decided["source"] == 1 and decided["steps"] == 6  # worker 2, new rank 1, applied one step more
        # The next generation's store takes exactly the survivors, as ranks 0 and 1 of 2.
        nxt = [Store(r, 2, "127.0.0.1", decided["port"], TOKEN, 10.0, serve=False) for r in range(2)]
        nxt[0].set("x", b"1")
        assert nxt[1].get(["x"], timeout=5) == [b"1"]
        assert agent.members == [0, 2] and agent.generation == 1 and agent.error is None
        for s in nxt:
            s.close()
    finally:
        for s in (stores[0], stores[2]):
            s.close()
        agent.close()


def test_fewer_survivors_than_min_workers_end_the_job_naming_the_lost():
    agent, stores = _job(3, 3)
    try:
        agent.exited(1, -9)
        _vanish(stores[1])
        answers = _ready_and_wait({0: stores[0], 2: stores[2]}, {0: 4, 2: 4})
        assert answers[0] == answers[2] == {"error": agent.error, "blamed": 1}  # (each survivor reports it)
        assert "lost worker 1 (killed by signal 9): 2 left, fewer than --min-workers 3" in str(agent.error)
    finally:
        for s in (stores[0], stores[2]):
            s.close()
        agent.close()


def test_another_nodes_launcher_posts_how_its_worker_ended_and_learns_that_the_job_ended():
    """What launch_elastic's follower does: the agent names the cause it posted, not the dropped connection."""
    agent, stores = _job(3, 3)
    other = Store(LAUNCHER, 3, "127.0.0.1", agent.store.port, TOKEN, 10.0, serve=False)
    try:
        assert other.peek(ENDED) is None
        _vanish(stores[2])
        other.set(f"{EXITED}2", b"-9")
        answers = _ready_and_wait({0: stores[0], 1: stores[1]}, {0: 4, 1: 4})
        assert answers[0]["blamed"] == 2
        assert "lost worker 2 (killed by signal 9): 2 left, fewer than --min-workers 3" in str(agent.error)
        assert other.peek(ENDED) == str(agent.error).encode()
    finally:
        for s in (other, stores[0], stores[1]):
            s.close()
        agent.close()


def test_a_failed_worker_still_connected_is_not_replaced():
    agent, stores = _job(3, 2)
    try:
        stores[0].abort(1, "rank 1 stalled: no heartbeat within 2 s")  # what a survivor's engine saw
        answers = _ready_and_wait({0: stores[0], 2: stores[2]}, {0: 4, 2: 4})
        assert "worker 1 failed but is still running (rank 1 stalled" in answers[0]["error"]
        assert answers[0]["blamed"] == answers[2]["blamed"] == 1
    finally:
        for s in stores:
            s.close()
        agent.close()


def test_a_survivor_of_a_job_that_ends_reports_whom_the_launcher_blamed(tmp_path, monkeypatch):
    """So its launcher waits no longer for its teardown than for any worker's that said why it stops."""
    monkeypatch.setenv("RDKERAS_REPORT_DIR", str(tmp_path))
    error = "worker 1 failed but is still running (rank 1 has not entered allreduce #19 (ring grads); ...)"
    with pytest.raises(ElasticError, match="worker 1 failed but is still running"):
        ElasticGroup(7, 2)._start({"error": error, "blamed": 1}, TOKEN, "127.0.0.1", {}, 0.0)
    report = json.loads((tmp_path / "failure-7.json").read_text())
    assert (report["rank"], report["blamed"], report["why"]) == (7, 1, error)


def test_min_workers_must_fit_the_job():
    with pytest.raises(ValueError, match=r"min_workers must be in 1\.\.2"):
        ElasticAgent("127.0.0.1", free_port(), TOKEN, 2, 3)


def test_only_the_job_token_opens_the_lobby():
    from rdkeras.errors import AuthenticationError

    agent = ElasticAgent("127.0.0.1", free_port(), TOKEN, 2, 1, max_restarts=1)
    try:
        assert agent.lobby is not None
        with pytest.raises(AuthenticationError, match="token"):
            Store(2, 3, "127.0.0.1", agent.lobby.port, secrets.token_bytes(16), 5.0, serve=False)
        joiner = Store(2, 3, "127.0.0.1", agent.lobby.port, TOKEN, 5.0, serve=False)  # the job's own replacement
        joiner.close()
    finally:
        agent.close()


def _wait_for(condition, seconds: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def _spawned(agent: ElasticAgent) -> list[int]:
    """The replacements the agent asks for, as the launcher polls them: the agent queues them just after it
    publishes the next group, which the survivors may hear of first."""
    spawns: list = []
    _wait_for(lambda: spawns.extend(agent.take_spawns({})) or spawns)
    return [worker for worker, _ in spawns]


def _lose_worker_one(agent: ElasticAgent, stores: list[Store]) -> dict:
    agent.exited(1, -9)
    _vanish(stores[1])
    return _ready_and_wait({0: stores[0], 2: stores[2]}, {0: 4, 2: 4})[0]


def test_an_announced_replacement_that_dies_is_reported_and_the_waiting_group_re_forms_as_it_was():
    agent = ElasticAgent("127.0.0.1", free_port(), HEX, 3, 2, reform_timeout=5.0, max_restarts=1)
    stores = [Store(r, 3, "127.0.0.1", agent.store.port, HEX, 10.0, serve=False) for r in range(3)]
    nxt: list[Store] = []
    lobby = None
    try:
        decided = _lose_worker_one(agent, stores)
        assert _spawned(agent) == [3]
        lobby = Store(3, 4, "127.0.0.1", agent.lobby.port, HEX, 10.0, serve=False)
        lobby.set("joining/3", b"1")  # worker 3 reached the lobby: the agent announces it to the group
        nxt = [Store(r, 2, "127.0.0.1", decided["port"], HEX, 10.0, serve=False) for r in range(2)]
        _wait_for(lambda: agent.store.value("elastic/joiners") is not None)
        agent.exited(3, 1)  # ... and dies before the group's epoch end
        assert agent.unjoined == {
            3: "(started for lost worker 1) never joined the group: it exited before joining (exit code 1)"
        }
        again = _ready_and_wait(dict(enumerate(nxt)), {0: 8, 1: 8})  # the group, at its epoch end
        assert again[0] == again[1] and again[0]["members"] == [0, 2] and again[0]["joined"] == []
        assert len(agent.changes) == 1 and agent.error is None  # (not a change: nobody came or went)
    finally:
        for s in [stores[0], stores[2], *nxt, *([lobby] if lobby else [])]:
            s.close()
        agent.close()


def test_a_replacement_that_misses_the_join_timeout_is_told_not_to_join_and_reported():
    agent = ElasticAgent("127.0.0.1", free_port(), HEX, 3, 2, reform_timeout=5.0, max_restarts=1, join_timeout=0.3)
    stores = [Store(r, 3, "127.0.0.1", agent.store.port, HEX, 10.0, serve=False) for r in range(3)]
    lobby = None
    said: list[str] = []
    agent.say = said.append
    try:
        _lose_worker_one(agent, stores)
        assert _spawned(agent) == [3]
        _wait_for(lambda: 3 in agent.unjoined)
        assert agent.unjoined[3] == ("(started for lost worker 1) never joined the group: it did not reach the lobby "
                                     "within 0.3 s of its start (--join-timeout); it was told not to join")  # fmt: skip
        assert said == [f"elastic: replacement worker 3 {agent.unjoined[3]}; 2 workers go on"]
        # Arriving late, it is told so at once.
        lobby = Store(3, 4, "127.0.0.1", agent.lobby.port, HEX, 10.0, serve=False)
        lobby.set("joining/3", b"1")
        (raw,) = lobby.get(["admit/3"], timeout=5, despite_failure=True)
        assert json.loads(raw) == {"error": "worker 3 did not reach the lobby within 0.3 s of its start "
                                            "(--join-timeout): the group went on without it"}  # fmt: skip
    finally:
        for s in [stores[0], stores[2], *([lobby] if lobby else [])]:
            s.close()
        agent.close()
