#include "engine/arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "engine/common.h"

namespace rdkeras {

bool RegionTable::lookup(uint64_t key, RegionInfo* out) const {
  const uint64_t slot = (key >> 32);
  if (slot == 0 || slot > capacity) return false;
  const RegionEntry& e = entries[slot - 1];
  if (loadAcquire(&e.key) != key) return false;
  out->kind = static_cast<RegionKind>(__atomic_load_n(&e.kind, __ATOMIC_RELAXED));
  out->addr = __atomic_load_n(&e.addr, __ATOMIC_RELAXED);
  out->length = __atomic_load_n(&e.length, __ATOMIC_RELAXED);
  out->rkey = __atomic_load_n(&e.rkey, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  return __atomic_load_n(&e.key, __ATOMIC_RELAXED) == key;
}

Arena::Arena(size_t capacity) {
  if (capacity < kHeaderBytes * 2) throw EngineError(strCat("arena capacity ", capacity, " is too small"));
  fd_ = memfd_create("rdkeras-arena", MFD_CLOEXEC);
  if (fd_ < 0) throwErrno("memfd_create");
  if (capacity > (size_t{1} << 46) || ftruncate(fd_, static_cast<off_t>(capacity)) != 0) {
    close(fd_);
    throw EngineError(strCat("cannot reserve an arena of ", capacity,
                             " bytes (set RDKERAS_ARENA_BYTES to what this machine can map, e.g. 16 GiB)"));
  }
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd_, 0);
  if (p == MAP_FAILED) {
    close(fd_);
    throwErrno(strCat("mmap(arena, ", capacity, " bytes; lower RDKERAS_ARENA_BYTES)"));
  }
  base_ = static_cast<uint8_t*>(p);
  capacity_ = capacity;
  table_ = reinterpret_cast<RegionTable*>(base_);
  table_->magic = RegionTable::kMagic;
  table_->capacity = RegionTable::kCapacity;
  table_->next_generation = 1;
}

Arena::~Arena() {
  if (base_) munmap(base_, capacity_);
  if (fd_ >= 0) close(fd_);
}

bool Arena::discard(uint64_t offset, size_t length) {
  // Punched out of the memfd, the pages leave every mapping of it: this process's and its peers'.
  return length > 0 && offset + length <= capacity_ &&
         fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                   static_cast<off_t>(length)) == 0;
}

uint64_t Arena::insert(RegionKind kind, uint64_t addr, uint64_t length, uint64_t rkey) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint32_t i = 0; i < RegionTable::kCapacity; ++i) {
    const uint32_t slot = (free_hint_ + i) % RegionTable::kCapacity;
    RegionEntry& e = table_->entries[slot];
    if (e.key != 0) continue;
    const uint64_t gen = table_->next_generation++ & 0xffffffffu;
    const uint64_t key = (static_cast<uint64_t>(slot) + 1) << 32 | (gen == 0 ? 1 : gen);
    e.kind = static_cast<uint64_t>(kind);
    e.addr = addr;
    e.length = length;
    e.rkey = rkey;
    storeRelease(&e.key, key);
    free_hint_ = slot + 1;
    return key;
  }
  throw EngineError(strCat("region table full (", RegionTable::kCapacity,
                           " regions registered): deregister regions you no longer use"));
}

bool Arena::remove(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t slot = key >> 32;
  if (slot == 0 || slot > RegionTable::kCapacity) return false;
  RegionEntry& e = table_->entries[slot - 1];
  if (e.key != key) return false;
  storeRelease(&e.key, 0);
  return true;
}

ArenaMapping::ArenaMapping(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) throwErrno("fstat(peer arena)");
  void* p = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) throwErrno("mmap(peer arena)");
  base_ = static_cast<uint8_t*>(p);
  capacity_ = st.st_size;
  if (table().magic != RegionTable::kMagic) {
    munmap(base_, capacity_);
    base_ = nullptr;
    throw EngineError("peer arena has no rdkeras region table (version mismatch?)");
  }
}

ArenaMapping::ArenaMapping(ArenaMapping&& other) noexcept : base_(other.base_), capacity_(other.capacity_) {
  other.base_ = nullptr;
  other.capacity_ = 0;
}

ArenaMapping& ArenaMapping::operator=(ArenaMapping&& other) noexcept {
  std::swap(base_, other.base_);
  std::swap(capacity_, other.capacity_);
  return *this;
}

ArenaMapping::~ArenaMapping() {
  if (base_) munmap(base_, capacity_);
}

}  // namespace rdkeras
