"""Parameter-server data parallelism, the seed's design, with the servers sharded over the workers.

Every trainable variable has one owner (variables are dealt out by size so
owners carry equal bytes). Each step, synchronously:

1. push: every worker writes its gradient for each variable straight into the
   owner's registered gradient slot (one-sided write), then sets a flag;
2. the owner averages the N contributions and applies the optimizer to the
   variables it owns (the user's Keras optimizer, on that subset);
3. publish: the owner copies the new values into its registered parameter
   buffer and sets a version flag on every worker;
4. pull: every worker reads the owner's parameters (one-sided read after the
   version flag), acks, and assigns them to its copies.

So all workers end every step with identical weights. Each rank's registered
block: [gradient slot per sender | published parameters | flags: gradient-in
per sender, version per owner, pulled per worker].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rdkeras import keras_internals
from rdkeras.engine import Engine
from rdkeras.errors import EngineError
from rdkeras.parallel import collectives
from rdkeras.parallel.collectives import BucketPipeline, reverse_buckets, timed_exchange

_FLAG = 64  # one cache line per flag word
# Gradients smaller than this go to their owner together: gathered into a registered staging buffer and written
# as one message per run of them (Inception-v3's 190 small tensors: a handful of writes a step, not 190).
FUSE_BELOW = 64 << 10


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


def deal(sizes: Sequence[int], n: int) -> list[int]:
    """The owner of each of the variables of these byte sizes among `n` ranks: largest first, each to
    the least loaded rank (ties to the lowest); the same on every worker (and in the scale model)."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        o = min(range(n), key=lambda k: (load[k], k))
        owner[i] = o
        load[o] += sizes[i]
    return owner


class ParameterServer:
    """One per distributed optimizer; set up on the first step, identically on every worker.

    :meth:`apply` replaces the optimizer's ``apply``; ``owner[i]`` is the rank that updates
    variable i (empty until the first step).
    """

    def __init__(self, engine: Engine, name: str, overlap_bytes: int | None = None):
        self.engine, self.name = engine, name
        self.n, self.rank = engine.world_size, engine.rank
        self.step = 0
        self.published = 0  # the last step whose parameters this rank published (workers pull, then flag)
        self.owner: list[int] = []
        # Pushes overlap backprop in buckets of this many bytes (0: one push after the backward pass).
        self.overlap_bytes = collectives.overlap_bytes(engine.capabilities) if overlap_bytes is None else overlap_bytes
        self._pipeline: BucketPipeline | None = None
        self._buckets: list[list[list[int]]] = []  # per traced exchange: the variables of each bucket

    # -- setup ----------------------------------------------------------------

    def setup(self, shapes: list[tuple], dtypes: list[np.dtype]) -> None:
        """Deals the variables of these shapes and dtypes out to their owners and registers this rank's
        blocks (collective; the first ``apply`` does it for a model's variables)."""
        n, r = self.n, self.rank
        sizes = [int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes, strict=True)]
        self.owner = deal(sizes, n)
        self.shapes, self.dtypes, self.sizes = shapes, [np.dtype(d) for d in dtypes], sizes
        # Offsets of each variable inside its owner's packed layout.
        self.offset = [0] * len(sizes)
        self.owned_bytes = [0] * n
        for i, s in enumerate(sizes):
            o = self.owner[i]
            self.offset[i] = self.owned_bytes[o]
            self.owned_bytes[o] += _aligned(s)
        self.layouts = [self._layout(o) for o in range(n)]
        # Each small gradient's place in the staging buffer of its owner: packed like the owner's layout, so a
        # run of them adjacent there is one contiguous span here too.
        self.stage_at = [0] * len(sizes)
        staged = [0] * n
        for i, size in enumerate(sizes):
            o = self.owner[i]
            if o != r and size < FUSE_BELOW:
                self.stage_at[i] = staged[o]
                staged[o] += _aligned(size)
        self.staging = {o: self.engine.empty(staged[o]) for o in range(n) if staged[o]}
        lay = self.layouts[r]
        self.block = self.engine.empty(lay["bytes"])
        self.block[lay["flags"] :] = 0
        self.key = self.engine.register(self.block)
        self.keys = [int(k) for k in self.engine.exchange(f"ps/{self.name}", str(self.key).encode())]
        # Where pulled parameters land (this rank's copy of every other owner's buffer).
        self.pulled = {o: self.engine.empty(max(self.owned_bytes[o], 64)) for o in range(n) if o != r}

    def _layout(self, o: int) -> dict:
        slot = _aligned(self.owned_bytes[o])
        params = self.n * slot
        flags = params + slot
        return {"slot": slot, "params": params, "flags": flags, "bytes": flags + 3 * self.n * _FLAG}

    def _flag(self, o: int, kind: int, who: int) -> int:
        """Offset of flag `kind` (0 gradient-in, 1 version, 2 pulled) for rank `who` in rank o's block."""
        return self.layouts[o]["flags"] + (kind * self.n + who) * _FLAG

    def _wait(self, kind: int, who: int, value: int) -> None:
        self.engine.wait_flag(self.block, self._flag(self.rank, kind, who), value, peer=who)

    def _view(self, buf: np.ndarray, start: int, i: int) -> np.ndarray:
        return (
            buf[start + self.offset[i] : start + self.offset[i] + self.sizes[i]]
            .view(self.dtypes[i])
            .reshape(self.shapes[i])
        )

    # -- the two halves of a step ---------------------------------------------------

    def owned(self, count: int) -> list[int]:
        return [i for i in range(count) if self.owner[i] == self.rank]

    def push(self, indices: Sequence[int], grads: Sequence[np.ndarray]) -> None:
        """Writes the gradients of variables `indices` into their owners' slots (one-sided; owned here: kept):
        a large one straight from its buffer, small ones gathered and written as one message per run of them
        adjacent in the owner's layout."""
        r, eng = self.rank, self.engine
        small: dict[int, list[int]] = {}
        for i, g in zip(indices, grads, strict=True):
            o = self.owner[i]
            if o == r:
                continue
            if self.sizes[i] < FUSE_BELOW and g.nbytes == self.sizes[i]:
                at = self.stage_at[i]
                self.staging[o][at : at + g.nbytes].view(g.dtype).reshape(g.shape)[...] = g
                small.setdefault(o, []).append(i)
            else:
                eng.write(o, np.ascontiguousarray(g), self.keys[o], r * self.layouts[o]["slot"] + self.offset[i])
        for o, members in small.items():
            members.sort()  # layout order (an owner's variables are laid out in index order)
            runs = [[members[0]]]
            for i in members[1:]:
                last = runs[-1][-1]
                if self.offset[i] == self.offset[last] + _aligned(self.sizes[last]):
                    runs[-1].append(i)  # adjacent in the owner's layout: the same write
                else:
                    runs.append([i])
            slot = r * self.layouts[o]["slot"]
            for run in runs:
                first, last = run[0], run[-1]
                span = self.offset[last] + self.sizes[last] - self.offset[first]
                at = self.stage_at[first]
                eng.write(o, self.staging[o][at : at + span], self.keys[o], slot + self.offset[first])

    def announce(self) -> None:
        """Tells every owner that this step's gradients are all in its slots (flags, ordered after the writes)."""
        for o in range(self.n):
            if o != self.rank:
                self.engine.write_flag(o, self.keys[o], self._flag(o, 0, self.rank), self.step)

    def reduce(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Waits for every worker's gradients; returns the averages of the variables owned here."""
        n, r, t = self.n, self.rank, self.step
        lay = self.layouts[r]
        for s in range(n):
            if s != r:
                self._wait(0, s, t)
        self.engine.count_received((n - 1) * self.owned_bytes[r])  # the others' gradients, written here
        out = []
        for i in self.owned(len(grads)):
            # The sum goes into this rank's own slot, which nobody writes (each worker pushes into its own
            # slot of the owner's block): registered, aligned and reused, where a fresh array a step cost a
            # page-faulting allocation of every owned byte. The same additions in the same order as ever.
            total = self._view(self.block, r * lay["slot"], i)
            others = [self._view(self.block, s * lay["slot"], i) for s in range(n) if s != r]
            if grads[i].dtype == total.dtype:
                np.add(grads[i], others.pop(0), out=total)
            else:
                np.copyto(total, grads[i], casting="unsafe")
            for other in others:
                total += other
            total /= n
            out.append(total)
        return out

    def push_and_reduce(self, *grads: np.ndarray) -> list[np.ndarray]:
        """Pushes every gradient to its owner; returns the averaged gradients of the variables owned here."""
        self.step += 1
        self.push(range(len(grads)), grads)
        self.announce()
        return self.reduce(grads)

    def _push_bucket(self, exchange: int, bucket: int, grads: list[np.ndarray]) -> None:
        """The communication thread's part of an overlapped step: bucket `bucket`'s pushes (the last one
        also announces them)."""
        if bucket == 0:
            self.step += 1
        members = self._buckets[exchange][bucket]
        self.push(members, grads)
        if bucket == len(self._buckets[exchange]) - 1:
            self.announce()

    def _overlapped_push_and_reduce(self, grads: list[Any], mine: list[int]) -> Any:
        """push_and_reduce as ops TensorFlow can run during backprop: one start op per bucket of gradients
        (last layers first) hands its pushes to a communication thread; the reduce op waits for them."""
        import tensorflow as tf

        if self._pipeline is None:
            self._pipeline = BucketPipeline(self._push_bucket, "ps-push-buckets", self.engine.timeout)
        pipeline, exchange = self._pipeline, len(self._buckets)
        buckets = reverse_buckets([g.shape.num_elements() * g.dtype.size for g in grads], self.overlap_bytes)
        self._buckets.append(buckets)
        tickets = pipeline.start_ops(exchange, buckets, grads, "rdkeras_ps_push")

        def reduce(*inputs: np.ndarray) -> list[np.ndarray]:
            pipeline.wait(exchange, len(buckets))
            return self.reduce(inputs[len(buckets) :])

        # The gradients are inputs too: TensorFlow keeps them alive until they are pushed.
        return tf.numpy_function(
            timed_exchange(reduce, lambda: self.engine),
            tickets + grads,
            Tout=[grads[i].dtype for i in mine],
            stateful=True,
            name="rdkeras_ps_reduce",
        )

    def publish_and_pull(self, *owned_values: np.ndarray) -> list[np.ndarray]:
        """Publishes the owned variables' new values; returns every other variable's, read from its owner."""
        n, r, t, eng = self.n, self.rank, self.step, self.engine
        lay = self.layouts[r]
        for w in range(n):  # the previous version must be fully read before it is overwritten
            if w != r:
                self._wait(2, w, t - 1)
        for i, value in zip(self.owned(len(self.owner)), owned_values, strict=True):
            self._view(self.block, lay["params"], i)[...] = value
        for w in range(n):
            if w != r:
                eng.write_flag(w, self.keys[w], self._flag(w, 1, r), t)
        self.published = t
        for o in range(n):
            if o == r:
                continue
            self._wait(1, o, t)
            eng.read(o, self.pulled[o][: self.owned_bytes[o]], self.keys[o], self.layouts[o]["params"])
            eng.write_flag(o, self.keys[o], self._flag(o, 2, r), t)
        # Views of the pull buffers, no copy: assign() copies them into the variables
        # within this step, before the next step's pull overwrites the buffers.
        return [self._view(self.pulled[self.owner[i]], 0, i) for i in range(len(self.owner)) if self.owner[i] != r]

    def stop(self) -> None:
        """Stops the bucket pipeline's threads (the strategy is closing); the block stays until the engine closes."""
        if self._pipeline is not None:
            self._pipeline.close()

    def close(self) -> None:
        """Deregisters this rank's block once every worker's last one-sided write into it landed: the
        "pulled" flag a worker sets after reading this owner's parameters may still be on its way when
        this rank's own step is done. A peer that is gone writes nothing more (its error is ignored)."""
        if not self.owner:
            return
        for w in range(self.n) if self.published else ():
            if w != self.rank:
                try:
                    self._wait(2, w, self.published)
                except EngineError:
                    pass
        self.engine.deregister(self.key)
        self.owner = []

    # -- the optimizer hook ---------------------------------------------------------

    def apply(self, optimizer: Any, base: Any, grads: list, trainable_variables: Any = None) -> Any:
        """The parameter-server step in place of ``optimizer.apply``: push, owners update, pull.

        `optimizer` is the one that updates the variables (a LossScaleOptimizer's inner one), `base`
        its own ``apply``.
        """
        import tensorflow as tf

        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else keras_internals.tracked_variables(optimizer)
        )
        grads = [tf.convert_to_tensor(g) for g in grads]
        if not optimizer.built:  # build on all variables: slots exist everywhere, iterations agree
            optimizer.build(variables)
        if self.n == 1:
            return base(grads, variables)
        if not self.owner:  # the owner map is needed while tracing (collective: every worker traces once)
            self.setup([tuple(v.shape) for v in variables], [np.dtype(v.dtype) for v in variables])
        mine = [i for i in range(len(variables)) if self.owner[i] == self.rank]
        others = [i for i in range(len(variables)) if self.owner[i] != self.rank]
        if self.overlap_bytes > 0 and not tf.executing_eagerly() and all(g.shape.is_fully_defined() for g in grads):
            averaged = self._overlapped_push_and_reduce(grads, mine)
        else:
            averaged = tf.numpy_function(
                timed_exchange(self.push_and_reduce, lambda: self.engine),
                grads,
                Tout=[grads[i].dtype for i in mine],
                stateful=True,
                name="rdkeras_ps_push",
            )
        if mine:
            for i, g in zip(mine, averaged, strict=True):
                g.set_shape(grads[i].shape)
            base(list(averaged), [variables[i] for i in mine])
        else:
            optimizer.iterations.assign_add(1)  # keep the step count in line with the owners
        fresh = tf.numpy_function(
            timed_exchange(self.publish_and_pull, lambda: self.engine),
            [variables[i].value for i in mine],
            Tout=[tf.as_dtype(variables[i].dtype) for i in others],
            stateful=True,
            name="rdkeras_ps_pull",
        )
        for i, value in zip(others, fresh, strict=True):
            value.set_shape(variables[i].shape)
            variables[i].assign(value)
        return None
