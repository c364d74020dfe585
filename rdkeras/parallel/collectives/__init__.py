"""Collectives over the engine: what every data-parallel exchange is built from.

- ``algorithms.py``: the allreduce algorithms (ring, hierarchical, recursive doubling) as objects, each saying
  when it is enabled, in a priority list; the cost formulas that decide between them.
- ``core.py``: :class:`Collectives` -- allreduce, broadcast, means and row gathering among a set of members,
  on rings set up lazily and identically on every member -- and the hierarchical allreduce's two levels.
- ``in_calls.py``: allgathers and reduce-scatters of any size, in calls of a bounded size.
- ``sharing.py``: Keras variables given an owner's (or rank 0's) values.
- ``buckets.py``: gradient buckets and the threads that exchange them while backprop goes on.
- ``gradients.py``: :class:`GradientAllreduce`, the exchange inside a compiled training step.
"""

from rdkeras.parallel.collectives.algorithms import (
    HIERARCHY_PASS_BYTES,
    MESSAGE_SHARE,
    SCHEDULING_S,
    choose_algorithm,
    doubling_below,
    doubling_messages,
    grid_groups,
    grid_side,
    hierarchy_pass_bytes,
    host_groups,
)
from rdkeras.parallel.collectives.buckets import (
    BUCKET_BYTES,
    EXCHANGE_LANES,
    BucketPipeline,
    overlap_bytes,
    pipelines,
    reverse_buckets,
)
from rdkeras.parallel.collectives.core import Collectives, HierarchicalAllreduce, wire_dtype
from rdkeras.parallel.collectives.gradients import GradientAllreduce, timed_exchange
from rdkeras.parallel.collectives.in_calls import CALL_BYTES, allgather_in_calls, reduce_scatter_in_calls
from rdkeras.parallel.collectives.sharing import share_new_variables, share_variables
from rdkeras.parallel.options import ALGORITHMS, COMPRESSIONS

__all__ = [
    "ALGORITHMS",
    "BUCKET_BYTES",
    "CALL_BYTES",
    "COMPRESSIONS",
    "EXCHANGE_LANES",
    "HIERARCHY_PASS_BYTES",
    "MESSAGE_SHARE",
    "SCHEDULING_S",
    "BucketPipeline",
    "Collectives",
    "GradientAllreduce",
    "HierarchicalAllreduce",
    "allgather_in_calls",
    "choose_algorithm",
    "doubling_below",
    "doubling_messages",
    "grid_groups",
    "grid_side",
    "hierarchy_pass_bytes",
    "host_groups",
    "overlap_bytes",
    "pipelines",
    "reduce_scatter_in_calls",
    "reverse_buckets",
    "share_new_variables",
    "share_variables",
    "timed_exchange",
    "wire_dtype",
]
