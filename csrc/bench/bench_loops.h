// Timed loops over static channels for the benchmarks (rdkeras.bench, bound as
// rdkeras._engine.bench): timing in C++ keeps the Python call overhead out of
// latency and bandwidth figures. Not part of the engine's library (rdkeras_core):
// only the Python module links them.
#pragma once

#include "engine/channel.h"

namespace rdkeras::bench {

// Round trips of `tx`/`rx` messages, timed in C++ (for latency benchmarks):
// the initiator sends then receives, the other side receives then sends.
// Returns seconds for all `iterations` round trips.
double pingPong(StaticChannel& tx, StaticChannel& rx, int iterations, bool initiator);
// Sends `iterations` messages from `data` back to back; returns seconds.
double sendMany(StaticChannel& tx, const void* data, int iterations);
double recvMany(StaticChannel& rx, int iterations);

}  // namespace rdkeras::bench
