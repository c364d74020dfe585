"""One-process tests: the tracker, a world of one, and clear errors for bad input."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import numpy as np
import pytest

import rdkeras
from rdkeras import _engine
from rdkeras.errors import EngineError


@pytest.fixture(scope="module")
def solo():
    eng = rdkeras.Engine(rank=0, world_size=1, transport="shm", timeout=5, arena_bytes=1 << 30)
    yield eng
    eng.close()


def test_size_classes_have_bounded_slack():
    for n in [0, 1, 63, 64, 65, 1000, 4096, 4097, 1 << 20, (1 << 20) + 1, 3 * 10**7]:
        c = _engine.size_class(n)
        assert c >= n and c % 64 == 0
        assert c <= n + max(64, n / 4), (n, c)  # quarter steps between powers of two, 64-byte granules
    with pytest.raises(EngineError, match=r"cannot allocate 18446744073709551608 bytes: more than any arena holds"):
        _engine.size_class(2**64 - 8)  # its rounding would wrap around to 0


def test_empty_is_aligned_registered_memory_and_reused(solo):
    before = solo.counters()
    a = solo.empty((1000, 3), np.float32)
    assert a.shape == (1000, 3) and a.dtype == np.float32
    assert a.ctypes.data % 64 == 0
    addr = a.ctypes.data
    del a
    b = solo.empty((1000, 3), np.float32)  # same size class: the freed block comes back
    assert b.ctypes.data == addr
    after = solo.counters()
    assert after["pool_reuses"] == before["pool_reuses"] + 1
    assert after["registrations"] == before["registrations"]


def test_registration_cache_hits_for_pool_and_external_memory(solo):
    pool = solo.empty(1 << 16)
    user = np.zeros(1 << 16, np.uint8)
    first = [solo.backend.lookup_or_register(pool[100:200]), solo.backend.lookup_or_register(user[10:20])]
    before = solo.counters()
    again = [solo.backend.lookup_or_register(pool[100:200]), solo.backend.lookup_or_register(user[10:20])]
    after = solo.counters()
    assert again == first
    assert first[0][1] == 100 and first[1][1] == 0  # offsets inside the registered range
    assert after["registrations"] == before["registrations"]
    assert after["cache_hits"] == before["cache_hits"] + 2


def test_deregistering_an_unknown_key_is_an_error(solo):
    key = solo.register(np.zeros(16, np.uint8))
    solo.deregister(key)
    with pytest.raises(rdkeras.EngineError, match="no region"):
        solo.deregister(key)


def test_channel_to_self_is_refused(solo):
    with pytest.raises(ValueError, match="connects ranks"):
        solo.static_channel("x", 0, 0, (1,), "float32")


def test_unknown_transport_is_named():
    listed = r"choose one of auto, shm, tcp, shm\+tcp, verbs, grpc"
    with pytest.raises(ValueError, match=rf"unknown transport 'carrier-pigeon'; {listed}"):
        rdkeras.Engine(rank=0, world_size=1, transport="carrier-pigeon")


def test_multi_rank_needs_a_token(monkeypatch):
    monkeypatch.delenv("RDKERAS_JOB_TOKEN", raising=False)
    with pytest.raises(rdkeras.EngineError, match="RDKERAS_JOB_TOKEN"):
        rdkeras.Engine(rank=0, world_size=2, master_port=1)


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank 3 is not in a world of size 2"):
        rdkeras.Engine(rank=3, world_size=2)


def test_errors_form_a_hierarchy():
    assert issubclass(rdkeras.TimeoutError, rdkeras.EngineError)
    assert issubclass(rdkeras.TimeoutError, TimeoutError)
    assert issubclass(rdkeras.PeerError, ConnectionError)
    assert issubclass(rdkeras.AuthenticationError, rdkeras.EngineError)


class _DLPackOnly:
    """A tensor that speaks only DLPack (like a TF/PyTorch/JAX CPU tensor)."""

    def __init__(self, array):
        self._a = array

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_tensors_go_in_without_a_copy(solo):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = rdkeras.engine.as_buffer(_DLPackOnly(a))
    assert np.shares_memory(view, a)
    key = solo.register(_DLPackOnly(a))  # accepted where a buffer is expected
    solo.deregister(key)


def test_engine_memory_goes_out_through_dlpack(solo):
    a = solo.empty((4, 4), np.float64)
    a[:] = 3.0
    b = np.from_dlpack(a)
    assert np.shares_memory(a, b) and b.ctypes.data % 64 == 0


def test_verbs_explains_why_it_is_not_viable():
    if not _engine.verbs_why_not_viable():
        pytest.skip("verbs is viable on this machine: the conformance tests run over it")
    with pytest.raises(rdkeras.EngineError, match=r"transport='verbs' is not viable here: .*rdkeras doctor"):
        rdkeras.Engine(rank=0, world_size=1, transport="verbs")


def test_doctor_reports_every_transport(capsys):
    from rdkeras import cli

    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for line in ("shm    viable", "tcp    viable", "grpc   viable", "verbs  not viable: "):
        assert line in out, out
    assert "transport=auto would pick: shm" in out


def test_doctor_leaves_tensorflows_start_up_lines_out(capfd):
    # TensorFlow prints these from C++ to fd 2 while it loads (twice: once per library), whatever the log level.
    from rdkeras import doctor

    with doctor._without_banners():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")
        os.write(2, b"E0000 00:00:1.0 1 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n")
        os.write(2, b"something else TensorFlow says\n")
    assert capfd.readouterr().err == "something else TensorFlow says\n"


@pytest.mark.parametrize("transport", ["shm", "tcp", "shm+tcp", "grpc"])
def test_every_backend_implements_the_one_interface(transport):
    from rdkeras.transports.base import Backend, Ring

    with rdkeras.Engine(rank=0, world_size=1, transport=transport, timeout=5, arena_bytes=1 << 28) as eng:
        assert isinstance(eng.backend, Backend), type(eng.backend)
        ring = eng.backend.ring(1 << 10, 1 << 10, [0])
        assert isinstance(ring, Ring), type(ring)
        out = eng.ring("one", 1 << 10)([np.arange(4, dtype=np.float32)], True)
        assert np.array_equal(out[0], np.arange(4, dtype=np.float32))  # a ring of one is the identity


def test_every_native_transport_of_the_build_is_made_from_its_one_table():
    from rdkeras import transports

    listed = _engine.native_transports()
    assert set(listed) <= set(transports.names())  # the registry offers every one
    for name in listed:
        if transports.get(name).why_not_viable():
            continue  # compiled in, but not usable here (verbs without a device)
        _engine.Engine(0, 1, name, 1 << 26, 5.0).close()
    with pytest.raises(rdkeras.EngineError, match="unknown or unavailable native transport 'grpc'"):
        _engine.Engine(0, 1, "grpc", 1 << 26, 5.0)


def test_overlap_is_off_where_this_process_copies_the_bytes(monkeypatch):
    import sys

    from rdkeras import transports
    from rdkeras.parallel import collectives

    assert {n for n in transports.names() if transports.get(n).capabilities.copies_on_own_cores} == {"shm", "rpc+shm"}
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)  # no TensorFlow compute here, so no GPU
    on = collectives.BUCKET_BYTES
    of = lambda name, *hierarchical: collectives.overlap_bytes(transports.get(name).capabilities, *hierarchical)  # noqa: E731
    assert [of(n) for n in ("shm", "rpc+shm", "tcp", "rpc+tcp", "grpc")] == [0, 0, on, on, on]
    # Across hosts, the hierarchical allreduce runs once after backprop (its passes pipeline inside the call).
    assert [of("shm+tcp"), of("shm+tcp", True)] == [on, 0]


def test_the_face_has_no_transport_branch():
    import inspect

    import rdkeras.engine

    source = inspect.getsource(rdkeras.engine)
    for name in ("grpc", "shm", "tcp", "verbs"):
        assert f'== "{name}"' not in source and f"== '{name}'" not in source, name


def test_transport_options_come_from_the_environment_once_at_the_face():
    from rdkeras import options

    env = {"RDKERAS_IB_DEVICE": "mlx5_1", "RDKERAS_IB_PORT": "2", "RDKERAS_IB_GID_INDEX": "3"}
    o = options.from_env(env | {"RDKERAS_NT_THRESHOLD": "0"}).transport_options
    assert (o.ib_device, o.ib_port, o.ib_gid_index, o.nt_threshold) == ("mlx5_1", 2, 3, 0)
    assert options.from_env({}).transport_options.nt_threshold == 8 << 20
    with pytest.raises(ValueError, match="RDKERAS_IB_PORT='x' is not a whole number"):
        options.from_env({"RDKERAS_IB_PORT": "x"})
    with pytest.raises(ValueError, match="RDKERAS_NT_THRESHOLD=-1 must not be negative"):
        options.from_env({"RDKERAS_NT_THRESHOLD": "-1"})
    # ... and nothing in the C++ engine reads the environment itself.
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    readers = [str(p) for p in csrc.rglob("*.cc") if "getenv" in p.read_text()]
    assert readers == [], readers


def test_register_keeps_the_array_alive_and_refuses_read_only_memory(solo):
    a = np.zeros(4096, np.uint8)
    alive = weakref.ref(a)
    key = solo.register(a)
    del a
    gc.collect()
    assert alive() is not None  # a peer may still write into it
    solo.deregister(key)
    gc.collect()
    assert alive() is None
    with pytest.raises(ValueError, match="read-only"):
        solo.register(np.frombuffer(b"x" * 64, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        solo.register(b"immutable")


def test_wait_flag_refuses_flags_outside_the_buffer(solo):
    buf = solo.empty(64)
    for offset in (60, 64, 1 << 62, (1 << 64) - 8):
        with pytest.raises((ValueError, OverflowError), match=r"offset|int"):
            solo.wait_flag(buf, offset, 1, 0)
    with pytest.raises(ValueError, match="aligned"):
        solo.wait_flag(buf[1:], 0, 1, 0)


def test_absurd_sizes_get_clear_errors(solo):
    with pytest.raises(rdkeras.EngineError, match="RDKERAS_ARENA_BYTES"):
        solo.empty(1 << 50)
    with pytest.raises(ValueError, match="negative"):
        solo.empty((4, -1))
    with pytest.raises(rdkeras.EngineError, match="RDKERAS_ARENA_BYTES"):
        rdkeras.Engine(rank=0, world_size=1, transport="shm", arena_bytes=1 << 62)
    with pytest.raises(ValueError, match="capacity_bytes"):
        solo.ring("bad", -1)


def test_use_after_close_is_an_error():
    eng = rdkeras.Engine(rank=0, world_size=1, transport="shm", timeout=5, arena_bytes=1 << 28)
    eng.close()
    with pytest.raises(rdkeras.EngineError, match="closed"):
        eng.ring("late", 1024)
    with pytest.raises(rdkeras.EngineError, match="closed"):
        eng.write(0, np.zeros(8, np.uint8), 1)
    eng.close()  # twice is fine


def test_a_taken_rendezvous_port_is_named():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(rdkeras.EngineError, match=rf"127.0.0.1:{port}.*RDKERAS_MASTER_PORT"):
            rdkeras.Engine(rank=0, world_size=2, master_port=port, token="t", timeout=5)


def test_channel_ranks_outside_the_world_are_refused(solo):
    with pytest.raises(ValueError, match="rank 5 is not in a world of 1"):
        solo.static_channel("far", 0, 5, (1,), "float32")


@pytest.mark.parametrize(
    ("hosts", "facts", "chosen"),
    [
        (["a", "a"], ["", ""], "shm"),
        (["a", "b"], ["", ""], "tcp"),  # one rank per host: nothing for shm to carry
        (["a", "a", "b", "b"], ["", "", "", ""], "shm+tcp"),
        (["a", "a", "b"], ["verbs", "verbs", "verbs"], "verbs"),
        (["a", "a", "b"], ["verbs", "", "verbs"], "shm+tcp"),  # verbs must be viable on every rank
    ],
)
def test_auto_takes_shm_within_a_host_and_tcp_between_hosts(hosts, facts, chosen):
    from rdkeras import transports

    assert transports.choose_auto(hosts, facts)[0] == chosen


@pytest.mark.parametrize("size", [0, 1, 127, 128, 4 * 4096 - 1, 4 * 4096 + 129, 3 * (1 << 20) + 17])
@pytest.mark.parametrize("shift", [0, 1, 63])
def test_streaming_copy_moves_every_byte_and_none_past_the_end(size, shift):
    from rdkeras import _engine

    rng = np.random.default_rng(size + shift)
    src = rng.integers(0, 256, size + 64, np.uint8)
    dst = np.zeros(size + 128, np.uint8)
    _engine.memcpy(dst[shift : shift + size], src[shift : shift + size], True)  # type: ignore[arg-type]
    assert np.array_equal(dst[shift : shift + size], src[shift : shift + size])
    assert not dst[:shift].any() and not dst[shift + size :].any()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_timeout_that_cannot_end_a_wait_is_refused_naming_it(timeout):
    with pytest.raises(ValueError, match=r"timeout=.*: a wait needs a finite number of seconds > 0"):
        rdkeras.Engine(0, 1, transport="shm", timeout=timeout)


def test_the_rdkeras_command_runs_each_entry_point_by_name(tmp_path):
    # `rdkeras train|launch|bench ARGS` is `python -m rdkeras.train|launch|bench ARGS`, help and errors included.
    import shutil
    import subprocess

    exe = shutil.which("rdkeras")
    assert exe is not None, "the rdkeras console script is installed with the package"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)

    bench = run("bench", "--help")
    assert (
        bench.returncode == 0
        and "{sendrecv,allreduce,algorithms,fit,pipeline,paper,hosts,elastic,embedding,memory,remat}" in bench.stdout
    )
    launch = run("launch", "--help")
    assert launch.returncode == 0 and "-n PER_NODE" in launch.stdout
    train = run("train", "trainer.epoch=1", f"hydra.run.dir={tmp_path}")
    assert train.returncode == 2 and "did you mean trainer.epochs?" in train.stderr, train.stderr
    unknown = run("nope")
    assert unknown.returncode == 2 and "choose from 'train', 'launch', 'bench', 'doctor'" in unknown.stderr


def test_exchange_ops_count_their_seconds_failures_too(solo):
    import time

    from rdkeras.parallel.collectives import timed_exchange

    before = solo.traffic()["exchange_seconds"]
    assert timed_exchange(lambda x: (time.sleep(0.02), x)[1], lambda: solo)(7) == 7

    def fails():
        time.sleep(0.01)
        raise ValueError("peer gone")

    with pytest.raises(ValueError, match="peer gone"):
        timed_exchange(fails, lambda: solo)()
    assert 0.03 <= solo.traffic()["exchange_seconds"] - before < 1.0
