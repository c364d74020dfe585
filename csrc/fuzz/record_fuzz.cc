// libFuzzer target: a dynamic-channel metadata record as a peer wrote it into our memory.
// parseRecord must refuse anything inconsistent, and what it accepts must be consistent.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "engine/channel.h"

using namespace rdkeras;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  DynamicRecord rec{};
  std::memcpy(&rec, data, std::min(size, sizeof(rec)));
  TensorMeta meta;
  std::string why;
  if (!parseRecord(rec, &meta, &why)) {
    if (why.empty()) __builtin_trap();  // a refusal always says why
    return 0;
  }
  if (meta.shape.size() != rec.ndim || meta.shape.size() > DynamicChannel::kMaxDims) __builtin_trap();
  uint64_t elements = 1;
  for (int64_t d : meta.shape) {
    if (d < 0) __builtin_trap();
    elements *= static_cast<uint64_t>(d);  // parseRecord checked for overflow
  }
  if (meta.nbytes != rec.nbytes || (meta.nbytes && elements == 0)) __builtin_trap();
  if (meta.dtype.size() >= sizeof(rec.dtype)) __builtin_trap();
  return 0;
}
