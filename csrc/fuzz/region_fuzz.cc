// libFuzzer target: a peer's region table, which shm initiators read from shared memory the
// peer controls. Lookups and bounds checks must hold whatever the table says.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "engine/arena.h"
#include "engine/common.h"
#include "engine/transport.h"

using namespace rdkeras;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static auto* table = new RegionTable();  // 640 KB: one, reused
  if (size < 24) return 0;
  uint64_t key, offset, length;
  std::memcpy(&key, data, 8);
  std::memcpy(&offset, data + 8, 8);
  std::memcpy(&length, data + 16, 8);
  // The rest overwrites the entry the key points at (and its neighbours): the peer's doing.
  std::memset(table, 0, sizeof(*table));
  table->magic = RegionTable::kMagic;
  table->capacity = RegionTable::kCapacity;
  const uint64_t slot = key >> 32;
  if (slot >= 1 && slot <= RegionTable::kCapacity)
    std::memcpy(&table->entries[slot - 1], data + 24, std::min(size - 24, sizeof(RegionEntry)));
  RegionInfo info;
  if (!table->lookup(key, &info)) return 0;
  try {
    checkBounds("fuzz", 1, key, info.length, offset, length);
    if (offset > info.length || length > info.length - offset) __builtin_trap();
  } catch (const RemoteAccessError&) {
    if (offset <= info.length && length <= info.length - offset) __builtin_trap();
  }
  return 0;
}
