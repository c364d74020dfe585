#include "engine/copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace rdkeras {
namespace {

#if defined(__x86_64__)
__attribute__((target("avx2"))) void streamAvx2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
}

void streamSse2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    for (size_t j = 0; j < 64; j += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + j),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + j)));
  }
}
#endif

}  // namespace

void copyNonTemporal(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  const size_t head = std::min(n, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
  std::memcpy(d, s, head);  // align the destination for streaming stores
  d += head, s += head, n -= head;
  static const bool avx2 = __builtin_cpu_supports("avx2");
  const size_t body = avx2 ? n / 128 * 128 : n / 64 * 64;
  if (avx2)
    streamAvx2(d, s, body);
  else
    streamSse2(d, s, body);
  std::memcpy(d + body, s + body, n - body);
  _mm_sfence();  // streaming stores are weakly ordered: publish them before returning
#else
  std::memcpy(dst, src, n);
#endif
}

void transferCopy(void* dst, const void* src, size_t n, size_t nontemporal_from) {
  if (n >= nontemporal_from)
    copyNonTemporal(dst, src, n);
  else
    std::memcpy(dst, src, n);
}

}  // namespace rdkeras
