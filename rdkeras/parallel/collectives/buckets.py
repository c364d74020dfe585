"""Gradient buckets: their size, their order (last layer first), and the threads that exchange them while
backprop goes on."""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdkeras import errors
from rdkeras.transports.base import Capabilities

BUCKET_BYTES = 4 << 20  # the bucket size where overlap is on


def overlap_bytes(capabilities: Capabilities, hierarchical: bool = False) -> int:
    """The default gradient bucket size for overlapping the exchange with backprop on a transport with these
    `capabilities` (the engine's), with no GPU
    doing the compute: 0 (off) where the bytes are moved by this process's own cores while they also compute (a
    transport whose spec sets ``copies_on_own_cores``: the exchange would only take turns with backprop on the
    same core -- measured 20% slower) or where the gradients go by the `hierarchical` allreduce (each bucket's
    call fills and drains its own pipeline of passes, and the sums inside each host are these cores' work: on
    2 emulated hosts x 2 at 1 Gbit/s, 3 rounds, a step took 0.727 s in 4 MiB buckets against 0.696 s in one
    exchange after backprop, bf16 0.427 s against 0.401 s), else ``BUCKET_BYTES``. With a GPU, ``BUCKET_BYTES``.
    ``RDMAStrategy(overlap_bytes=...)`` overrides it."""
    if capabilities.copies_on_own_cores or hierarchical:
        tf = sys.modules.get("tensorflow")  # not imported: no TensorFlow compute (the engine-only tests)
        if tf is None or not tf.config.list_physical_devices("GPU"):
            return 0
    return BUCKET_BYTES


# Gradient buckets exchanged at once: each on rings of its own, so one bucket's sums inside a host (or its wait
# for a late worker) leave the wire to the other's passes.
EXCHANGE_LANES = 2


def reverse_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices grouped into buckets of at least `bucket_bytes` (the last one may be smaller), the last
    index first: backprop produces the last layers' gradients first."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        filled += sizes[i]
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketPipeline:
    """Runs work on buckets in communication threads, in the order they are started, while the caller
    (TensorFlow's executor, still computing the backward pass) goes on; :meth:`wait` collects them.

    ``start(exchange, b, arrays)`` queues bucket `b` of one traced exchange and returns at once;
    ``wait(exchange)`` blocks until every bucket of it is done and returns their results, or raises what
    the work raised. Buckets are taken in start order -- which TensorFlow's automatic control dependencies
    make program order, the same on every worker, so every worker's collectives match: `prepare` (what must
    happen in that order on every worker, such as setting up a bucket's rings) runs for each in turn, then
    `work` runs on lane ``b % lanes``. With one lane the buckets' work runs one at a time; with more, a bucket's
    exchange runs beside the previous one's, on collectives of its own, so one bucket's phases that do not use
    the wire (the sums inside a host) overlap another's that do. The work releases the GIL (the engine's
    collectives do), so backprop runs meanwhile.
    """

    def __init__(
        self,
        work: Callable[[int, int, list[np.ndarray]], Any],
        name: str,
        timeout: float,
        prepare: Callable[[int, int, list[np.ndarray]], Any] | None = None,
        lanes: int = 1,
    ):
        self._work, self._prepare, self._name, self._timeout = work, prepare, name, timeout
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lanes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(lanes if lanes > 1 else 0)]
        self._done = threading.Condition()
        self._results: dict[int, dict[int, Any]] = {}  # exchange -> bucket -> result
        self._expected: dict[int, int] = {}  # exchange -> the bucket that must come next
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._generation = 0  # bumped by reset(): buckets started before it are dropped
        self._closed = False
        # Per exchange call: [first start, end of the work done before the wait began, wait entered, wait left,
        # seconds of work (summed over lanes)] (perf_counter) -- how much communication backprop hid (benchmarks
        # read it).
        self.timeline: collections.deque[list[float]] = collections.deque(maxlen=256)
        self._current: dict[int, list[float]] = {}
        _PIPELINES.add(self)

    def start_ops(self, exchange: int, buckets: list[list[int]], tensors: list[Any], name: str) -> list[Any]:
        """One stateful op per bucket, its only inputs that bucket's `tensors`, that starts the bucket and
        returns a ticket: TensorFlow runs each as soon as its gradients exist, in bucket order."""
        import tensorflow as tf

        tickets = []
        for b, members in enumerate(buckets):

            def start(*arrays: np.ndarray, b: int = b) -> np.int64:
                self.start(exchange, b, list(arrays))
                return np.int64(b)

            inputs = [tensors[i] for i in members]
            tickets.append(tf.numpy_function(start, inputs, Tout=tf.int64, stateful=True, name=f"{name}{b}"))
        return tickets

    def start(self, exchange: int, bucket: int, arrays: list[np.ndarray]) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name}: the exchange is closed (its RDMAStrategy was closed)")
        if bucket == 0:
            self._current[exchange] = [time.perf_counter(), 0.0, 0.0, 0.0, 0.0]
        if not self._threads:
            loops = [(self._loop, self._jobs)] + [(self._lane, q) for q in self._lanes]
            for i, (loop, jobs) in enumerate(loops):
                name = f"rdkeras-{self._name}" + (f"-lane{i - 1}" if i else "")
                self._threads.append(threading.Thread(target=loop, args=(jobs,), name=name, daemon=True))
            for t in self._threads:
                t.start()
        # The arrays are views of TensorFlow's gradient buffers; the wait op takes the same tensors as
        # inputs, so TensorFlow keeps them alive (and unchanged) until the bucket is done.
        self._jobs.put((self._generation, exchange, bucket, arrays))

    def reset(self) -> None:
        """Forgets every bucket started so far and any error (an elastic job's group re-formed: the exchange in
        flight is repeated from the start). Work still running on the old group fails, and is dropped."""
        with self._done:
            self._generation += 1
            self._results.clear()
            self._expected.clear()
            self._current.clear()
            self._error = None

    def close(self, timeout: float = 5.0) -> None:
        """Stops the threads once the work in hand is done (waiting at most `timeout` seconds for them: one still
        inside a collective ends when its engine closes); later starts fail."""
        self._closed = True
        self.reset()  # what is queued is dropped
        for jobs in [self._jobs, *self._lanes]:
            jobs.put(None)
        ends = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, ends - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            generation, exchange, bucket, arrays = job
            with self._done:  # checked and counted with the generation, so a reset in between drops the bucket
                if generation != self._generation or self._error is not None:
                    continue  # started before a reset, or after a failure of its group
                expected = self._expected.get(exchange, 0)
                self._expected[exchange] = bucket + 1
            try:
                if bucket != expected:
                    raise RuntimeError(
                        f"{self._name}: bucket {bucket} started before bucket {expected}; the workers' exchanges "
                        "would not match (were TensorFlow's automatic control dependencies disabled?)"
                    )
                if self._prepare is not None:
                    self._prepare(exchange, bucket, arrays)
            except BaseException as e:  # reported by wait(), in the training step
                self._fail(generation, e)
                continue
            if self._lanes:
                self._lanes[bucket % len(self._lanes)].put(job)
            else:
                self._run(job)

    def _lane(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            self._run(job)

    def _live(self, generation: int) -> bool:
        with self._done:
            return generation == self._generation and self._error is None

    def _fail(self, generation: int, error: BaseException) -> None:
        with self._done:
            if generation == self._generation:  # else the old group's work, dropped by a reset
                self._error = error
                self._done.notify_all()

    def _run(self, job: tuple[int, int, int, list[np.ndarray]]) -> None:
        generation, exchange, bucket, arrays = job
        if not self._live(generation):
            return
        try:
            began = time.perf_counter()
            result = self._work(exchange, bucket, arrays)
            ended = time.perf_counter()
        except BaseException as e:
            self._fail(generation, e)
            return
        with self._done:
            if generation != self._generation:
                return
            marks = self._current.get(exchange)
            if marks is not None:
                marks[4] += ended - began
                if not marks[2]:  # the wait has not begun yet: this bucket was hidden behind backprop
                    marks[1] = ended
            self._results.setdefault(exchange, {})[bucket] = result
            self._done.notify_all()

    def wait(self, exchange: int, count: int) -> list[Any]:
        """Every bucket's result, in bucket order; fails after `timeout` seconds without progress."""
        return [self.wait_bucket(exchange, b, count) for b in range(count)]

    def wait_bucket(self, exchange: int, bucket: int, count: int) -> Any:
        """Bucket `bucket`'s result (of `count`), once it is done; the buckets must be waited for in order. Fails
        after `timeout` seconds without progress."""
        marks = self._current.get(exchange)
        if marks is not None and bucket == 0:
            marks[2] = time.perf_counter()
        with self._done:
            done, since = -1, time.monotonic()
            while bucket not in self._results.get(exchange, {}):
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise RuntimeError(f"{self._name}: the exchange is closed (its RDMAStrategy was closed)")
                if len(self._results.get(exchange, {})) != done:
                    done, since = len(self._results.get(exchange, {})), time.monotonic()
                left = since + self._timeout - time.monotonic()
                if left <= 0:
                    raise errors.TimeoutError(
                        f"{self._name}: bucket {bucket} of {count} not done after {self._timeout:g} s "
                        f"({bucket + done} done)"
                    )
                self._done.wait(min(left, 1.0))
            result = self._results[exchange].pop(bucket)
            if bucket < count - 1:
                return result
            del self._results[exchange]
            self._expected[exchange] = 0
        if marks is not None:
            marks[3] = time.perf_counter()
            self.timeline.append(marks)
        return result


_PIPELINES: weakref.WeakSet[BucketPipeline] = weakref.WeakSet()


def pipelines() -> list[BucketPipeline]:
    """Every live BucketPipeline (benchmarks read their timelines)."""
    return list(_PIPELINES)
