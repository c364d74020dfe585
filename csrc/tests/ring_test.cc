// The ring allreduce's arithmetic: the output layout and how buckets split into chunks.
#include <doctest/doctest.h>

#include <vector>

#include "engine/collectives.h"

using namespace rdkeras;

TEST_CASE("the layout starts every tensor on a 64-byte boundary, in order, without overlap") {
  std::vector<ConstSpan> inputs;
  for (size_t bytes : {4, 64, 0, 65, 1000, 8, 4096}) inputs.push_back({nullptr, bytes});
  size_t total = 0;
  const std::vector<size_t> offsets = ringLayout(inputs, &total);
  REQUIRE(offsets.size() == inputs.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    CHECK(offsets[i] % 64 == 0);
    const size_t end = i + 1 < offsets.size() ? offsets[i + 1] : total;
    CHECK(offsets[i] + inputs[i].bytes <= end);
  }
  CHECK(total % 64 == 0);
  CHECK(total == 64 + 64 + 0 + 128 + 1024 + 64 + 4096);
}

TEST_CASE("a bucket's chunks tile it exactly, aligned, for every world size") {
  for (int n = 1; n <= 9; ++n) {
    for (size_t b0 : {size_t{0}, size_t{64 * 1000}}) {
      for (size_t len : {size_t{0}, size_t{64}, size_t{64 * 7}, size_t{64 * 1001}, size_t{1} << 20}) {
        const size_t b1 = b0 + len;
        size_t at = b0;
        for (int c = 0; c < n; ++c) {
          const ChunkRange r = ringChunk(b0, b1, n, c);
          CHECK(r.lo == at);  // chunks follow each other with no gap or overlap
          CHECK(r.hi >= r.lo);
          CHECK(r.hi <= b1);
          if (r.hi < b1) CHECK((r.hi - b0) % 64 == 0);  // all but the last boundary aligned
          at = r.hi;
        }
        CHECK(at == b1);  // and cover the bucket
      }
    }
  }
}

TEST_CASE("chunk indices wrap around the ring, negative ones too") {
  for (int n : {2, 3, 5}) {
    for (int c = -2 * n; c < 3 * n; ++c) {
      const ChunkRange a = ringChunk(0, 64 * 100, n, c), b = ringChunk(0, 64 * 100, n, ((c % n) + n) % n);
      CHECK(a.lo == b.lo);
      CHECK(a.hi == b.hi);
    }
  }
}

TEST_CASE("each chunk is reduced by exactly one rank: the step schedule covers every chunk once") {
  // Reduce-scatter step s on rank r receives chunk r-s-1; after n-1 steps rank r owns chunk r+1.
  for (int n = 2; n <= 8; ++n) {
    std::vector<int> finished_by(n, -1);
    for (int r = 0; r < n; ++r) {
      const int last = ((r - (n - 2) - 1) % n + n) % n;
      CHECK(finished_by[last] == -1);
      finished_by[last] = r;
    }
    for (int c = 0; c < n; ++c) CHECK(finished_by[c] == (c - 1 + n) % n);
  }
}
