// Arena: the registered memory of one process, and the table of its regions.
//
// The arena is a memfd mapped MAP_SHARED. Its first kHeaderBytes hold the
// RegionTable; tensors are allocated from the rest (see TensorTracker). Peers
// on the same host map the whole arena (shm transport), so they read the table
// to check keys and bounds themselves; a memfd has no name in /dev/shm, and the
// kernel frees it when the last process holding it exits, however it exits.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace rdkeras {

enum class RegionKind : uint64_t {
  kArena = 1,     // addr is an offset into the owner's arena
  kExternal = 2,  // addr is a virtual address in the owner's process (CMA)
};

struct RegionEntry {
  uint64_t key;  // 0 = free; written last on insert (release), cleared first on removal
  uint64_t kind;
  uint64_t addr;
  uint64_t length;
  uint64_t rkey;  // the transport's remote key for this memory (verbs), else 0
};

struct RegionInfo {
  RegionKind kind;
  uint64_t addr;
  uint64_t length;
  uint64_t rkey = 0;
};

// Lives in shared memory: written only by the owner, read by anyone mapping it.
// A key is (slot + 1) << 32 | generation; generations never repeat within a
// process, so a key that was deregistered can never match again (stale key).
struct RegionTable {
  static constexpr uint32_t kMagic = 0x52444b52;  // "RDKR"
  static constexpr uint32_t kCapacity = 16384;

  uint32_t magic;
  uint32_t capacity;
  uint64_t next_generation;  // owner only
  uint64_t reserved[6];
  RegionEntry entries[kCapacity];

  // Reader side, safe against a concurrent owner: copies the entry and checks
  // the key again afterwards.
  bool lookup(uint64_t key, RegionInfo* out) const;
};

class Arena {
 public:
  static constexpr size_t kHeaderBytes = 1 << 20;
  static_assert(sizeof(RegionTable) <= kHeaderBytes, "region table must fit the header");

  // Reserves `capacity` bytes of address space; pages cost memory only once touched.
  explicit Arena(size_t capacity);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  int fd() const { return fd_; }
  uint8_t* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  bool contains(const void* p, size_t n) const {
    auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(base_);
    return a >= b && a - b <= capacity_ && n <= capacity_ - (a - b);
  }
  uint64_t offsetOf(const void* p) const { return static_cast<const uint8_t*>(p) - base_; }

  const RegionTable& table() const { return *table_; }
  // Gives the pages of [offset, offset + length) back to the kernel: they cost no memory until touched
  // again, and read as zeros then. Page-aligned ranges only; returns whether the kernel took them.
  bool discard(uint64_t offset, size_t length);
  // Owner side. Thread-safe.
  uint64_t insert(RegionKind kind, uint64_t addr, uint64_t length, uint64_t rkey = 0);
  bool remove(uint64_t key);

 private:
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  size_t capacity_ = 0;
  RegionTable* table_ = nullptr;
  std::mutex mu_;
  uint32_t free_hint_ = 0;
};

// Maps another process's arena (read through its fd); unmaps on destruction.
class ArenaMapping {
 public:
  ArenaMapping() = default;
  explicit ArenaMapping(int fd);
  ~ArenaMapping();
  ArenaMapping(ArenaMapping&& other) noexcept;
  ArenaMapping& operator=(ArenaMapping&& other) noexcept;

  uint8_t* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  const RegionTable& table() const { return *reinterpret_cast<const RegionTable*>(base_); }

 private:
  uint8_t* base_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace rdkeras
