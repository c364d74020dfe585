// TensorTracker: where tensors that cross the wire live.
//
// It hands out 64-byte aligned blocks from the arena (registered memory), kept
// per size class and reused, and it finds the region key for any buffer a
// transfer names: arena blocks are registered once, on first use, and cached
// for good (blocks are never returned to the arena); memory outside the arena
// is registered by exact range into a small LRU cache. So a steady-state loop
// of transfers performs no registration at all -- counters() shows it.
// Thread-safe (one mutex; nothing here is on a per-byte path).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/arena.h"
#include "engine/memory_registrar.h"

namespace rdkeras {

struct TrackerCounters {
  uint64_t registrations = 0;  // regions inserted into the table
  uint64_t deregistrations = 0;
  uint64_t bytes_registered = 0;  // summed over registrations
  uint64_t cache_hits = 0;        // lookups answered without registering
  uint64_t pool_allocations = 0;
  uint64_t pool_reuses = 0;  // allocations served from a free list
  uint64_t pool_bytes_reserved = 0;
  uint64_t pool_bytes_in_use = 0;
  uint64_t pool_bytes_discarded = 0;  // released blocks' pages given back to the kernel (summed)
};

class TensorTracker {
 public:
  static constexpr size_t kAlignment = 64;
  static constexpr size_t kExternalCacheEntries = 64;

  explicit TensorTracker(Arena& arena);

  // Released blocks of this size or more give their pages back to the kernel, unless a registration
  // cached for good (see lookupOrRegister) may pin them.
  static constexpr size_t kDiscardBytes = size_t{1} << 20;

  // A block of at least n bytes (n may be 0), 64-byte aligned, from the arena.
  void* allocate(size_t n);
  void release(void* p);

  // Registers [p, p+n) as one region; `owner` (e.g. the Python array) is kept
  // alive until deregisterRegion(key), so peers never write into freed memory.
  uint64_t registerRegion(const void* p, size_t n, std::shared_ptr<void> owner = {});
  void deregisterRegion(uint64_t key);
  // (key, offset) such that [p, p+n) is region `key` at `offset`; registers on a miss.
  // Memory outside the arena is cached together with `owner`, which keeps it
  // alive while cached: no other buffer can reuse those addresses, so a cached
  // registration can never describe pages that were freed and remapped (verbs
  // pins pages at registration). Where the registrar pins pages, outside
  // memory must come with an owner.
  std::pair<uint64_t, uint64_t> lookupOrRegister(const void* p, size_t n, std::shared_ptr<void> owner = {});
  // Makes [p, p+n) usable as the local side of a write or read. With a registrar (verbs), that
  // memory must be registered too -- an RDMA source or destination lies in an MR -- so this
  // registers it as lookupOrRegister does (cached; `owner` as there); without one, and for
  // n == 0, it does nothing.
  void registerLocal(const void* p, size_t n, std::shared_ptr<void> owner = {});

  TrackerCounters counters() const;
  static size_t sizeClass(size_t n);
  // Registrations from now on also go to `registrar` (set once, by the Engine).
  void setRegistrar(MemoryRegistrar* registrar) { registrar_ = registrar; }

 private:
  uint64_t insertLocked(const void* p, size_t n);
  void forgetLocked(uint64_t key);

  Arena& arena_;
  mutable std::mutex mu_;
  uint64_t bump_;                                             // next free arena offset
  std::map<uint64_t, uint64_t> blocks_;                       // arena offset -> size class
  std::unordered_map<uint64_t, bool> in_use_;                 // arena offset -> allocated
  std::unordered_map<uint64_t, std::vector<uint64_t>> free_;  // size class -> offsets
  std::unordered_map<uint64_t, uint64_t> block_keys_;         // arena offset -> key
  struct External {
    uintptr_t start;
    size_t length;
    uint64_t key;
    uint64_t last_use;
    std::shared_ptr<void> owner;
  };
  std::vector<External> external_;
  uint64_t clock_ = 0;
  TrackerCounters counters_;
  MemoryRegistrar* registrar_ = nullptr;
  std::unordered_map<uint64_t, uint64_t> key_rkey_;             // region key -> the registrar's key
  std::unordered_map<uint64_t, std::shared_ptr<void>> owners_;  // registerRegion's owners, by key
};

// A zeroed tracker block registered as one region, for the object's lifetime
// (channels' slots and flags, a ring's buffers). Zeroing also faults every page
// in once, at setup rather than on the first transfer.
class RegisteredBlock {
 public:
  RegisteredBlock(TensorTracker& tracker, size_t bytes);
  ~RegisteredBlock();
  RegisteredBlock(const RegisteredBlock&) = delete;
  RegisteredBlock& operator=(const RegisteredBlock&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  uint64_t key() const { return key_; }

 private:
  TensorTracker& tracker_;
  uint8_t* data_;
  size_t size_;
  uint64_t key_;
};

}  // namespace rdkeras
