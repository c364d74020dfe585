"""BucketPipeline: buckets prepared in start order, their work on lanes, results and errors back to the waiter."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rdkeras import errors
from rdkeras.parallel.collectives import BucketPipeline


def test_with_two_lanes_a_bucket_runs_beside_the_one_before_it():
    prepared: list[int] = []
    second_started = threading.Event()

    def work(exchange: int, bucket: int, arrays: list[np.ndarray]) -> float:
        if bucket == 0:  # done only once bucket 1 runs: one lane would wait here until the timeout
            assert second_started.wait(10), "bucket 1 did not start while bucket 0 was running"
        else:
            second_started.set()
        return float(arrays[0].sum()) * 10**bucket

    pipeline = BucketPipeline(work, "test", 10.0, prepare=lambda e, b, a: prepared.append(b), lanes=2)
    for b in range(4):
        pipeline.start(0, b, [np.full(3, b + 1.0)])
    assert pipeline.wait(0, 4) == [3.0, 60.0, 900.0, 12000.0]
    assert prepared == [0, 1, 2, 3]
    # The next exchange starts afresh at bucket 0.
    pipeline.start(1, 0, [np.ones(2)])
    pipeline.start(1, 1, [np.ones(2)])
    assert pipeline.wait(1, 2) == [2.0, 20.0]


def test_with_one_lane_the_buckets_run_one_at_a_time_in_start_order():
    running, ran = threading.Lock(), []

    def work(exchange: int, bucket: int, arrays: list[np.ndarray]) -> int:
        assert running.acquire(blocking=False), "two buckets ran at once"
        ran.append(bucket)
        running.release()
        return bucket

    pipeline = BucketPipeline(work, "test", 10.0)
    for b in range(5):
        pipeline.start(0, b, [np.zeros(1)])
    assert pipeline.wait(0, 5) == [0, 1, 2, 3, 4] and ran == [0, 1, 2, 3, 4]


def test_a_lane_s_failure_reaches_the_waiter_and_a_reset_clears_it():
    def work(exchange: int, bucket: int, arrays: list[np.ndarray]) -> int:
        if exchange == 0 and bucket == 1:
            raise errors.PeerError("rank 3 died")
        return bucket

    pipeline = BucketPipeline(work, "test", 10.0, prepare=lambda e, b, a: None, lanes=2)
    for b in range(3):
        pipeline.start(0, b, [np.zeros(1)])
    with pytest.raises(errors.PeerError, match="rank 3 died"):
        pipeline.wait(0, 3)
    pipeline.reset()  # an elastic group re-formed: the exchange is repeated
    for b in range(3):
        pipeline.start(1, b, [np.zeros(1)])
    assert pipeline.wait(1, 3) == [0, 1, 2]


def test_a_bucket_started_out_of_order_is_refused_naming_both():
    pipeline = BucketPipeline(lambda e, b, a: b, "test", 10.0, prepare=lambda e, b, a: None, lanes=2)
    pipeline.start(0, 1, [np.zeros(1)])
    with pytest.raises(RuntimeError, match="bucket 1 started before bucket 0"):
        pipeline.wait(0, 2)


def test_a_bucket_that_never_finishes_times_out_naming_it():
    release = threading.Event()
    pipeline = BucketPipeline(lambda e, b, a: release.wait(5), "test", 0.3, lanes=2)
    pipeline.start(0, 0, [np.zeros(1)])
    with pytest.raises(errors.TimeoutError, match=r"bucket 0 of 1 not done after 0\.3 s"):
        pipeline.wait(0, 1)
    release.set()


def test_close_stops_every_thread_and_later_use_fails_clearly():
    before = set(threading.enumerate())
    pipeline = BucketPipeline(lambda e, b, a: b, "closing", 10.0, prepare=lambda e, b, a: None, lanes=2)
    for b in range(2):
        pipeline.start(0, b, [np.zeros(1)])
    assert pipeline.wait(0, 2) == [0, 1]
    mine = set(threading.enumerate()) - before
    assert sorted(t.name for t in mine) == ["rdkeras-closing", "rdkeras-closing-lane0", "rdkeras-closing-lane1"]
    pipeline.close()
    assert not [t.name for t in mine if t.is_alive()]
    with pytest.raises(RuntimeError, match="closing: the exchange is closed"):
        pipeline.start(1, 0, [np.zeros(1)])
    with pytest.raises(RuntimeError, match="closing: the exchange is closed"):
        pipeline.wait_bucket(1, 0, 1)
