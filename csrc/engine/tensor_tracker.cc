#include "engine/tensor_tracker.h"

#include <algorithm>
#include <cstring>

#include "engine/common.h"

namespace rdkeras {

TensorTracker::TensorTracker(Arena& arena) : arena_(arena), bump_(Arena::kHeaderBytes) {}

size_t TensorTracker::sizeClass(size_t n) {
  if (n <= kAlignment) return kAlignment;
  // Past 2^62 bytes the rounding below would overflow; no arena holds that much anyway.
  if (n > (size_t{1} << 62))
    throw EngineError(strCat("cannot allocate ", n, " bytes: more than any arena holds"));
  // Quarter steps between powers of two: at most 25% slack, few classes.
  size_t p = size_t{1} << (63 - __builtin_clzll(n));
  size_t step = std::max(p / 4, kAlignment);
  return (n + step - 1) / step * step;
}

void* TensorTracker::allocate(size_t n) {
  const size_t cls = sizeClass(n);
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.pool_allocations;
  uint64_t off;
  auto& list = free_[cls];
  if (!list.empty()) {
    off = list.back();
    list.pop_back();
    ++counters_.pool_reuses;
  } else {
    const size_t align = cls >= 4096 ? 4096 : kAlignment;
    off = (bump_ + align - 1) / align * align;
    if (off + cls > arena_.capacity())
      throw EngineError(strCat("registered arena exhausted: cannot allocate ", n, " bytes (",
                               counters_.pool_bytes_reserved, " of ", arena_.capacity(),
                               " bytes already carved); raise RDKERAS_ARENA_BYTES"));
    bump_ = off + cls;
    blocks_[off] = cls;
    counters_.pool_bytes_reserved += cls;
  }
  in_use_[off] = true;
  counters_.pool_bytes_in_use += cls;
  return arena_.base() + off;
}

void TensorTracker::release(void* p) {
  const uint64_t off = arena_.offsetOf(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(off);
  if (it == in_use_.end() || !it->second)
    throw EngineError("release of a pointer the tracker did not allocate");
  it->second = false;
  const uint64_t cls = blocks_.at(off);
  counters_.pool_bytes_in_use -= cls;
  free_[cls].push_back(off);
  // A large block kept in its size class's free list would stay resident, as large as the largest one-off
  // (the start's broadcast of the weights); its address range stays reserved for the next of its class.
  if (cls >= kDiscardBytes && !block_keys_.count(off) && arena_.discard(off, cls))
    counters_.pool_bytes_discarded += cls;
}

uint64_t TensorTracker::insertLocked(const void* p, size_t n) {
  const uint64_t rkey = registrar_ ? registrar_->registerMemory(p, n) : 0;
  const uint64_t key = arena_.contains(p, n)
                           ? arena_.insert(RegionKind::kArena, arena_.offsetOf(p), n, rkey)
                           : arena_.insert(RegionKind::kExternal, reinterpret_cast<uintptr_t>(p), n, rkey);
  if (registrar_) key_rkey_[key] = rkey;
  ++counters_.registrations;
  counters_.bytes_registered += n;
  return key;
}

uint64_t TensorTracker::registerRegion(const void* p, size_t n, std::shared_ptr<void> owner) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t key = insertLocked(p, n);
  if (owner) owners_.emplace(key, std::move(owner));
  return key;
}

void TensorTracker::deregisterRegion(uint64_t key) {
  std::shared_ptr<void> owner;  // released after the lock: its deleter may need the GIL
  std::lock_guard<std::mutex> lock(mu_);
  if (!arena_.remove(key)) throw EngineError(strCat("deregister: no region with key 0x", std::hex, key));
  ++counters_.deregistrations;
  forgetLocked(key);
  if (auto it = owners_.find(key); it != owners_.end()) {
    owner = std::move(it->second);
    owners_.erase(it);
  }
}

std::pair<uint64_t, uint64_t> TensorTracker::lookupOrRegister(const void* p, size_t n,
                                                              std::shared_ptr<void> owner) {
  std::shared_ptr<void> evicted;  // released after the lock: its deleter may need the GIL
  std::lock_guard<std::mutex> lock(mu_);
  if (arena_.contains(p, n)) {
    const uint64_t off = arena_.offsetOf(p);
    auto it = blocks_.upper_bound(off);
    if (it != blocks_.begin()) {
      --it;
      if (off + n <= it->first + it->second) {  // inside one pool block: register the whole block once
        auto [k, fresh] = block_keys_.try_emplace(it->first, 0);
        if (fresh)
          k->second = insertLocked(arena_.base() + it->first, it->second);
        else
          ++counters_.cache_hits;
        return {k->second, off - it->first};
      }
    }
  }
  const auto a = reinterpret_cast<uintptr_t>(p);
  ++clock_;
  for (auto& e : external_) {
    if (a >= e.start && a + n <= e.start + e.length) {
      e.last_use = clock_;
      ++counters_.cache_hits;
      return {e.key, a - e.start};
    }
  }
  if (registrar_ && !owner)
    throw EngineError(
        "memory outside the registered arena needs an owner to be registered here (pass the "
        "array from Python, or allocate it with Engine.empty)");
  if (external_.size() >= kExternalCacheEntries) {
    auto lru = std::min_element(external_.begin(), external_.end(),
                                [](const External& x, const External& y) { return x.last_use < y.last_use; });
    arena_.remove(lru->key);
    ++counters_.deregistrations;
    forgetLocked(lru->key);
    evicted = std::move(lru->owner);
    external_.erase(lru);
  }
  const uint64_t key = insertLocked(p, n);
  external_.push_back({a, n, key, clock_, std::move(owner)});
  return {key, 0};
}

void TensorTracker::registerLocal(const void* p, size_t n, std::shared_ptr<void> owner) {
  if (n == 0 || !registrar_) return;  // set once, before any transfer: no lock needed to read it
  lookupOrRegister(p, n, std::move(owner));
}

RegisteredBlock::RegisteredBlock(TensorTracker& tracker, size_t bytes)
    : tracker_(tracker), data_(static_cast<uint8_t*>(tracker.allocate(bytes))), size_(bytes) {
  std::memset(data_, 0, size_);
  try {
    key_ = tracker_.registerRegion(data_, size_);
  } catch (...) {
    tracker_.release(data_);
    throw;
  }
}

RegisteredBlock::~RegisteredBlock() {
  try {
    tracker_.deregisterRegion(key_);
  } catch (...) {  // a destructor must not throw; the table entry is the only loss
  }
  tracker_.release(data_);
}

void TensorTracker::forgetLocked(uint64_t key) {
  auto it = key_rkey_.find(key);
  if (it == key_rkey_.end()) return;
  registrar_->deregisterMemory(it->second);
  key_rkey_.erase(it);
}

TrackerCounters TensorTracker::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

}  // namespace rdkeras
