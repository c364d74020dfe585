#include "engine/reduce.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "engine/common.h"

namespace rdkeras {
namespace {

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

}  // namespace

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

}  // namespace rdkeras
