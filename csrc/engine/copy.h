// The one copy a shared-memory transfer makes.
#pragma once

#include <cstddef>

namespace rdkeras {

// Copies n bytes. At or above nonTemporalThreshold() it streams the stores past
// the cache (AVX2/SSE2 non-temporal stores): a message larger than a few MB
// would evict the cache anyway, and streaming skips the read-for-ownership of
// every destination line. Measured on this 2-core EPYC VM: 16 MB 27 GB/s vs
// glibc memcpy's 18; 64-256 MB 22 vs 13. Below the threshold, glibc memcpy.
void transferCopy(void* dst, const void* src, size_t n);
// Streams regardless of size (for benchmarks).
void copyNonTemporal(void* dst, const void* src, size_t n);
// RDKERAS_NT_THRESHOLD (bytes) or 8 MiB; 0 disables streaming.
size_t nonTemporalThreshold();

}  // namespace rdkeras
