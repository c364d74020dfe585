"""Data-parallel model.fit: N workers with global batch B == one process with batch B, also with the gradients
exchanged in buckets as backprop produces them (overlap), which is bit-identical to one exchange."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import VERBS, launch_in_turn, run_ranks

TARGET = "tests.ranks.keras_workers"
OVERLAP = "tests.ranks.overlap_workers"
# The module fixtures below run several tests' trainings in one launch.
pytestmark = pytest.mark.timeout(900)
# MLP and CNN over shm, the MLP over tcp and an RPC baseline, each with ring allreduce and parameter servers (the
# model and the transport are independent; -m slow adds the CNN over tcp and the MLP over rpc+tcp).
CONFIGS = [[k, "shm", m] for k in ("mlp", "cnn") for m in ("allreduce", "ps")]
CONFIGS += [["mlp", t, m] for t in ("tcp", "rpc+shm") for m in ("allreduce", "ps")]
MORE_CONFIGS = [["cnn", "tcp", m] for m in ("allreduce", "ps")] + [["mlp", "rpc+tcp", m] for m in ("allreduce", "ps")]
# Overlap: 64-byte buckets make every gradient tensor a bucket of its own (the MLP has 6, the CNN 4); 0: one
# exchange.
BUCKETED = [[k, m, o] for k in ("mlp", "cnn") for m in ("allreduce", "ps") for o in (64, 0)]


def _run(target: str, world_size: int, transport: str, **kwargs):
    return run_ranks(target, world_size, transport=transport, timeout=240, module=TARGET, **kwargs)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """The 2-worker runs of the tests here, one after another in one launch (TensorFlow imports once a worker)."""
    jobs = {
        "global batch": (f"{TARGET}:fit_model_many", {"configs": CONFIGS, "batch": 16}),
        "per-worker batch": (f"{TARGET}:fit_model", {"kind": "mlp", "batch": 8, "global_batch": False}),
        "mlp in one process": (f"{TARGET}:fit_model", {"kind": "mlp", "batch": 16, "distributed": False}),
        "callbacks": (f"{TARGET}:fit_callbacks", {"checkpoint_dir": str(tmp_path_factory.mktemp("checkpoints"))}),
        "tensorboard": (f"{TARGET}:fit_with_stats", {"log_dir": str(tmp_path_factory.mktemp("tensorboard"))}),
        "two transports": (
            f"{TARGET}:fit_over_transports",
            {"runs": [["shm", "allreduce"], ["tcp", "allreduce"]], "kind": "mlp", "batch": 16},
        ),
        "buckets": (f"{OVERLAP}:fit_bucketed_many", {"configs": BUCKETED, "batch": 16}),
    }
    return launch_in_turn(jobs, 2, timeout=900)


@pytest.fixture(scope="module")
def three_workers():
    """The 3-worker runs, in one launch."""
    jobs = {
        "three workers": (
            f"{TARGET}:fit_model_many",
            {"configs": [["mlp", "shm", "allreduce"], ["mlp", "shm", "ps"]], "batch": 24},
        ),
        "buckets over tcp": (
            f"{OVERLAP}:fit_bucketed_many",
            {"configs": [["mlp", "allreduce", 200], ["mlp", "ps", 200]], "batch": 24},
            {"RDKERAS_TRANSPORT": "tcp"},
        ),
    }
    return launch_in_turn(jobs, 3, timeout=900)


def test_fit_matches_single_process_with_global_batch(two_workers):
    _check_global_batch(two_workers("global batch"), CONFIGS)


@pytest.mark.slow
def test_fit_matches_single_process_in_the_other_configurations():
    results = run_ranks("fit_model_many", 2, module=TARGET, timeout=600, configs=MORE_CONFIGS, batch=16)
    _check_global_batch(results, MORE_CONFIGS)


def _check_global_batch(results, configs):
    # Every configuration: 2 workers with global batch 16 end with the weights one process reaches with batch 16.
    for kind, transport, mode in configs:
        key = f"{kind}/{transport}/{mode}"
        runs = [r.value[key] for r in results]
        assert runs[0]["transport"] == transport
        for got, want in zip(runs[0]["weights"], results[0].value[f"{kind}/reference"]["weights"], strict=True):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5, err_msg=key)
        # Every worker ends with bit-identical weights and reports the same evaluation.
        assert runs[1]["weights"] == runs[0]["weights"] and runs[1]["evaluate"] == runs[0]["evaluate"], key


@pytest.mark.extended  # (odd worker counts: the default run's 3-member collectives and 4-worker checkpoint)
def test_three_workers_match_too(three_workers):
    results = three_workers("three workers")
    for key in ("mlp/shm/allreduce", "mlp/shm/ps"):
        for got, want in zip(
            results[2].value[key]["weights"], results[0].value["mlp/reference"]["weights"], strict=True
        ):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5, err_msg=key)
        assert results[0].value[key] == results[1].value[key] == results[2].value[key]


def test_per_worker_batches_on_request(two_workers):
    # Horovod's convention, asked for explicitly: batch_size is per worker, the global batch N x that.
    results, reference = two_workers("per-worker batch"), two_workers("mlp in one process")[0].value
    for got, want in zip(results[0].value["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_callbacks_see_metrics_averaged_over_workers(two_workers):
    results, tmp_path = two_workers("callbacks"), Path(two_workers.kwargs["callbacks"]["checkpoint_dir"])
    a, b = results[0].value, results[1].value
    assert a["loss"] == b["loss"]  # averaged epoch logs, identical on both workers
    assert 1 < len(a["loss"]) < 30  # EarlyStopping fired ...
    assert a["stopped_epoch"] == b["stopped_epoch"] > 0  # ... at the same epoch everywhere
    assert a["lr"] == b["lr"] < 0.05  # ReduceLROnPlateau agreed too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.keras"]  # checkpoints on the chief only


def _scalars(folder):
    """Every series in a TensorBoard log folder (floats; the plan as text), read by rdkeras's reader."""
    from rdkeras.train.tbplot import read_run

    return {tag: [v for _, v in values] for tag, values in read_run(folder).items()}


def test_tensorboard_shows_throughput_and_traffic(two_workers):
    results, tmp_path = two_workers("tensorboard"), Path(two_workers.kwargs["tensorboard"]["log_dir"])
    assert [p.name for p in tmp_path.iterdir()] == ["rdkeras"]  # the chief alone writes
    scalars = _scalars(tmp_path / "rdkeras")
    steps = 2 * 96 // 16  # 2 epochs of 6 steps
    for tag in (
        "throughput/batches_per_s",
        "throughput/examples_per_s",
        "comm/bytes_sent",
        "comm/bytes_received",
        "comm/wait_ms",
        "tracker/registrations",
    ):
        assert len(scalars[tag]) == steps, (tag, scalars.get(tag))
    grads = (12 * 16 + 16 + 16 * 8 + 8 + 8 * 3 + 3) * 4  # bytes of float32 gradients
    # A 2-worker ring sends half the gradients twice (reduce-scatter + allgather) per step (+ padding).
    sent = scalars["comm/bytes_sent"][2:]
    assert all(grads <= s <= grads + 64 * 8 for s in sent), sent
    # ... and receives as much: the neighbour's halves, written straight into this worker's memory.
    received = scalars["comm/bytes_received"][2:]
    assert all(grads <= r <= grads + 64 * 8 for r in received), received
    regs = scalars["tracker/registrations"]
    assert regs[-1] == regs[steps // 2]  # the second epoch registers nothing (the first set rings up)
    # The time between the epochs (the epoch-end metric averaging, callbacks) is not the next step's.
    (boundary,) = scalars["epoch_boundary/seconds"]
    (boundary_wait,) = scalars["epoch_boundary/wait_ms"]
    assert boundary > 0 and 0 <= boundary_wait <= boundary * 1e3
    assert results[0].value["traffic"]["bytes_written"] > 0
    (plan,) = scalars["plan"]  # written once, as text
    # A small model's gradients go by recursive doubling (auto, below the transport's crossover): with 2 workers
    # each sends all of them once -- the same bytes as the ring's two halves.
    assert f"a recursive-doubling allreduce of {grads:,} gradient bytes (ring (1 host x 2 workers: one host); " in plan


@pytest.mark.parametrize("transport", [VERBS])
def test_verbs_training_matches_shm_bit_for_bit(transport):
    # Runs where an RDMA device exists: inside the SoftRoCE VM (tests/verbs/test_in_vm.py).
    # Both trainings in the same two processes: TensorFlow takes a minute to import there.
    runs = [[t, mode] for mode in ("allreduce", "ps") for t in (transport, "shm")]
    results = _run("fit_over_transports", 2, "shm", runs=runs, kind="mlp", batch=16)
    for r in results:
        assert sorted(r.value) == ["shm/allreduce", "shm/ps", "verbs/allreduce", "verbs/ps"]
        for mode in ("allreduce", "ps"):
            assert r.value[f"verbs/{mode}"] == r.value[f"shm/{mode}"], f"rank {r.rank}: verbs and shm differ ({mode})"
    assert results[0].value == results[1].value


def test_one_process_can_train_over_two_transports_in_turn(two_workers):
    # What the verbs test above relies on, checked where verbs is absent: shm then tcp, bit for bit.
    for r in two_workers("two transports"):
        assert r.value["shm/allreduce"] == r.value["tcp/allreduce"]


def _close(got, want, key):
    for g, w in zip(got["weights"], want["weights"], strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5, err_msg=key)


def test_buckets_give_bit_identical_weights(two_workers):
    results = two_workers("buckets")
    for kind in ("mlp", "cnn"):
        for mode in ("allreduce", "ps"):
            bucketed, whole = (f"{kind}/{mode}/64", f"{kind}/{mode}/0")
            for r in results:
                assert r.value[bucketed]["weights"] == r.value[whole]["weights"], bucketed  # bit for bit
                assert r.value[bucketed]["evaluate"] == r.value[whole]["evaluate"], bucketed
            assert results[0].value[bucketed]["weights"] == results[1].value[bucketed]["weights"]
            _close(results[1].value[bucketed], results[0].value[f"{kind}/reference"], bucketed)
            if mode == "allreduce":  # one ring per bucket: more (smaller) writes than one ring for all
                assert results[0].value[bucketed]["writes"] > results[0].value[whole]["writes"]
    for r in results:  # each strategy.close() stopped its bucket pipelines' threads
        assert r.value["threads left"] == []


@pytest.mark.extended  # (buckets: the 2-worker runs; tcp: the transports' conformance)
def test_three_workers_over_tcp_with_buckets_match_one_process(three_workers):
    results = three_workers("buckets over tcp")
    for key in ("mlp/allreduce/200", "mlp/ps/200"):
        assert results[0].value[key]["weights"] == results[1].value[key]["weights"] == results[2].value[key]["weights"]
        _close(results[2].value[key], results[0].value["mlp/reference"], key)


@pytest.mark.extended  # (17 s; the default run is at its 10-minute budget)
def test_a_peer_lost_inside_fit_raises_rdkeras_peer_error_naming_it():
    # The survivors' exchange fails inside the traced step: TensorFlow wraps the engine's PeerError (an
    # UnknownError from the numpy_function), and fit raises rdkeras's PeerError again, with its rank and message.
    results = run_ranks("fit_until_a_peer_dies", 3, module=TARGET, check=False, timeout=120, victim=1)
    assert results[1].returncode == -9
    for r in (results[0], results[2]):
        assert r.returncode == 0, r.output[-2000:]
        kind, message, rank, cause = r.value["error"]
        assert (kind, rank, cause) == ("PeerError", 1, "UnknownError"), r.value
        assert message.startswith("rank 1 "), message
        assert "Traceback" not in message and "[[" not in message, message  # the engine's words, not TensorFlow's
