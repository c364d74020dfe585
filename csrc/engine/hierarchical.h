#pragma once

#include <vector>

#include "engine/ring.h"

namespace rdkeras {

// The sum over hosts: `inside` (this host's members, in the same order on every host) reduce-scatters each
// pass, `across` (the members at this rank's position on every host, which hold the same chunk) sums that
// chunk across hosts, and `inside` allgathers the result -- every host's links busy at once, each host
// sending 2(H-1)/H of the bytes between hosts. With `average`, divided by `world` (every rank). Returns
// `inside`'s output; every rank ends with the same bits. With `wire` a 16-bit type (inputs float32), the
// shards cross hosts as `wire`: half the bytes on the slow links, summed in float32 at every hop.
RingAllreduce::Result hierarchicalAllreduce(RingAllreduce& inside, RingAllreduce& across,
                                            const std::vector<ConstSpan>& inputs, DType dtype, bool average,
                                            int world, DType wire);

}  // namespace rdkeras
