#include "engine/hierarchical.h"

#include <cstring>

namespace rdkeras {

namespace {

template <typename T>
void scaledCopy(uint8_t* dst, const uint8_t* src, size_t bytes, double scale) {
  auto* d = reinterpret_cast<T*>(dst);
  const auto* s = reinterpret_cast<const T*>(src);
  const T k = static_cast<T>(scale);
  for (size_t i = 0; i < bytes / sizeof(T); ++i) d[i] = s[i] * k;
}

}  // namespace

RingAllreduce::Result hierarchicalAllreduce(RingAllreduce& inside, RingAllreduce& across,
                                            const std::vector<ConstSpan>& inputs, DType dtype, bool average,
                                            int world, DType wire) {
  const double scale = average ? 1.0 / world : 1.0;
  if (wire != dtype && dtype != DType::kFloat32)
    throw EngineError(
        strCat("allreduce: only float32 travels as ", dtypeName(wire), ", not ", dtypeName(dtype)));
  return inside.run(inputs, dtype, false, [&](uint8_t* chunk, size_t bytes) {
    // Every host's member at this position holds the same chunk (same layout, same ring order): equal sizes.
    if (wire != dtype) {
      allreduceOnWire({{chunk, bytes}}, {reinterpret_cast<float*>(chunk)}, wire, static_cast<float>(scale),
                      across.wireScratch(),
                      [&](const std::vector<ConstSpan>& narrow) { return across.run(narrow, wire, false); });
      return;
    }
    const RingAllreduce::Result summed = across.run({{chunk, bytes}}, dtype, false);
    const uint8_t* sum = summed.out + summed.offsets[0];
    if (scale == 1.0)
      std::memcpy(chunk, sum, bytes);
    else if (dtype == DType::kFloat32)
      scaledCopy<float>(chunk, sum, bytes, scale);
    else
      scaledCopy<double>(chunk, sum, bytes, scale);
  });
}

}  // namespace rdkeras
