// Engine: one per process. Owns the arena, the tensor tracker and the
// transport; channels and Python arrays hold a shared_ptr to it so it outlives
// every buffer it lent out.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/arena.h"
#include "engine/common.h"
#include "engine/tensor_tracker.h"
#include "engine/transport.h"

namespace rdkeras {

struct EngineOptions {
  std::string transport = "shm";
  size_t arena_bytes = size_t{16} << 30;  // address space; pages cost memory once touched
  double timeout_s = 300;                 // bound on every wait
  TransportOptions transport_options;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  Engine(int rank, int world_size, const EngineOptions& options);
  ~Engine();

  int rank() const { return rank_; }
  int worldSize() const { return world_size_; }
  double timeout() const { return options_.timeout_s; }
  Deadline deadline() const { return Deadline(options_.timeout_s); }
  const std::string& transportName() const { return options_.transport; }
  const TransportOptions& transportOptions() const { return options_.transport_options; }

  std::string localDescriptor() const { return transport_->localDescriptor(); }
  void connect(const std::vector<std::string>& descriptors, const std::string& key);
  void close();
  bool connected() const { return connected_; }

  Arena& arena() { return *arena_; }
  TensorTracker& tracker() { return *tracker_; }
  Transport& transport();

  // Waits until the 8-byte flag at `flag` is >= value. Checks `peer` is alive
  // while waiting; on timeout the error says what it waited for and from whom.
  void waitFlag(const void* flag, uint64_t value, int peer, const char* what);
  // Waits until ready() returns true, with the same checks.
  void wait(const std::function<bool()>& ready, int peer, const char* what);
  // Seconds spent in wait()/waitFlag() so far (time blocked on peers).
  double waitSeconds() const { return wait_ns_.load(std::memory_order_relaxed) * 1e-9; }
  const TransportStats& transportStats() const { return transport_->stats(); }
  // Bytes that arrived here for this rank to consume: messages peers wrote into its
  // channels and rings (one-sided: the transport never sees them) and reads it made.
  void countReceived(size_t n) { bytes_received_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t bytesReceived() const { return bytes_received_.load(std::memory_order_relaxed); }

 private:
  int rank_;
  int world_size_;
  EngineOptions options_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<TensorTracker> tracker_;
  std::unique_ptr<Transport> transport_;
  bool connected_ = false;
  bool closed_ = false;
  std::atomic<uint64_t> wait_ns_{0};
  std::atomic<uint64_t> bytes_received_{0};
};

// Names of the transports compiled into this build.
std::vector<std::string> nativeTransports();
// Empty when the verbs transport can run here; otherwise why not.
std::string verbsWhyNotViable();

}  // namespace rdkeras
