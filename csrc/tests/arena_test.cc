// The region table: keys, generations, stale keys, bounds of the table.
#include "engine/arena.h"

#include <doctest/doctest.h>

#include <set>
#include <vector>

#include "engine/common.h"

using namespace rdkeras;

TEST_CASE("a region's key finds it until it is removed, then never again") {
  Arena arena(Arena::kHeaderBytes * 4);
  const uint64_t key = arena.insert(RegionKind::kArena, 4096, 100, 7);
  RegionInfo info;
  REQUIRE(arena.table().lookup(key, &info));
  CHECK(info.kind == RegionKind::kArena);
  CHECK(info.addr == 4096);
  CHECK(info.length == 100);
  CHECK(info.rkey == 7);
  CHECK(arena.remove(key));
  CHECK_FALSE(arena.table().lookup(key, &info));
  CHECK_FALSE(arena.remove(key));  // removing twice is refused
}

TEST_CASE("a reused slot gets a new generation, so the old key stays stale") {
  Arena arena(Arena::kHeaderBytes * 4);
  std::set<uint64_t> keys;
  uint64_t key = arena.insert(RegionKind::kArena, 0, 8);
  for (int i = 0; i < 1000; ++i) {
    keys.insert(key);
    arena.remove(key);
    key = arena.insert(RegionKind::kArena, 0, 8);
    RegionInfo info;
    CHECK(keys.count(key) == 0);  // never a key seen before
    for (uint64_t old : {*keys.begin(), *keys.rbegin()}) CHECK_FALSE(arena.table().lookup(old, &info));
    CHECK((key & 0xffffffffu) != 0);  // generation 0 is never used
  }
}

TEST_CASE("malformed keys never match") {
  Arena arena(Arena::kHeaderBytes * 4);
  arena.insert(RegionKind::kArena, 0, 8);
  RegionInfo info;
  for (uint64_t bad : {uint64_t{0}, uint64_t{1}, uint64_t{0xffffffffffffffff},
                       (uint64_t{RegionTable::kCapacity} + 1) << 32 | 1, uint64_t{1} << 32})
    CHECK_FALSE(arena.table().lookup(bad, &info));
}

TEST_CASE("a full table says so, and frees up again") {
  Arena arena(Arena::kHeaderBytes * 4);
  std::vector<uint64_t> keys;
  for (uint32_t i = 0; i < RegionTable::kCapacity; ++i)
    keys.push_back(arena.insert(RegionKind::kArena, i, 1));
  CHECK_THROWS_WITH_AS(arena.insert(RegionKind::kArena, 0, 1), doctest::Contains("region table full"),
                       EngineError);
  arena.remove(keys[123]);
  const uint64_t slot = arena.insert(RegionKind::kArena, 0, 1) >> 32;
  CHECK(slot == 124);  // the freed slot
}

TEST_CASE("contains() is exact at the arena's edges") {
  Arena arena(Arena::kHeaderBytes * 4);
  uint8_t* b = arena.base();
  CHECK(arena.contains(b, arena.capacity()));
  CHECK_FALSE(arena.contains(b, arena.capacity() + 1));
  CHECK(arena.contains(b + arena.capacity(), 0));
  CHECK_FALSE(arena.contains(b - 1, 1));
  CHECK_FALSE(arena.contains(b + 1, SIZE_MAX));  // no overflow
}
