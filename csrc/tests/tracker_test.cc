// The tensor tracker: size classes, pool reuse, the registration cache.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <cstring>

#include "engine/arena.h"
#include "engine/common.h"
#include "engine/tensor_tracker.h"

using namespace rdkeras;

TEST_CASE("size classes cover n with at most a quarter (or one 64-byte granule) of slack") {
  for (size_t n = 0; n < (1 << 20); n += 1 + n / 7) {
    const size_t c = TensorTracker::sizeClass(n);
    CHECK(c >= n);
    CHECK(c % 64 == 0);
    CHECK(c <= n + std::max<size_t>(64, n / 4));  // a quarter step, or one 64-byte granule
  }
  CHECK(TensorTracker::sizeClass(0) == 64);
  CHECK(TensorTracker::sizeClass(64) == 64);
  CHECK(TensorTracker::sizeClass(65) == 128);
  CHECK(TensorTracker::sizeClass(size_t{3} << 30) == size_t{3} << 30);
  CHECK(TensorTracker::sizeClass(size_t{1} << 62) == size_t{1} << 62);
  // A size whose rounding would wrap around is refused, not rounded to 0.
  CHECK_THROWS_AS(TensorTracker::sizeClass(~size_t{0} - 7), EngineError);
}

TEST_CASE("a released block comes back for the same class, aligned") {
  Arena arena(size_t{64} << 20);
  TensorTracker t(arena);
  void* a = t.allocate(1000);
  CHECK(reinterpret_cast<uintptr_t>(a) % 64 == 0);
  t.release(a);
  void* b = t.allocate(900);  // same class
  CHECK(b == a);
  void* c = t.allocate(100000);
  CHECK(reinterpret_cast<uintptr_t>(c) % 4096 == 0);  // large blocks start on a page
  CHECK(t.counters().pool_reuses == 1);
  CHECK_THROWS_AS(t.release(static_cast<uint8_t*>(b) + 64), EngineError);  // not a block start
  t.release(b);
  CHECK_THROWS_AS(t.release(b), EngineError);  // twice
  t.release(c);
}

namespace {
size_t residentBytes(const Arena& arena) {  // the memfd's pages the kernel holds
  struct stat st{};
  REQUIRE(fstat(arena.fd(), &st) == 0);
  return static_cast<size_t>(st.st_blocks) * 512;
}
}  // namespace

TEST_CASE("a large released block gives its pages back; one a registration may pin keeps them") {
  Arena arena(size_t{64} << 20);
  TensorTracker t(arena);
  const size_t n = size_t{4} << 20;
  auto* big = static_cast<uint8_t*>(t.allocate(n));
  std::memset(big, 7, n);
  const size_t touched = residentBytes(arena);
  CHECK(touched >= n);
  t.release(big);
  CHECK(residentBytes(arena) <= touched - n);
  CHECK(t.counters().pool_bytes_discarded == TensorTracker::sizeClass(n));
  auto* again = static_cast<uint8_t*>(t.allocate(n));  // the same block, its pages fresh zeros
  CHECK(again == big);
  CHECK(again[0] == 0);
  CHECK(again[n - 1] == 0);
  std::memset(again, 7, n);
  t.lookupOrRegister(again, n);  // cached for good: verbs would pin its pages
  t.release(again);
  CHECK(t.counters().pool_bytes_discarded == TensorTracker::sizeClass(n));
  auto* small = static_cast<uint8_t*>(t.allocate(100000));  // below kDiscardBytes: kept as it is
  std::memset(small, 7, 100000);
  t.release(small);
  CHECK(t.counters().pool_bytes_discarded == TensorTracker::sizeClass(n));
}

TEST_CASE("an exhausted arena names the variable to raise") {
  Arena arena(Arena::kHeaderBytes * 2);
  TensorTracker t(arena);
  CHECK_THROWS_WITH_AS(t.allocate(Arena::kHeaderBytes * 2), doctest::Contains("RDKERAS_ARENA_BYTES"),
                       EngineError);
}

TEST_CASE("pool blocks are registered once, whole, and then found in the cache") {
  Arena arena(size_t{64} << 20);
  TensorTracker t(arena);
  auto* p = static_cast<uint8_t*>(t.allocate(4096));
  const auto [key, offset] = t.lookupOrRegister(p + 100, 50);
  CHECK(offset == 100);
  const auto again = t.lookupOrRegister(p + 10, 4000);
  CHECK(again.first == key);
  CHECK(again.second == 10);
  CHECK(t.counters().registrations == 1);
  CHECK(t.counters().cache_hits == 1);
  RegionInfo info;
  REQUIRE(arena.table().lookup(key, &info));
  CHECK(info.length >= 4096);
}

TEST_CASE("outside memory goes into a bounded LRU and keeps its owner alive while cached") {
  Arena arena(size_t{64} << 20);
  TensorTracker t(arena);
  std::vector<std::vector<uint8_t>> buffers(TensorTracker::kExternalCacheEntries + 1,
                                            std::vector<uint8_t>(64));
  auto owner = std::make_shared<int>(1);
  t.lookupOrRegister(buffers[0].data(), 64, owner);
  CHECK(owner.use_count() == 2);
  for (size_t i = 1; i < buffers.size(); ++i) t.lookupOrRegister(buffers[i].data(), 64);
  CHECK(owner.use_count() == 1);  // evicted: the cache let go of it
  CHECK(t.counters().deregistrations == 1);
}

TEST_CASE("registerRegion keeps its owner until deregistered") {
  Arena arena(size_t{64} << 20);
  TensorTracker t(arena);
  std::vector<uint8_t> buf(128);
  auto owner = std::make_shared<int>(1);
  const uint64_t key = t.registerRegion(buf.data(), buf.size(), owner);
  CHECK(owner.use_count() == 2);
  t.deregisterRegion(key);
  CHECK(owner.use_count() == 1);
  CHECK_THROWS_AS(t.deregisterRegion(key), EngineError);
}

namespace {

// A registrar that hands out keys 1, 2, ... and remembers what was registered.
struct FakeRegistrar : MemoryRegistrar {
  std::vector<std::pair<const void*, size_t>> registered;
  std::vector<uint64_t> deregistered;
  uint64_t registerMemory(const void* p, size_t n) override {
    registered.emplace_back(p, n);
    return registered.size();
  }
  void deregisterMemory(uint64_t rkey) override { deregistered.push_back(rkey); }
};

}  // namespace

TEST_CASE("registerLocal registers only where a registrar needs it, and then once per block") {
  Arena arena(size_t{64} << 20);
  TensorTracker t(arena);
  auto* p = static_cast<uint8_t*>(t.allocate(4096));
  t.registerLocal(p, 4096);  // no registrar (shm, tcp): nothing to do
  CHECK(t.counters().registrations == 0);

  FakeRegistrar registrar;
  t.setRegistrar(&registrar);
  t.registerLocal(p, 0);  // nothing to transfer, nothing to register
  CHECK(registrar.registered.empty());
  t.registerLocal(p + 100, 50);
  t.registerLocal(p, 4096);
  REQUIRE(registrar.registered.size() == 1);  // the whole block, once; the second call hit the cache
  CHECK(registrar.registered[0].first == p);
  CHECK(registrar.registered[0].second >= 4096);
  CHECK(t.counters().cache_hits == 1);

  std::vector<uint8_t> outside(64);
  CHECK_THROWS_AS(t.registerLocal(outside.data(), 64), EngineError);  // pinned memory needs its owner
  auto owner = std::make_shared<int>(1);
  t.registerLocal(outside.data(), 64, owner);
  CHECK(registrar.registered.size() == 2);
  CHECK(owner.use_count() == 2);  // held while the registration is cached
}
