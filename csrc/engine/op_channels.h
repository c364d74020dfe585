// Static channels as TensorFlow ops see them: by a numeric handle, through the C table of
// tfops/op_api.h. The registry holds channels weakly: an op run after its channel was closed fails with a
// clear error instead of touching freed memory.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/channel.h"
#include "tfops/op_api.h"

namespace rdkeras {

// The handle of `channel` (the same one on every call).
uint64_t opHandle(const std::shared_ptr<StaticChannel>& channel);

// The table the ops call; lives as long as the process.
const RdkerasOpApi* opApi();

}  // namespace rdkeras
