"""Sharded checkpoints: each worker writes its shard of the optimizer state; a run resumes at any worker count.

A checkpoint is a folder::

    manifest.json        the layout: each group's variables (by trainable position), sizes and shard length, the
                         workers that wrote it, the slot names ("momentum", "velocity"), the weights' shapes
    weights.npz          the model's weights (every worker holds them whole), written by the chief
    optimizer.npz        the optimizer's own variables (iteration, learning rate, a loss scale), by the chief
    shard-R/G-SLOT.npy   worker R's shard of group G's SLOT, written by worker R

A group is a dtype's variables where the optimizer state alone is sharded, and a layer's (a unit's) where its weights
are too (``shard="parameters"``): then each worker writes its shard of the weights as the slot ``weights``, the
manifest's ``in_shards`` names them ([position in the model's weights, trainable position]), and weights.npz holds
an empty array in their place.

Saving writes into ``FOLDER.partial`` and renames it over ``FOLDER`` once every worker has written its files, so
a worker killed during a save leaves the previous checkpoint whole. Loading reads, for each piece this worker owns
now, the ranges of the shard files that hold it (memory-mapped: only those bytes), so N workers' checkpoint resumes
on M workers, sharded or not, and in one process without a strategy (:func:`load`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rdkeras import keras_internals
from rdkeras.parallel.piece_gradients import slots_by_variable
from rdkeras.parallel.sharded_optimizer import ShardedUpdate
from rdkeras.parallel.sharded_parameters import ShardedParameters, shard_of

FORMAT = "rdkeras-sharded-checkpoint/1"
WEIGHTS = "weights"  # the slot name of a unit's weights, where the weights are sharded


def _layout(variables: Sequence[Any], update: ShardedUpdate | None, workers: int) -> list[dict]:
    """Each dtype group's variables (paths), sizes and shard length: the sharded update's, or (unsharded) every
    variable whole in one shard."""
    if update is not None:
        return [{"dtype": g.dtype, "variables": list(g.indices), "sizes": g.sizes, "per": g.per}
                for g in update.groups]  # fmt: skip
    groups: dict[str, dict] = {}
    for i, v in enumerate(variables):
        group = groups.setdefault(np.dtype(v.dtype).name, {"dtype": np.dtype(v.dtype).name, "variables": [],
                                                           "sizes": []})  # fmt: skip
        group["variables"].append(i)
        group["sizes"].append(int(np.prod(v.shape)))
    for group in groups.values():
        group["per"] = sum(group["sizes"])
    return list(groups.values())


def _unit_layout(parameters: ShardedParameters, trainable: Sequence[Any]) -> list[dict]:
    """Each unit of sharded weights as a group: its variables' positions in `trainable`, their sizes, its shard."""
    position = {id(v): i for i, v in enumerate(trainable)}
    return [{"dtype": unit.dtype, "variables": [position[id(v)] for v in unit.variables], "sizes": unit.sizes,
             "per": unit.per} for unit in parameters.units]  # fmt: skip


def _unit_shards(parameters: ShardedParameters) -> dict[tuple[int, str], np.ndarray]:
    """(unit, WEIGHTS or a slot's name) -> this worker's shard of the unit's weights or of that slot."""
    out = {}
    for g, (unit, slots) in enumerate(zip(parameters.units, parameters.slots_of_units(), strict=True)):
        out[(g, WEIGHTS)] = shard_of(unit, [keras_internals.storage(v) for v in unit.variables])
        out.update({(g, name): shard_of(unit, pieces) for name, pieces in slots.items()})
    return out


def _restore_units(parameters: ShardedParameters, read: Any, trainable: Sequence[Any]) -> None:
    """Each piece's weights and optimizer state from ``read(trainable position, lo, hi, WEIGHTS or slot name)``."""
    position = {id(v): i for i, v in enumerate(trainable)}
    for unit, slots in zip(parameters.units, parameters.slots_of_units(), strict=True):
        for k, (v, (lo, hi)) in enumerate(zip(unit.variables, unit.owned, strict=True)):
            keras_internals.storage(v).assign(np.asarray(read(position[id(v)], lo, hi, WEIGHTS), unit.dtype))
            for name, pieces in slots.items():
                pieces[k].assign(np.asarray(read(position[id(v)], lo, hi, name), unit.dtype))


def _own_variables(optimizer: Any, slots: dict) -> list[Any]:
    """The optimizer's variables that belong to no model variable: iteration, learning rate, a loss scale."""
    taken = {id(v) for v in slots.values()}
    return [v for v in optimizer.variables if id(v) not in taken]


def save(directory: str | os.PathLike, model: Any, update: ShardedUpdate | None, rank: int, workers: int,
         barrier: Any, parameters: ShardedParameters | None = None) -> None:  # fmt: skip
    """Collective: writes `model`'s checkpoint into `directory` (see the module). `update`: the sharded update of
    its optimizer, or `parameters` its sharded weights and update (None: unsharded, the chief writes the whole
    state); `barrier()` waits for every worker."""
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    optimizer = model.optimizer
    variables = update.variables if update is not None else list(model.trainable_variables)
    if update is None and parameters is None and not optimizer.built:
        optimizer.build(variables)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # (a save killed before: never the checkpoint itself)
        partial.mkdir(parents=True)
    barrier()
    sharded = update is not None or parameters is not None
    mine: dict[tuple[int, str], np.ndarray] = {}  # (group, slot) -> this worker's shard
    in_shards: list[list[int]] = []
    if parameters is not None:
        groups = _unit_layout(parameters, variables)
        mine = _unit_shards(parameters)
        trainable = {id(v): i for i, v in enumerate(variables)}
        in_shards = [[k, trainable[id(w)]] for k, w in enumerate(model.weights) if parameters.is_sharded(w)]
    else:
        groups = _layout(variables, update, workers if sharded else 1)
    if update is not None:
        mine = update.shard_slots()
    elif parameters is None and rank == 0:
        slots = slots_by_variable(keras_internals.inner_optimizer(optimizer), variables)
        for g, group in enumerate(groups):
            for name in sorted({name for _, name in slots}):
                parts = [np.reshape(np.asarray(slots[(i, name)].numpy()), -1) for i in group["variables"]]
                mine[(g, name)] = np.concatenate(parts) if parts else np.zeros(0, group["dtype"])
    if mine:
        folder = partial / f"shard-{rank}"
        folder.mkdir()
        for (g, name), values in mine.items():
            np.save(folder / f"{g}-{name}.npy", values)
    slot_names = sorted({name for _, name in mine if name != WEIGHTS or parameters is None})
    if rank == 0:
        # (the sharded weights' places hold nothing: get_weights would gather them, a collective)
        elsewhere = {k for k, _ in in_shards}
        held = [np.zeros(0) if k in elsewhere else np.asarray(w.numpy()) for k, w in enumerate(model.weights)]
        np.savez(partial / "weights.npz", *held)
        own = _own_variables(optimizer, {} if sharded else slots_by_variable(optimizer, variables))
        own_values: dict[str, Any] = {v.name: np.asarray(v.numpy()) for v in own}
        np.savez(partial / "optimizer.npz", **own_values)
        manifest = {"format": FORMAT, "workers": workers if sharded else 1, "groups": groups,
                    "slots": slot_names, "weights": [[w.path, list(w.shape)] for w in model.weights],
                    "in_shards": in_shards,
                    "optimizer": type(keras_internals.inner_optimizer(optimizer)).__name__}  # fmt: skip
    barrier()  # every shard written
    if rank == 0:
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _sync(partial)
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()  # the checkpoint in place before anyone goes on


def _sync(folder: Path) -> None:
    for path in [*folder.rglob("*"), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load(directory: str | os.PathLike, model: Any, update: ShardedUpdate | None = None, weights: bool = True,
         parameters: ShardedParameters | None = None) -> None:  # fmt: skip
    """Sets `model`'s weights (unless not `weights`) and its optimizer's state from the checkpoint in `directory`,
    written by any number of workers, sharded or not: this worker's shard of it where `update` shards the
    optimizer, or its pieces of weights and state where `parameters` (laid out) shards the weights too, else the
    whole state. Every worker of a job calls it (each reads what it needs); in one process, with no strategy, it
    resumes a plain Keras model (compiled) from a sharded checkpoint."""
    folder = Path(directory)
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{folder} is not an rdkeras sharded checkpoint (format {manifest.get('format')!r})")
    # Weights by position and shape, as Keras's own files: paths hold made-up names (dense_2) that differ by run.
    here, there = [list(w.shape) for w in model.weights], [shape for _, shape in manifest["weights"]]
    if not weights:  # (the optimizer's state only: the weights come from elsewhere, e.g. a backup's weights file)
        here = there = [list(v.shape) for v in model.trainable_variables]
    if here != there:
        differ = next((f"weight {k} ({manifest['weights'][k][0]}) is {a} here, {b} there"
                       for k, (a, b) in enumerate(zip(here, there, strict=False)) if a != b),
                      f"{len(here)} weights here, {len(there)} there")  # fmt: skip
        raise ValueError(f"the checkpoint in {folder} is of another model: {differ}")
    reader = _Reader(folder, manifest)
    read: Any = reader.read
    if weights:
        with np.load(folder / "weights.npz") as saved_weights:
            held = [saved_weights[f"arr_{k}"] for k in range(len(here))]
        in_shards = dict(manifest.get("in_shards", []))  # position in the weights -> trainable position
        position = {id(w): k for k, w in enumerate(model.weights)}
        weight_of = [position[id(v)] for v in model.trainable_variables]

        def read_held(i: int, lo: int, hi: int, slot: str) -> np.ndarray:  # (a trainable weight's too, where it is)
            if slot != WEIGHTS or weight_of[i] in in_shards:
                return reader.read(i, lo, hi, slot)
            return np.reshape(held[weight_of[i]], -1)[lo:hi]

        read = read_held

        for k, (w, shape) in enumerate(zip(model.weights, here, strict=True)):
            if parameters is not None and parameters.is_sharded(w):
                continue  # (its piece is set below, with its optimizer state)
            whole = read(in_shards[k], 0, int(np.prod(shape)), WEIGHTS) if k in in_shards else held[k]
            w.assign(np.reshape(whole, shape))
    optimizer = model.optimizer
    variables = list(model.trainable_variables)
    if not optimizer.built and parameters is None:
        optimizer.build(variables)
    if update is not None and not update.variables:
        update.plan(variables)  # (as the first step would, on the same variables)
    variables = update.variables if update is not None else variables
    with np.load(folder / "optimizer.npz") as own:  # (by name: an optimizer's path has its own, made-up name)
        saved = {key: own[key] for key in own.files}
    for v in optimizer.variables:
        if v.name in saved:
            v.assign(saved[v.name])
    if parameters is not None:
        _restore_units(parameters, read, variables)
        return
    if update is not None:
        update.restore(reader.read)
        return
    slots = slots_by_variable(keras_internals.inner_optimizer(optimizer), variables)
    for (i, name), slot in slots.items():
        size = int(np.prod(variables[i].shape))
        slot.assign(np.reshape(reader.read(i, 0, size, name), variables[i].shape))


class _Reader:
    """Ranges of a trainable variable's slot (by its position) from the shard files that hold them (memory-mapped)."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder, self.workers = folder, manifest["workers"]
        self.where: dict[int, tuple[int, int, int]] = {}  # trainable position -> (group, flat offset, size)
        self.per: list[int] = []
        for g, group in enumerate(manifest["groups"]):
            offset = 0
            for index, size in zip(group["variables"], group["sizes"], strict=True):
                self.where[index] = (g, offset, size)
                offset += size
            self.per.append(group["per"])

    def read(self, index: int, lo: int, hi: int, slot: str) -> np.ndarray:
        if index not in self.where or hi > self.where[index][2]:
            raise ValueError(f"the checkpoint in {self.folder} holds no optimizer state for trainable variable {index}")
        g, offset, _ = self.where[index]
        start, end, per = offset + lo, offset + hi, self.per[g]
        parts = []
        for k in range(start // per if per else 0, -(-end // per) if per else 0):
            shard = np.load(self.folder / f"shard-{k}" / f"{g}-{slot}.npy", mmap_mode="r")
            parts.append(np.array(shard[max(start, k * per) - k * per : min(end, (k + 1) * per) - k * per]))
        return np.concatenate(parts) if parts else np.zeros(0)
