#include "engine/collectives.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

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

float bitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

uint16_t toBFloat16(float f) {
  const uint32_t u = floatBits(f);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays quiet NaN
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float fromBFloat16(uint16_t h) { return bitsToFloat(static_cast<uint32_t>(h) << 16); }

uint16_t toFloat16(float f) {
  const uint32_t u = floatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000, abs = u & 0x7fffffff;
  if (abs >= 0x7f800000) return static_cast<uint16_t>(sign | (abs > 0x7f800000 ? 0x7e00 : 0x7c00));
  if (abs >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to >= 65520: infinity
  if (abs < 0x38800000) {  // below 2^-14: a subnormal; adding 0.5 rounds to a multiple of 2^-24
    return static_cast<uint16_t>(sign | (floatBits(bitsToFloat(abs) + 0.5f) - 0x3f000000));
  }
  // Rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  return static_cast<uint16_t>(sign | ((abs + 0xc8000fff + ((abs >> 13) & 1)) >> 13));
}
float fromFloat16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) return bitsToFloat(sign | floatBits(static_cast<float>(mant) * 0x1p-24f));
  if (exp == 31) return bitsToFloat(sign | 0x7f800000 | (mant << 13));
  return bitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

#if defined(__x86_64__)
// Eight floats to eight wire values and back, round to nearest even: F16C for float16; for bfloat16 the
// scalar rounding on 32-bit lanes (NaN kept quiet), then packed.
__attribute__((target("avx2,f16c"))) inline __m128i toWire8(__m256 f, DType wire) {
  if (wire == DType::kFloat16) return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}
__attribute__((target("avx2,f16c"))) inline __m256 fromWire8(__m128i h, DType wire) {
  if (wire == DType::kFloat16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__m128i load8(const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
void store8(uint16_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

// The vector part of each loop (a multiple of 8 elements); returns how many it did.
__attribute__((target("avx2,f16c"))) size_t toWireVec(const float* src, uint16_t* dst, size_t n, DType wire) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, toWire8(_mm256_loadu_ps(src + i), wire));
  return i;
}
__attribute__((target("avx2,f16c"))) size_t fromWireVec(const uint16_t* src, float* dst, size_t n, DType wire,
                                                        float scale) {
  size_t i = 0;
  const __m256 k = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(fromWire8(load8(src + i), wire), k));
  return i;
}
__attribute__((target("avx2,f16c"))) size_t addWireVec(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                                       size_t n, float scale, DType wire) {
  size_t i = 0;
  const __m256 k = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    const __m256 sum = _mm256_add_ps(fromWire8(load8(a + i), wire), fromWire8(load8(b + i), wire));
    store8(out + i, toWire8(_mm256_mul_ps(sum, k), wire));
  }
  return i;
}
bool hasAvx2F16c() {
  // Every x86 CPU with AVX2 has F16C (Intel since Ivy Bridge, AMD since Piledriver), and clang's builtin does
  // not know "f16c".
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#else
size_t toWireVec(const float*, uint16_t*, size_t, DType) { return 0; }
size_t fromWireVec(const uint16_t*, float*, size_t, DType, float) { return 0; }
size_t addWireVec(uint16_t*, const uint16_t*, const uint16_t*, size_t, float, DType) { return 0; }
bool hasAvx2F16c() { return false; }
#endif

// out = wire((float(a) + float(b)) * scale), element-wise over a 16-bit wire type (out may be a).
void addWire(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n, float scale, DType wire) {
  size_t i = hasAvx2F16c() ? addWireVec(out, a, b, n, scale, wire) : 0;
  if (wire == DType::kFloat16)
    for (; i < n; ++i) out[i] = toFloat16((fromFloat16(a[i]) + fromFloat16(b[i])) * scale);
  else
    for (; i < n; ++i) out[i] = toBFloat16((fromBFloat16(a[i]) + fromBFloat16(b[i])) * scale);
}

// out = (a + b) * scale over `bytes` of `dtype`; out may be a (not b).
void addInto(DType dtype, uint8_t* out, const uint8_t* a, const uint8_t* b, size_t bytes, double scale,
             size_t nontemporal_from) {
  switch (dtype) {
    case DType::kFloat32:
      if (out == a) {
        auto* o = reinterpret_cast<float*>(out);
        const auto* q = reinterpret_cast<const float*>(b);
        const auto k = static_cast<float>(scale);
        for (size_t i = 0; i < bytes / 4; ++i) o[i] = (o[i] + q[i]) * k;
        return;
      }
      return addFloat(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(a),
                      reinterpret_cast<const float*>(b), bytes / 4, static_cast<float>(scale),
                      nontemporal_from);
    case DType::kFloat64:
      if (out == a) {
        auto* o = reinterpret_cast<double*>(out);
        const auto* q = reinterpret_cast<const double*>(b);
        for (size_t i = 0; i < bytes / 8; ++i) o[i] = (o[i] + q[i]) * scale;
        return;
      }
      return addScaled(reinterpret_cast<double*>(out), reinterpret_cast<const double*>(a),
                       reinterpret_cast<const double*>(b), bytes / 8, scale);
    case DType::kFloat16:
    case DType::kBFloat16:
      return addWire(reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t*>(a),
                     reinterpret_cast<const uint16_t*>(b), bytes / 2, static_cast<float>(scale), dtype);
  }
}

}  // namespace

size_t dtypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    default:
      return 2;
  }
}

const char* dtypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    default:
      return "bfloat16";
  }
}

void castToWire(const float* src, uint16_t* dst, size_t n, DType wire) {
  if (wire != DType::kFloat16 && wire != DType::kBFloat16)
    throw EngineError(strCat("cannot cast float32 to ", dtypeName(wire), " for the wire"));
  size_t i = hasAvx2F16c() ? toWireVec(src, dst, n, wire) : 0;
  for (; i < n; ++i) dst[i] = wire == DType::kFloat16 ? toFloat16(src[i]) : toBFloat16(src[i]);
}

void castFromWire(const uint16_t* src, float* dst, size_t n, DType wire, float scale) {
  if (wire != DType::kFloat16 && wire != DType::kBFloat16)
    throw EngineError(strCat("cannot cast ", dtypeName(wire), " from the wire"));
  size_t i = hasAvx2F16c() ? fromWireVec(src, dst, n, wire, scale) : 0;
  for (; i < n; ++i) dst[i] = (wire == DType::kFloat16 ? fromFloat16(src[i]) : fromBFloat16(src[i])) * scale;
}

uint8_t* WireScratch::get(size_t bytes) {
  if (bytes > bytes_)
    throw EngineError(strCat("allreduce: ", bytes, " bytes on the wire exceed the capacity of ", bytes_));
  if (!block_) block_ = std::make_unique<RegisteredBlock>(tracker_, bytes_);  // on first use, never replaced
  return block_->data();
}

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

namespace {

// Runs a ring's hook on each pass's chunk, passes in order, on a thread of its own (see RingAllreduce::run).
class PassHooks {
 public:
  explicit PassHooks(const RingAllreduce::ChunkHook& hook) : hook_(hook), thread_([this] { loop(); }) {}
  // The caller failed (or is done): starts no further hook and waits for the one running, whose own waits
  // are bounded by the engine's deadline.
  ~PassHooks() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  PassHooks(const PassHooks&) = delete;
  PassHooks& operator=(const PassHooks&) = delete;

  void submit(uint8_t* chunk, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back({chunk, bytes});
    }
    cv_.notify_all();
  }
  // Until the first `count` hooks are done; rethrows what a hook threw.
  void waitDone(size_t count) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= count || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop() {
    while (true) {
      std::pair<uint8_t*, size_t> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || done_ < jobs_.size(); });
        if (stopping_) return;
        job = jobs_[done_];
      }
      try {
        hook_(job.first, job.second);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        error_ = std::current_exception();
        cv_.notify_all();
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++done_;
      }
      cv_.notify_all();
    }
  }

  const RingAllreduce::ChunkHook& hook_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<uint8_t*, size_t>> jobs_;
  size_t done_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started once the rest is initialised
};

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
      bucket_bytes_(roundUp(std::max<size_t>(bucket_bytes, kAlign * world_), kAlign * world_)),
      scratch_(engine_->tracker(), capacity_) {
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
    const std::string why =
        strCat("allreduce: rank ", left_, " passed other tensors than this rank (rank ", engine_->rank(),
               ": ", inputs.size(), " tensors, ", total_bytes_, " bytes of ", dtypeName(dtype),
               "); every member must pass the same sizes and dtype, in the same order");
    engine_->reportOwnFailure(why);
    throw EngineError(why);
  }
  engine_->countReceived(recv_end - recv_begin);
  const uint8_t* staged = block_ + offSlot(slot);
  forEachSegment(inputs, offsets, recv_begin, recv_end, [&](size_t i, size_t lo, size_t hi) {
    const auto* in = static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]);
    addInto(dtype, out + lo, in, staged + (lo - recv_begin), hi - lo, scale,
            engine_->transportOptions().nt_threshold);
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
  total_bytes_ = 0;
  for (const auto& in : inputs) total_bytes_ += in.bytes;
  const uint64_t signature = callSignature(inputs, dtype);
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
  // Allgather of pass [b0, b1): at step s send the complete chunk rank+1-s; the left neighbour writes chunk
  // rank-s straight into our output block.
  auto allgather = [&](size_t b0, size_t b1) {
    for (int s = 0; s < n - 1; ++s) {
      const ChunkRange send = ringChunk(b0, b1, n, rank_ + 1 - s), recv = ringChunk(b0, b1, n, rank_ - s);
      allgatherStep(out, out_region_offset, send.lo, send.hi);
      engine_->countReceived(recv.hi - recv.lo);  // what the left neighbour wrote
    }
  };
  // With a hook and more than one pass, the hook of pass k runs on a thread of its own while this one
  // reduce-scatters pass k+1 and allgathers pass k-1: the same order of messages on every member.
  std::optional<PassHooks> hooks;
  if (between && total > bucket_bytes_) hooks.emplace(between);
  size_t passes = 0, gather_b0 = 0, gather_b1 = 0;  // the pass whose allgather waits for its hook
  // At least one pass, even for nothing: the signature must reach the neighbour every call.
  for (size_t b0 = 0; b0 == 0 || b0 < total; b0 += bucket_bytes_) {
    const size_t b1 = std::min(total, b0 + bucket_bytes_);
    // Reduce-scatter: at step s send chunk rank-s, receive chunk rank-s-1.
    for (int s = 0; s < n - 1; ++s) {
      const ChunkRange send = ringChunk(b0, b1, n, rank_ - s), recv = ringChunk(b0, b1, n, rank_ - s - 1);
      reduceScatterStep(inputs, offsets, send.lo, send.hi, s == 0, recv.lo, recv.hi, out, dtype,
                        s == n - 2 ? inv : 1.0, b0 == 0 && s == 0 ? signature : 0);
    }
    const ChunkRange mine = ringChunk(b0, b1, n, rank_ + 1);  // the chunk summed here
    if (!hooks) {
      if (between) between(out + mine.lo, mine.hi - mine.lo);
      allgather(b0, b1);
      continue;
    }
    hooks->submit(out + mine.lo, mine.hi - mine.lo);
    if (passes++ > 0) {
      hooks->waitDone(passes - 1);
      allgather(gather_b0, gather_b1);
    }
    gather_b0 = b0, gather_b1 = b1;
  }
  if (hooks) {
    hooks->waitDone(passes);
    allgather(gather_b0, gather_b1);
  }
  return {out, std::move(offsets)};
}

namespace {

int largestPowerOfTwo(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

int log2Of(int power) {
  int k = 0;
  while ((1 << k) < power) ++k;
  return k;
}

}  // namespace

DoublingAllreduce::DoublingAllreduce(std::shared_ptr<Engine> engine, size_t capacity_bytes,
                                     std::vector<int> members)
    : engine_(std::move(engine)),
      members_(allRanksIfEmpty(std::move(members), engine_->worldSize())),
      position_(positionOf(members_, engine_->rank())),
      world_(static_cast<int>(members_.size())),
      power_(largestPowerOfTwo(world_)),
      steps_(log2Of(power_)),
      capacity_(roundUp(std::max<size_t>(capacity_bytes, kAlign), kAlign)),
      acked_by_(steps_ + 1, -1),
      scratch_(engine_->tracker(), capacity_) {
  registered_ = std::make_unique<RegisteredBlock>(engine_->tracker(), offAck(steps_ + 1));
  block_ = registered_->data();
}

DoublingAllreduce::~DoublingAllreduce() {
  // A partner acks each message once it has read it: until then this rank's message may be read from its
  // block.
  if (calls_ == 0) return;
  for (int step = 0; step <= steps_; ++step)
    if (acked_by_[step] >= 0) engine_->settleFlag(block_ + offAck(step), calls_, acked_by_[step]);
}

std::string DoublingAllreduce::localDescriptor() const {
  return strCat("doubling;rank=", engine_->rank(), ";key=", registered_->key(), ";capacity=", capacity_);
}

void DoublingAllreduce::connect(const std::vector<std::string>& descriptors) {
  if (descriptors.size() != members_.size())
    throw EngineError(
        strCat("allreduce: ", descriptors.size(), " descriptors for ", members_.size(), " members"));
  keys_.assign(descriptors.size(), 0);
  const std::vector<int> needed = partners();
  for (size_t p = 0; p < descriptors.size(); ++p) {
    const std::string& d = descriptors[p];
    if (d.empty()) {  // not a partner of this member's: never written to
      if (std::find(needed.begin(), needed.end(), static_cast<int>(p)) != needed.end())
        throw EngineError(strCat("allreduce: no descriptor for partner rank ", members_[p]));
      continue;
    }
    if (fieldNumber(d, "rank") != static_cast<uint64_t>(members_[p]))
      throw EngineError(strCat("allreduce: descriptor ", p, " is rank ", field(d, "rank"), "'s, not rank ",
                               members_[p], "'s"));
    if (fieldNumber(d, "capacity") != capacity_)
      throw EngineError(strCat("allreduce: rank ", field(d, "rank"), " declared another capacity (", d,
                               ") than this rank (", localDescriptor(), ")"));
    keys_[p] = fieldNumber(d, "key");
  }
}

std::vector<int> DoublingAllreduce::partners() const {
  std::vector<int> out;
  if (position_ >= power_) return {position_ - power_};
  if (position_ + power_ < world_) out.push_back(position_ + power_);
  for (int k = 0; k < steps_; ++k) out.push_back(position_ ^ (1 << k));
  return out;
}

void DoublingAllreduce::send(int peer, int step, const std::vector<ConstSpan>& inputs,
                             const std::vector<size_t>& offsets, const uint8_t* out, size_t total,
                             uint64_t signature) {
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  const int rank = members_[peer], parity = static_cast<int>(calls_ % 2);
  const uint64_t key = keys_[peer];
  t.writeFlag(rank, key, offSignature(step, parity), signature, deadline);
  if (out == nullptr) {
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      t.write(rank, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), key,
              offSlot(step, parity) + lo, hi - lo, deadline);
    });
  } else if (total > 0) {
    t.write(rank, out, key, offSlot(step, parity), total, deadline);
  }
  t.writeFlag(rank, key, offFlag(step, parity), calls_ + 1, deadline);
  acked_by_[step] = rank;
}

const uint8_t* DoublingAllreduce::receive(int peer, int step, uint64_t signature, size_t total,
                                          const std::vector<ConstSpan>& inputs, DType dtype) {
  const int rank = members_[peer], parity = static_cast<int>(calls_ % 2);
  engine_->waitFlag(block_ + offFlag(step, parity), calls_ + 1, rank,
                    "allreduce: a partial sum from a partner");
  if (loadAcquire(block_ + offSignature(step, parity)) != signature) {
    size_t bytes = 0;
    for (const auto& in : inputs) bytes += in.bytes;
    const std::string why =
        strCat("allreduce: rank ", rank, " passed other tensors than this rank (rank ", engine_->rank(), ": ",
               inputs.size(), " tensors, ", bytes, " bytes of ", dtypeName(dtype),
               "); every member must pass the same sizes and dtype, in the same order");
    engine_->reportOwnFailure(why);
    throw EngineError(why);
  }
  engine_->countReceived(total);
  return block_ + offSlot(step, parity);
}

AllreduceResult DoublingAllreduce::run(const std::vector<ConstSpan>& inputs, DType dtype, bool average) {
  size_t total;
  std::vector<size_t> offsets = ringLayout(inputs, &total);
  if (total > capacity_)
    throw EngineError(
        strCat("allreduce of ", total, " bytes exceeds this group's capacity of ", capacity_, " bytes"));
  const uint64_t signature = callSignature(inputs, dtype);
  const int parity = static_cast<int>(calls_ % 2);
  uint8_t* out = block_ + parity * capacity_;
  if (world_ > 1 && keys_.empty()) throw EngineError("allreduce: run() before connect()");
  Transport& t = engine_->transport();
  const size_t nt = engine_->transportOptions().nt_threshold;
  const double last_scale = average ? 1.0 / world_ : 1.0;
  auto addInputs = [&](const uint8_t* other, double scale) {  // out = inputs + other, tensor by tensor
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      addInto(dtype, out + lo, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), other + lo,
              hi - lo, scale, nt);
    });
  };
  auto ack = [&](int peer, int step) {
    t.writeFlag(members_[peer], keys_[peer], offAck(step), calls_ + 1, engine_->deadline());
  };
  const int fold = steps_;    // the step index of the fold in and back
  if (position_ >= power_) {  // hand the inputs over, get the sum back straight into this call's output block
    const int core = position_ - power_;
    send(core, fold, inputs, offsets, nullptr, total, signature);
    receive(core, fold, signature, total, inputs, dtype);
    ack(core, fold);
    ++calls_;
    return {out, std::move(offsets)};
  }
  bool from_inputs = true;  // `out` holds nothing yet: the partial sum is the inputs themselves
  if (position_ + power_ < world_) {
    const int extra = position_ + power_;
    const uint8_t* theirs = receive(extra, fold, signature, total, inputs, dtype);
    addInputs(theirs, steps_ == 0 ? last_scale : 1.0);
    ack(extra, fold);
    from_inputs = false;
  }
  for (int k = 0; k < steps_; ++k) {
    const int partner = position_ ^ (1 << k);
    send(partner, k, inputs, offsets, from_inputs ? nullptr : out, total, signature);
    const uint8_t* theirs = receive(partner, k, signature, total, inputs, dtype);
    const double scale = k == steps_ - 1 ? last_scale : 1.0;
    if (from_inputs) {
      addInputs(theirs, scale);
    } else {
      forEachSegment(inputs, offsets, 0, total, [&](size_t, size_t lo, size_t hi) {
        addInto(dtype, out + lo, out + lo, theirs + lo, hi - lo, scale, nt);
      });
    }
    ack(partner, k);
    from_inputs = false;
  }
  if (world_ == 1) {
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      std::memcpy(out + lo, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), hi - lo);
    });
  }
  if (position_ + power_ < world_) {  // the sum back to the member folded in, into its output block
    const int extra = position_ + power_;
    if (total > 0)
      t.write(members_[extra], out, keys_[extra], parity * capacity_, total, engine_->deadline());
    t.writeFlag(members_[extra], keys_[extra], offSignature(fold, parity), signature, engine_->deadline());
    t.writeFlag(members_[extra], keys_[extra], offFlag(fold, parity), calls_ + 1, engine_->deadline());
    acked_by_[fold] = members_[extra];
  }
  ++calls_;
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
