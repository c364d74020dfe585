// What the allreduce algorithms share: a call's inputs and result, the padded layout every member agrees on,
// the call's signature, the members of a collective, and the wire-typed copy of float32 inputs.
// The algorithms: ring.h (bandwidth-optimal), doubling.h (small tensors), hierarchical.h (across hosts);
// their element-wise sums and casts: reduce.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/reduce.h"

namespace rdkeras {

constexpr size_t kAlign = 64;  // every tensor of a layout, and every chunk, starts on a cache line

struct ConstSpan {
  const void* data;
  size_t bytes;
};

// What an allreduce returns: tensor i's sum starts at out + offsets[i] (64-byte aligned), in registered
// memory that stays intact until the next-but-one call.
struct AllreduceResult {
  uint8_t* out;
  std::vector<size_t> offsets;
};

// Registered memory an allreduce reads a wire-typed copy of its inputs from: `bytes` (its capacity),
// registered on first use and kept (a one-sided write from it may still be in flight when a call returns).
class WireScratch {
 public:
  WireScratch(TensorTracker& tracker, size_t bytes) : tracker_(tracker), bytes_(bytes) {}
  uint8_t* get(size_t bytes);

 private:
  TensorTracker& tracker_;
  size_t bytes_;
  std::unique_ptr<RegisteredBlock> block_;
};

// What every allreduce group is, whatever its algorithm (RingAllreduce, DoublingAllreduce): its engine, its
// members (engine ranks) and their count, the capacity of one output block, its name on the face and the
// registered scratch its wire-typed copies go to.
class CollectiveGroup {
 public:
  size_t capacity() const { return capacity_; }
  int size() const { return world_; }
  const std::shared_ptr<Engine>& engine() const { return engine_; }
  // What a hung member's error calls this group's calls ("ring grads"): its name on the face.
  const std::string& name() const { return name_; }
  void setName(std::string name) { name_ = std::move(name); }
  WireScratch& wireScratch() { return scratch_; }

 protected:
  // `members` empty: every rank of the engine's world (each checked to be one); the capacity rounded up to
  // whole cache lines.
  CollectiveGroup(std::shared_ptr<Engine> engine, size_t capacity_bytes, std::vector<int> members);

  std::shared_ptr<Engine> engine_;
  std::vector<int> members_;
  std::string name_;
  int world_;
  size_t capacity_;
  WireScratch scratch_;
};

// Runs `reduce` over `inputs` (float32) cast to `wire`, and casts the sums back into `outputs` (one float32
// buffer per input, as large), scaled by `scale`. The inputs' copies are laid out as the reduction lays out
// its inputs, in `scratch`.
void allreduceOnWire(const std::vector<ConstSpan>& inputs, const std::vector<float*>& outputs, DType wire,
                     float scale, WireScratch& scratch,
                     const std::function<AllreduceResult(const std::vector<ConstSpan>&)>& reduce);

// The bytes of `inputs`, padding excluded.
inline size_t inputBytes(const std::vector<ConstSpan>& inputs) {
  size_t n = 0;
  for (const ConstSpan& in : inputs) n += in.bytes;
  return n;
}

// Where each tensor starts in an allreduce's output block (64-byte aligned); *total is the padded size.
std::vector<size_t> ringLayout(const std::vector<ConstSpan>& inputs, size_t* total);
// ringLayout for a call into a block of `capacity` bytes: raises, naming this `holder`'s capacity ("ring",
// "group"), where the padded size exceeds it.
std::vector<size_t> ringLayoutWithin(const std::vector<ConstSpan>& inputs, size_t capacity,
                                     const char* holder, size_t* total);

// What every member of an allreduce must agree on: dtype, count and sizes (FNV-1a; never 0).
uint64_t callSignature(const std::vector<ConstSpan>& inputs, DType dtype);

// The engine ranks of a collective: `members` (in order), or every rank of a world of `world` if empty; each
// checked to be a rank of it.
std::vector<int> allRanksIfEmpty(std::vector<int> members, int world);
// Where `rank` stands among `members` (once, or it raises).
int positionOf(const std::vector<int>& members, int rank);

// Calls fn(i, lo, hi) for every tensor i overlapping [begin, end) of the padded
// layout, with [lo, hi) the overlap in layout bytes (padding excluded).
template <typename Fn>
void forEachSegment(const std::vector<ConstSpan>& inputs, const std::vector<size_t>& offsets, size_t begin,
                    size_t end, Fn&& fn) {
  auto it = std::upper_bound(offsets.begin(), offsets.end(), begin);
  size_t i = it == offsets.begin() ? 0 : (it - offsets.begin()) - 1;
  for (; i < inputs.size() && offsets[i] < end; ++i) {
    const size_t lo = std::max(begin, offsets[i]);
    const size_t hi = std::min(end, offsets[i] + inputs[i].bytes);
    if (lo < hi) fn(i, lo, hi);
  }
}

}  // namespace rdkeras
