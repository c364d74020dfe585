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
// Streaming runs over four pages at once, a row of each in turn, as glibc's large memcpy does:
// four store streams keep more DRAM pages open and more write-combining buffers busy than one
// (docs/evaluation/design-choices.md has the measurements).
constexpr size_t kPage = 4096;
constexpr size_t kPages = 4;

__attribute__((target("avx2"))) void streamAvx2(char* dst, const char* src, size_t n) {  // n % 128 == 0
  const auto row = [](char* d, const char* s) __attribute__((target("avx2"))) {
    _mm_prefetch(s + 256, _MM_HINT_T0);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
  };
  size_t i = 0;
  for (; i + kPages * kPage <= n; i += kPages * kPage)
    for (size_t j = 0; j < kPage; j += 128)
      for (size_t p = 0; p < kPages; ++p) row(dst + i + p * kPage + j, src + i + p * kPage + j);
  for (; i < n; i += 128) row(dst + i, src + i);
}

// Without AVX2 (x86-64 before 2013): one stream.
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
