#include "engine/collectives.h"

namespace rdkeras {

uint8_t* WireScratch::get(size_t bytes) {
  if (bytes > bytes_)
    throw EngineError(strCat("allreduce: ", bytes, " bytes on the wire exceed the capacity of ", bytes_));
  if (!block_) block_ = std::make_unique<RegisteredBlock>(tracker_, bytes_);  // on first use, never replaced
  return block_->data();
}

CollectiveGroup::CollectiveGroup(std::shared_ptr<Engine> engine, size_t capacity_bytes,
                                 std::vector<int> members)
    : engine_(std::move(engine)),
      members_(allRanksIfEmpty(std::move(members), engine_->worldSize())),
      world_(static_cast<int>(members_.size())),
      capacity_(roundUp(std::max<size_t>(capacity_bytes, kAlign), kAlign)),
      scratch_(engine_->tracker(), capacity_) {}

void allreduceOnWire(const std::vector<ConstSpan>& inputs, const std::vector<float*>& outputs, DType wire,
                     float scale, WireScratch& scratch,
                     const std::function<AllreduceResult(const std::vector<ConstSpan>&)>& reduce) {
  std::vector<ConstSpan> narrow;
  for (const auto& in : inputs) narrow.push_back({nullptr, in.bytes / 2});
  size_t total;
  const std::vector<size_t> at = ringLayout(narrow, &total);
  uint8_t* base = scratch.get(std::max<size_t>(total, kAlign));
  for (size_t i = 0; i < inputs.size(); ++i) {
    narrow[i].data = base + at[i];
    castToWire(static_cast<const float*>(inputs[i].data), reinterpret_cast<uint16_t*>(base + at[i]),
               inputs[i].bytes / 4, wire);
  }
  const AllreduceResult summed = reduce(narrow);
  for (size_t i = 0; i < inputs.size(); ++i)
    castFromWire(reinterpret_cast<const uint16_t*>(summed.out + summed.offsets[i]), outputs[i],
                 inputs[i].bytes / 4, wire, scale);
}

std::vector<int> allRanksIfEmpty(std::vector<int> members, int world) {
  if (members.empty())
    for (int r = 0; r < world; ++r) members.push_back(r);
  for (int r : members)
    if (r < 0 || r >= world)
      throw EngineError(strCat("allreduce: member rank ", r, " is outside 0..", world - 1));
  return members;
}

int positionOf(const std::vector<int>& members, int rank) {
  auto it = std::find(members.begin(), members.end(), rank);
  if (it == members.end())
    throw EngineError(strCat("allreduce: rank ", rank, " is not a member of its ring"));
  if (std::find(it + 1, members.end(), rank) != members.end())
    throw EngineError(strCat("allreduce: rank ", rank, " is listed twice among the ring's members"));
  return static_cast<int>(it - members.begin());
}

uint64_t callSignature(const std::vector<ConstSpan>& inputs, DType dtype) {
  for (const auto& in : inputs)
    if (in.bytes % dtypeSize(dtype))
      throw EngineError("allreduce: tensor size is not a multiple of its dtype size");
  uint64_t signature = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) signature = (signature ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  mix(static_cast<uint64_t>(dtype));
  mix(inputs.size());
  for (const auto& in : inputs) mix(in.bytes);
  return signature | 1;
}

std::vector<size_t> ringLayout(const std::vector<ConstSpan>& inputs, size_t* total) {
  std::vector<size_t> offsets(inputs.size());
  size_t at = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    offsets[i] = at;
    at = roundUp(at + inputs[i].bytes, kAlign);
  }
  *total = at;
  return offsets;
}

std::vector<size_t> ringLayoutWithin(const std::vector<ConstSpan>& inputs, size_t capacity,
                                     const char* holder, size_t* total) {
  std::vector<size_t> offsets = ringLayout(inputs, total);
  if (*total > capacity)
    throw EngineError(strCat("allreduce of ", *total, " bytes exceeds this ", holder, "'s capacity of ",
                             capacity, " bytes"));
  return offsets;
}

}  // namespace rdkeras
