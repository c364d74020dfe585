#include "engine/collectives.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "engine/copy.h"

namespace rdkeras {
namespace {

constexpr size_t kAlign = 64;
size_t roundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

template <typename T>
void addScaled(T* __restrict out, const T* __restrict a, const T* __restrict b, size_t n, T scale) {
  if (scale == T(1)) {
    for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = (a[i] + b[i]) * scale;
  }
}

#if defined(__x86_64__)
// The same for float32 with streaming stores: a large chunk's output would miss
// the cache anyway, and streaming skips reading every output line first.
__attribute__((target("avx2"))) void addScaledStream(float* out, const float* a, const float* b, size_t n,
                                                     float scale) {
  size_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(out + i) % 32; ++i) out[i] = (a[i] + b[i]) * scale;
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8)
    _mm256_stream_ps(out + i,
                     _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)), s));
  for (; i < n; ++i) out[i] = (a[i] + b[i]) * scale;
  _mm_sfence();
}
#endif

void addFloat(float* out, const float* a, const float* b, size_t n, float scale, size_t nontemporal_from) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && n * sizeof(float) >= nontemporal_from) return addScaledStream(out, a, b, n, scale);
#endif
  addScaled(out, a, b, n, scale);
}

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

}  // namespace

namespace {

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

}  // namespace

RingAllreduce::RingAllreduce(std::shared_ptr<Engine> engine, size_t capacity_bytes, size_t bucket_bytes,
                             std::vector<int> members)
    : engine_(std::move(engine)),
      members_(allRanksIfEmpty(std::move(members), engine_->worldSize())),
      rank_(positionOf(members_, engine_->rank())),
      world_(static_cast<int>(members_.size())),
      left_(members_[(rank_ + world_ - 1) % world_]),
      right_(members_[(rank_ + 1) % world_]),
      capacity_(roundUp(std::max<size_t>(capacity_bytes, kAlign), kAlign)),
      bucket_bytes_(roundUp(std::max<size_t>(bucket_bytes, kAlign * world_), kAlign * world_)) {
  slot_bytes_ = roundUp(bucket_bytes_ / world_, kAlign);
  registered_ = std::make_unique<RegisteredBlock>(engine_->tracker(), offSignature() + 64);
  block_ = registered_->data();
}

RingAllreduce::~RingAllreduce() {
  // With two members the ack travels ahead of the allgather's chunks on the same connection; with
  // more, the right member may ack after this rank has everything it needs.
  if (right_key_ != 0 && messages_ > 0) engine_->settleFlag(block_ + offAck(), messages_, right_);
}

std::string RingAllreduce::localDescriptor() const {
  return strCat("ring;rank=", engine_->rank(), ";key=", registered_->key(), ";capacity=", capacity_,
                ";bucket=", bucket_bytes_);
}

void RingAllreduce::connect(const std::string& left, const std::string& right) {
  for (const auto* d : {&left, &right}) {
    if (fieldNumber(*d, "capacity") != capacity_ || fieldNumber(*d, "bucket") != bucket_bytes_)
      throw EngineError(strCat("allreduce: rank ", field(*d, "rank"), " declared another capacity/bucket (",
                               *d, ") than this rank (", localDescriptor(), ")"));
  }
  if (fieldNumber(left, "rank") != static_cast<uint64_t>(left_) ||
      fieldNumber(right, "rank") != static_cast<uint64_t>(right_))
    throw EngineError("allreduce: neighbour descriptors from the wrong ranks");
  left_key_ = fieldNumber(left, "key");
  right_key_ = fieldNumber(right, "key");
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

ChunkRange ringChunk(size_t b0, size_t b1, int n, int c) {
  const size_t chunk = roundUp((b1 - b0 + n - 1) / n, kAlign);
  const size_t lo = std::min(b1, b0 + static_cast<size_t>((c % n + n) % n) * chunk);
  return {lo, std::min(b1, lo + chunk)};
}

void RingAllreduce::reduceScatterStep(const std::vector<ConstSpan>& inputs,
                                      const std::vector<size_t>& offsets, size_t send_begin, size_t send_end,
                                      bool send_from_inputs, size_t recv_begin, size_t recv_end, uint8_t* out,
                                      DType dtype, double scale, uint64_t signature) {
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  const uint64_t m = messages_;
  const int slot = m % 2;
  // Send: the right neighbour's slot m%2 is free once it acked message m-2.
  if (m >= 2) engine_->waitFlag(block_ + offAck(), m - 1, right_, "allreduce: ack from the right neighbour");
  // The call's first message: the right member learns what we reduce (ordered before the flag).
  if (signature) t.writeFlag(right_, right_key_, offSignature(), signature, deadline);
  if (send_from_inputs) {
    forEachSegment(inputs, offsets, send_begin, send_end, [&](size_t i, size_t lo, size_t hi) {
      t.write(right_, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), right_key_,
              offSlot(slot) + (lo - send_begin), hi - lo, deadline);
    });
  } else if (send_end > send_begin) {
    t.write(right_, out + send_begin, right_key_, offSlot(slot) + 0, send_end - send_begin, deadline);
  }
  t.writeFlag(right_, right_key_, offFlag(slot), m + 1, deadline);
  // Receive the left neighbour's partial sum and add our input to it.
  engine_->waitFlag(block_ + offFlag(slot), m + 1, left_, "allreduce: data from the left neighbour");
  if (signature && loadAcquire(block_ + offSignature()) != signature) {
    const std::string why = strCat("allreduce: rank ", left_, " passed other tensors than this rank (rank ",
                                   engine_->rank(), ": ", inputs.size(), " tensors, ", total_bytes_,
                                   " bytes of ", dtype == DType::kFloat32 ? "float32" : "float64",
                                   "); every member must pass the same sizes and dtype, in the same order");
    engine_->reportOwnFailure(why);
    throw EngineError(why);
  }
  engine_->countReceived(recv_end - recv_begin);
  const uint8_t* staged = block_ + offSlot(slot);
  forEachSegment(inputs, offsets, recv_begin, recv_end, [&](size_t i, size_t lo, size_t hi) {
    const auto* in = static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]);
    const uint8_t* partial = staged + (lo - recv_begin);
    if (dtype == DType::kFloat32)
      addFloat(reinterpret_cast<float*>(out + lo), reinterpret_cast<const float*>(in),
               reinterpret_cast<const float*>(partial), (hi - lo) / 4, static_cast<float>(scale),
               engine_->transportOptions().nt_threshold);
    else
      addScaled(reinterpret_cast<double*>(out + lo), reinterpret_cast<const double*>(in),
                reinterpret_cast<const double*>(partial), (hi - lo) / 8, scale);
  });
  t.writeFlag(left_, left_key_, offAck(), m + 1, deadline);
  ++messages_;
}

void RingAllreduce::allgatherStep(uint8_t* out, size_t out_offset_in_region, size_t send_begin,
                                  size_t send_end) {
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  if (send_end > send_begin)
    t.write(right_, out + send_begin, right_key_, out_offset_in_region + send_begin, send_end - send_begin,
            deadline);
  t.writeFlag(right_, right_key_, offGather(), gathers_ + 1, deadline);
  engine_->waitFlag(block_ + offGather(), gathers_ + 1, left_, "allreduce: gathered chunk from the left");
  ++gathers_;
}

RingAllreduce::Result RingAllreduce::run(const std::vector<ConstSpan>& inputs, DType dtype, bool average,
                                         const ChunkHook& between) {
  size_t total;
  std::vector<size_t> offsets = ringLayout(inputs, &total);
  if (total > capacity_)
    throw EngineError(
        strCat("allreduce of ", total, " bytes exceeds this ring's capacity of ", capacity_, " bytes"));
  const size_t elem = dtype == DType::kFloat32 ? 4 : 8;
  for (const auto& in : inputs)
    if (in.bytes % elem) throw EngineError("allreduce: tensor size is not a multiple of its dtype size");
  total_bytes_ = 0;
  for (const auto& in : inputs) total_bytes_ += in.bytes;
  // What every member must agree on: dtype, count and sizes (FNV-1a; never 0).
  uint64_t signature = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) signature = (signature ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  mix(static_cast<uint64_t>(dtype));
  mix(inputs.size());
  for (const auto& in : inputs) mix(in.bytes);
  signature |= 1;
  const size_t out_region_offset = (calls_++ % 2) * capacity_;
  uint8_t* out = block_ + out_region_offset;
  const int n = world_;
  if (n == 1) {
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      std::memcpy(out + lo, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), hi - lo);
    });
    if (between) {
      for (size_t b0 = 0; b0 == 0 || b0 < total; b0 += bucket_bytes_)  // the same passes as with members
        between(out + b0, std::min(total, b0 + bucket_bytes_) - b0);
    }
    return {out, std::move(offsets)};
  }
  if (right_key_ == 0) throw EngineError("allreduce: run() before connect()");
  const double inv = average ? 1.0 / n : 1.0;
  // At least one pass, even for nothing: the signature must reach the neighbour every call.
  for (size_t b0 = 0; b0 == 0 || b0 < total; b0 += bucket_bytes_) {
    const size_t b1 = std::min(total, b0 + bucket_bytes_);
    auto lo = [&](int c) { return ringChunk(b0, b1, n, c).lo; };
    auto hi = [&](int c) { return ringChunk(b0, b1, n, c).hi; };
    // Reduce-scatter: at step s send chunk rank-s, receive chunk rank-s-1.
    for (int s = 0; s < n - 1; ++s) {
      const int send = rank_ - s, recv = rank_ - s - 1;
      reduceScatterStep(inputs, offsets, lo(send), hi(send), s == 0, lo(recv), hi(recv), out, dtype,
                        s == n - 2 ? inv : 1.0, b0 == 0 && s == 0 ? signature : 0);
    }
    if (between) between(out + lo(rank_ + 1), hi(rank_ + 1) - lo(rank_ + 1));  // the chunk summed here
    // Allgather: at step s send the complete chunk rank+1-s; the left neighbour
    // writes chunk rank-s straight into our output block.
    for (int s = 0; s < n - 1; ++s) {
      allgatherStep(out, out_region_offset, lo(rank_ + 1 - s), hi(rank_ + 1 - s));
      engine_->countReceived(hi(rank_ - s) - lo(rank_ - s));  // what the left neighbour wrote
    }
  }
  return {out, std::move(offsets)};
}

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
                                            int world) {
  const double scale = average ? 1.0 / world : 1.0;
  return inside.run(inputs, dtype, false, [&](uint8_t* chunk, size_t bytes) {
    // Every host's member at this position holds the same chunk (same layout, same ring order): equal sizes.
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
