// Transport: one-sided access to the registered memory of peer processes.
//
// A transport is created per process for a fixed world of ranks. After
// connect(), every operation names a peer rank and addresses the peer's memory
// only as (key, offset, length): keys come from the peer's region table, and
// every access is checked against it (by the initiator where it can read the
// table, as shm does; by the target otherwise, as tcp does).
//
// Semantics (the same for every transport):
//  - write/read return when the local buffer may be reused / holds the data;
//  - writeFlag stores an 8-byte value at an 8-aligned offset and is ordered
//    after every earlier write to the same peer: a reader who sees the flag
//    sees the data;
//  - errors detected by the target (stale key, out of bounds) surface at the
//    latest on the next operation to that peer or on flush(), as with RDMA
//    completion errors;
//  - every blocking call takes a Deadline and throws TimeoutError/PeerError
//    naming the peer rank.
// Threading: operations may be called from any thread; a transport may run
// background progress threads (tcp does).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/common.h"

namespace rdkeras {

class Arena;

// Everything a transport is configured with, passed in from Python (rdkeras.transports.base
// .TransportOptions, read from the environment once, at the face): no transport reads getenv.
struct TransportOptions {
  std::string advertise_host = "127.0.0.1";  // tcp, verbs: the address peers connect to
  std::string bind_host = "127.0.0.1";       // the address listeners bind (the job's network)
  std::string ib_device;                     // verbs: device name; empty: the first with an active port
  int ib_port = 0;                           // verbs: port number; 0: the first active one
  int ib_gid_index = 0;                      // verbs: GID table index
  size_t nt_threshold = size_t{8} << 20;  // shm copies and ring sums stream from this size (SIZE_MAX: never)
};

// What went over the wire, as seen by the initiator (for benchmarks and TensorBoard).
struct TransportStats {
  std::atomic<uint64_t> bytes_written{0}, bytes_read{0}, writes{0}, reads{0}, flags{0};
};

class Transport {
 public:
  virtual ~Transport() = default;
  const TransportStats& stats() const { return stats_; }

  virtual const char* name() const = 0;
  // Opaque text peers need to connect to this process.
  virtual std::string localDescriptor() const = 0;
  // Connects to every peer. descriptors[r] is rank r's localDescriptor(); an empty one
  // (r != this rank) says another transport reaches rank r (transport/mixed), so this one
  // neither connects to nor accepts it. Every
  // connection proves both ends hold `key`, the job's 32-byte transport key,
  // through engine/handshake.h; the key itself never crosses the wire.
  virtual void connect(const std::vector<std::string>& descriptors, const std::string& key,
                       const Deadline& deadline) = 0;

  virtual void write(int peer, const void* src, uint64_t key, uint64_t offset, size_t length,
                     const Deadline& deadline) = 0;
  virtual void read(int peer, void* dst, uint64_t key, uint64_t offset, size_t length,
                    const Deadline& deadline) = 0;
  virtual void writeFlag(int peer, uint64_t key, uint64_t offset, uint64_t value,
                         const Deadline& deadline) = 0;
  // Waits until every earlier operation to `peer` completed at the target,
  // and raises any error it reported.
  virtual void flush(int peer, const Deadline& deadline) = 0;
  // Throws PeerError if `peer` is known to be gone.
  virtual void checkPeer(int peer) = 0;
  // Steady-clock nanoseconds when something last arrived from `peer`, where this process's
  // threads receive what peers send (tcp); 0 where peers write memory directly (shm, verbs).
  // The heartbeat counts it as a sign of life: a long transfer delays a heartbeat behind it.
  virtual int64_t lastHeardNs(int /*peer*/) const { return 0; }
  // `peer` stopped responding (the heartbeat declared it stalled): every operation with it
  // fails from now on, also those already blocked on it (tcp shuts its sockets down).
  virtual void cutOff(int /*peer*/, const std::string& /*why*/) {}
  // Called about every 100 ms while connect() waits for peers; it throws to give up
  // (the engine's face checks whether the job already failed: a peer that died before
  // it connected would otherwise be waited for until the deadline).
  void setSetupWatch(std::function<void()> watch) { setup_watch_ = std::move(watch); }
  // A transport made of others (transport/mixed): each part's name and counters.
  virtual std::vector<std::pair<std::string, const TransportStats*>> parts() const { return {}; }
  // Whether the source of a write must lie in registered memory (verbs: yes).
  virtual bool needsLocalRegistration() const { return false; }
  // Closes connections and stops background threads. Idempotent.
  virtual void shutdown() = 0;

 protected:
  // Each transport calls these once per successful operation.
  void countWrite(size_t n) {
    stats_.bytes_written.fetch_add(n, std::memory_order_relaxed);
    stats_.writes.fetch_add(1, std::memory_order_relaxed);
  }
  void countRead(size_t n) {
    stats_.bytes_read.fetch_add(n, std::memory_order_relaxed);
    stats_.reads.fetch_add(1, std::memory_order_relaxed);
  }
  void countFlag() { stats_.flags.fetch_add(1, std::memory_order_relaxed); }
  std::function<void()> setup_watch_;

 private:
  TransportStats stats_;
};

// Shared checks used by transports that validate accesses themselves.
void checkFlagOffset(uint64_t offset);
// Throws RemoteAccessError unless [offset, offset+length) lies inside `region_length`.
void checkBounds(const char* op, int peer, uint64_t key, uint64_t region_length, uint64_t offset,
                 uint64_t length);
[[noreturn]] void throwUnknownKey(const char* op, int peer, uint64_t key);

// Descriptors are "name;k=v;k=v" text: readable in logs, no versioned binary.
// Both throw EngineError (naming the key) on a missing field or, for fieldNumber,
// anything but a decimal number no larger than `max`.
std::string field(const std::string& descriptor, const std::string& key);
uint64_t fieldNumber(const std::string& descriptor, const std::string& key, uint64_t max = UINT64_MAX);

}  // namespace rdkeras
