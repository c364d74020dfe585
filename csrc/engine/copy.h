// The one copy a shared-memory transfer makes.
#pragma once

#include <cstddef>

namespace rdkeras {

// Copies n bytes. From `nontemporal_from` bytes on it streams the stores past
// the cache (AVX2/SSE2 non-temporal stores): a message of several MB would
// evict the cache anyway, and streaming skips the read-for-ownership of every
// destination line (docs/architecture.md has the measurements). Below, glibc
// memcpy. The threshold is TransportOptions::nt_threshold.
void transferCopy(void* dst, const void* src, size_t n, size_t nontemporal_from);
// Streams regardless of size (for benchmarks).
void copyNonTemporal(void* dst, const void* src, size_t n);

}  // namespace rdkeras
