// The seam between the TensorTracker and a transport that registers memory with its hardware (verbs:
// ibv_reg_mr, which pins pages and yields the keys RDMA needs).
//
// The tracker decides what is registered and caches it; the transport only carries registrations out.
// So the tracker holds the transport as its MemoryRegistrar, and the transport knows nothing of the
// tracker: where it meets local memory no one registered yet (an arena block a ring sends from), it
// calls the RegisterLocal it was made with. The Engine owns both and wires them (engine.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace rdkeras {

// What a transport does when memory is registered with it.
class MemoryRegistrar {
 public:
  virtual ~MemoryRegistrar() = default;
  // Returns the remote key peers use for [p, p+n).
  virtual uint64_t registerMemory(const void* p, size_t n) = 0;
  virtual void deregisterMemory(uint64_t rkey) = 0;
};

// Registers [p, p+n) for use as the local side of a transfer (TensorTracker::registerLocal), through
// the registrar and into the tracker's cache.
using RegisterLocal = std::function<void(const void* p, size_t n)>;

}  // namespace rdkeras
