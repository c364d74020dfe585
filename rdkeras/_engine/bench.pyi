"""Type stub for ``rdkeras._engine.bench`` (csrc/bench, bound in csrc/python/bindings.cc): timed loops over
static channels for the benchmarks, timed in C++ to keep Python's call overhead out of the figures."""

from typing_extensions import Buffer

from rdkeras._engine import StaticChannel

def ping_pong(tx: StaticChannel, rx: StaticChannel, iterations: int, initiator: bool) -> float: ...
def send_many(tx: StaticChannel, data: Buffer, iterations: int) -> float: ...
def recv_many(rx: StaticChannel, iterations: int) -> float: ...
