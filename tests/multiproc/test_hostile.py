"""Hostile and broken input on the transports' set-up sockets: strangers, garbage, floods,
wrong keys and replayed handshakes get nothing, and the job still forms.

Rank 0 is a real process; rank 1 is this test (tests/ranks/impostor.py), which holds
the token like the launcher does. While rank 0 waits for rank 1's connections, the
test attacks rank 0's listener without the key, then connects honestly.
"""

from __future__ import annotations

import ast
import os
import socket
import struct
import warnings

import pytest

from tests.conftest import ALL_TRANSPORTS, run_ranks
from tests.ranks import impostor as imp


def _attacks_without_the_key(connect, link: str) -> dict:
    """What a stranger on the network can try; returns what each attempt got."""
    got: dict = {}
    wrong_key = os.urandom(32)
    idle = []
    # Half a hello, then silence -- more of them than the listener keeps (it drops the oldest).
    for _ in range(140):
        s = connect()
        s.send(imp.hello(link, 1, 0, 2, 0)[:10])
        idle.append(s)
    # Garbage and truncated or oversized messages.
    for name, payload in {
        "garbage": os.urandom(56),
        "zeros": b"\0" * 56,
        "long": os.urandom(3 << 20) if link == "tcp" else os.urandom(60000),
    }.items():
        s = connect()
        try:
            s.sendall(payload)
            got[name] = imp.challenge(s)[0]
        except (ConnectionError, OSError, AssertionError) as e:
            got[name] = type(e).__name__
        s.close()
    # Well-formed hellos the listener must refuse: wrong world size, wrong target, itself.
    for name, h in {
        "wrong_world": imp.hello(link, 1, 0, 3, 0),
        "wrong_server": imp.hello(link, 1, 5, 2, 0),
        "claims_rank_0": imp.hello(link, 0, 0, 2, 0),
    }.items():
        s = connect()
        s.sendall(h)
        got[name] = imp.challenge(s)[0]
        s.close()
    # A wrong key: the challenge comes, the proof cannot be made.
    s = connect()
    h = imp.hello(link, 1, 0, 2, 0)
    s.sendall(h)
    status, nonce, _ = imp.challenge(s)
    got["wrong_key_challenge"] = status  # a well-formed hello is answered: the server proves itself first
    s.sendall(imp.proof(imp.client_mac(wrong_key, h, nonce)))
    got["wrong_key"] = imp.welcome(s)
    s.close()
    return got | {"idle": idle}


def _replay(connect, key: bytes, link: str) -> int:
    """A handshake recorded on one connection, replayed on another: the proof was for another nonce."""
    h = imp.hello(link, 1, 0, 2, 0)
    first = connect()
    first.sendall(h)
    _, nonce, _ = imp.challenge(first)
    recorded = imp.proof(imp.client_mac(key, h, nonce))
    first.close()
    second = connect()
    second.sendall(h)
    imp.challenge(second)
    second.sendall(recorded)
    status = imp.welcome(second)
    second.close()
    return status


def _check_refusals(got: dict) -> None:
    assert got["wrong_world"] == imp.MALFORMED and got["wrong_server"] == imp.MALFORMED
    assert got["claims_rank_0"] == imp.MALFORMED
    assert got["wrong_key_challenge"] == imp.OK and got["wrong_key"] == imp.BAD_PROOF
    for name in ("garbage", "zeros", "long"):  # never a challenge: refused or dropped
        assert got[name] in (imp.MALFORMED, "ConnectionError", "ConnectionResetError", "BrokenPipeError"), got


def test_tcp_listener_refuses_strangers_and_replays_and_the_job_still_forms():
    job = imp.Job("tcp")
    rank0 = job.publish("tcp;host=127.0.0.1;port=1")  # rank 0 never dials rank 1 (higher ranks dial lower)
    connect = lambda: imp.connect_tcp(rank0)  # noqa: E731
    got = _attacks_without_the_key(connect, "tcp")
    _check_refusals(got)
    assert _replay(connect, job.key, "tcp") == imp.BAD_PROOF
    # Now the real rank 1 arrives (the idle strangers are still connected) and is let in on both sockets.
    honest = [connect(), connect()]
    for channel, s in enumerate(honest):
        assert imp.authenticate(s, job.key, "tcp", 1, 0, 2, channel) == imp.OK
    result = job.finish()
    for s in honest + got["idle"]:
        s.close()
    assert result.value == {"error": None}, result.output[-2000:]


def _as_nobody(descriptor: str) -> tuple:
    """Another local user (uid 65534) reaching rank 0's shm socket: the abstract namespace has no
    permissions, so it can connect. A forked child drops to nobody (the interpreter itself may not
    be readable by nobody) and reports through a pipe."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only uses sockets
        pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            got = {}
            for name, payload in {"garbage": os.urandom(56), "hello": imp.hello("shm", 1, 0, 2, 0)}.items():
                try:
                    s = imp.connect_unix(descriptor)
                    s.send(payload)
                    got[name] = s.recv(100).hex()  # "" when refused
                    s.close()
                except OSError as e:
                    got[name] = type(e).__name__
            os.write(w, repr((os.getuid(), got)).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return ast.literal_eval(f.read())


def test_shm_socket_refuses_other_users_and_strangers_and_the_job_still_forms():
    job = imp.Job("shm")
    rank0 = job.publish(f"shm;host={{host}};sock=none;pid={os.getpid()}")
    # Another local user connects and gets nothing, not even a challenge.
    uid, nobody = _as_nobody(rank0)
    assert uid == 65534 and set(nobody) == {"garbage", "hello"}
    assert all(v in ("", "ConnectionResetError", "BrokenPipeError") for v in nobody.values()), nobody
    # This user, without the key.
    connect = lambda: imp.connect_unix(rank0)  # noqa: E731
    got = _attacks_without_the_key(connect, "shm")
    _check_refusals(got)
    assert _replay(connect, job.key, "shm") == imp.BAD_PROOF
    # The honest rank 1: its arena goes with its proof, rank 0's comes with the welcome.
    s = connect()
    h = imp.hello("shm", 1, 0, 2, 0)
    s.sendall(h)
    status, nonce, mac = imp.challenge(s)
    assert status == imp.OK and mac == imp.server_mac(job.key, h, nonce)
    arena = imp.fake_arena()
    imp.send_with_fd(s, imp.proof(imp.client_mac(job.key, h, nonce)), arena)
    msg, fds, _, _ = socket.recv_fds(s, imp.WELCOME_BYTES, 1)
    assert struct.unpack("<II", msg) == (imp.MAGIC, imp.OK) and len(fds) == 1
    result = job.finish()
    for fd in (arena, *fds):
        os.close(fd)
    s.close()
    for c in got["idle"]:
        c.close()
    assert result.value == {"error": None}, result.output[-2000:]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_that_cannot_prove_the_key_is_refused_by_the_real_rank(transport):
    """The other direction: rank 0 is real, the impostor answers its own challenge with a wrong key."""
    job = imp.Job(transport)
    desc = "tcp;host=127.0.0.1;port=1" if transport == "tcp" else f"shm;host={{host}};sock=none;pid={os.getpid()}"
    rank0 = job.publish(desc)
    connect = (lambda: imp.connect_tcp(rank0)) if transport == "tcp" else (lambda: imp.connect_unix(rank0))
    s = connect()
    h = imp.hello(transport, 1, 0, 2, 0)
    s.sendall(h)
    _, nonce, mac = imp.challenge(s)
    # The real rank proves itself first, with a MAC only the key makes, bound to our hello and its nonce.
    assert mac == imp.server_mac(job.key, h, nonce)
    assert mac != imp.server_mac(job.key, imp.hello(transport, 1, 0, 2, 1, h[24:]), nonce)  # bound to the channel
    assert imp.client_mac(job.key, h, nonce) != mac  # a server's answer is not a client's proof
    s.sendall(imp.proof(mac))  # reflect its own MAC back
    assert imp.welcome(s) == imp.BAD_PROOF
    s.close()
    # ... and the real rank 1 still gets in afterwards.
    honest = connect()
    if transport == "tcp":
        assert imp.authenticate(honest, job.key, "tcp", 1, 0, 2, 0) == imp.OK
        other = connect()
        assert imp.authenticate(other, job.key, "tcp", 1, 0, 2, 1) == imp.OK
    else:
        h = imp.hello("shm", 1, 0, 2, 0)
        honest.sendall(h)
        _, nonce, _ = imp.challenge(honest)
        arena = imp.fake_arena()
        imp.send_with_fd(honest, imp.proof(imp.client_mac(job.key, h, nonce)), arena)
        _, fds, _, _ = socket.recv_fds(honest, imp.WELCOME_BYTES, 1)
        other = None
        for fd in (arena, *fds):
            os.close(fd)
    assert job.finish().value == {"error": None}
    honest.close()
    if other is not None:
        other.close()


def test_store_strangers_cannot_mark_a_rank_gone_or_hold_the_job():
    job = imp.Job("tcp")
    # While rank 0 waits for rank 1's endpoint: strangers claim rank 1, fail the MAC and reset;
    # others send a 1 GiB length, garbage, or JSON that is not an object.
    for i in range(60):
        imp.store_stranger(job.port, 1, ["wrong_mac_then_reset", "huge_frame", "garbage", "not_an_object"][i % 4])
    rank0 = job.publish("tcp;host=127.0.0.1;port=1")  # rank 0 still waits for rank 1: it was never "gone"
    honest = [imp.connect_tcp(rank0), imp.connect_tcp(rank0)]
    for channel, s in enumerate(honest):
        assert imp.authenticate(s, job.key, "tcp", 1, 0, 2, channel) == imp.OK
    assert job.finish().value == {"error": None}
    for s in honest:
        s.close()


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_the_rendezvous_store_holds_no_secret(transport):
    rank0 = run_ranks("store_holds_no_secret", 2, transport=transport)[0].value
    assert rank0["values"] > 4 and rank0["found"] == [], rank0


def test_a_flood_of_idle_store_connections_costs_no_threads_and_the_job_still_forms():
    job = imp.Job("tcp", target="connect_and_count_threads")
    idle, honest = [], []
    try:
        for _ in range(200):  # more than the store keeps: the oldest strangers are dropped
            idle.append(socket.create_connection(("127.0.0.1", job.port), timeout=10))
        # Rank 0's own connection may be one of the dropped: it connects again.
        rank0 = job.publish("tcp;host=127.0.0.1;port=1")
        honest = [imp.connect_tcp(rank0), imp.connect_tcp(rank0)]
        for channel, s in enumerate(honest):
            assert imp.authenticate(s, job.key, "tcp", 1, 0, 2, channel) == imp.OK
        result = job.finish()
    finally:
        for s in honest + idle:
            s.close()
    assert result.value["error"] is None, result.value
    assert result.value["threads"] < 10, result.value  # the store is one thread, whatever connects
