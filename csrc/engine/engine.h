// Engine: one per process. Owns the arena, the tensor tracker and the
// transport; channels and Python arrays hold a shared_ptr to it so it outlives
// every buffer it lent out.
//
// Failures name their root cause. While a rank waits it watches the peer it
// waits for every millisecond and one other peer in turn. The first rank to see
// a peer fail writes an abort record (who failed, who saw it, how) into every
// other rank's abort word, one-sidedly, before it raises; every rank checks its
// own word while waiting and before each operation. So every survivor's error
// names the rank that died, not the neighbour that exited because of it.
//
// A rank that lives but hangs outside the engine beats on. For it, every collective runs in a
// CollectiveScope that counts it in this rank's progress record (progress.h); a wait inside one
// that lasts the progress timeout reads the members' records, and a member in no collective that
// has not finished this one is named hung -- the same abort record, so every survivor names it,
// and the laggard's own heartbeat thread sees its name there (waitNamedHung: its face dumps its
// Python stacks).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/arena.h"
#include "engine/common.h"
#include "engine/progress.h"
#include "engine/tensor_tracker.h"
#include "engine/transport.h"

namespace rdkeras {

struct EngineOptions {
  std::string transport = "shm";
  size_t arena_bytes = size_t{16} << 30;  // address space; pages cost memory once touched
  double timeout_s = 300;                 // bound on every wait
  double heartbeat_s = 30;                // a neighbour silent this long is stalled; 0: no heartbeat
  double progress_s = -1;  // a wait in a collective this long looks for a hung member; 0: never; < 0: default
  // The default progress timeout for an operation timeout: max(30 s, timeout / 6) -- never shorter than the
  // heartbeat's default, so that a long first step (tracing, compiling) on one rank is not called a hang.
  static double defaultProgress(double timeout_s) { return timeout_s / 6 > 30 ? timeout_s / 6 : 30; }
  TransportOptions transport_options;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  Engine(int rank, int world_size, const EngineOptions& options);
  ~Engine();

  int rank() const { return rank_; }
  int worldSize() const { return world_size_; }
  double timeout() const { return options_.timeout_s; }
  double heartbeatTimeout() const { return options_.heartbeat_s; }
  double progressTimeout() const { return options_.progress_s; }
  Deadline deadline() const { return Deadline(options_.timeout_s); }
  const std::string& transportName() const { return options_.transport; }
  const TransportOptions& transportOptions() const { return options_.transport_options; }

  // The transport's descriptor plus this rank's abort word.
  std::string localDescriptor() const;
  // `watch` runs about every 100 ms while set-up waits for peers; it throws to give up.
  // `timeout_s` bounds it all (0: the engine's timeout).
  void connect(const std::vector<std::string>& descriptors, const std::string& key,
               std::function<void()> watch = {}, double timeout_s = 0);
  // Closing begins: no operation may start or go on from now, and another thread's wait ends with an
  // error saying the engine was closed (the heartbeat goes on until close(): the others may still be
  // on their way to the close barrier and must not think this rank stalled).
  void beginClose();
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
  // Before memory `peer` writes into one-sidedly is deregistered: waits until the flag there
  // reads `value` (the peer's last write to it has landed) -- 5 s at most, and not at all once
  // the peer or any rank has failed, since a failed world writes nothing more. Never throws
  // (destructors call it); false if it gave up.
  bool settleFlag(const void* flag, uint64_t value, int peer) noexcept;

  // The failure this rank knows of first (its own detection or a peer's record), if any.
  struct Failure {
    int rank = -1;      // the rank that failed
    int reporter = -1;  // the rank that saw it
    std::string why;
    bool sentence = false;  // `why` is a whole sentence naming the rank (a hung one)
  };
  bool failure(Failure* out) const;
  // `err` (about rank `peer`) happened here: returns the error to raise -- the
  // failure already known if there is one, else this one, after telling every
  // other rank (bounded: ~1 s per unreachable peer).
  PeerError rootCause(const PeerError& err, int peer);
  // Throws the known failure, if any.
  void checkFailure();
  // The same, only if another rank failed (an error of this rank's own stays as it is).
  void checkPeerFailure();
  // This rank cannot go on (e.g. its collective call disagrees with a neighbour's): tells
  // every other rank, so that they stop waiting for it and name it.
  void reportOwnFailure(const std::string& why);
  // The face learned (e.g. from the store) that `failed` failed: latches it and tells every
  // other rank, as if this rank had seen it itself (`failed` == this rank: reportOwnFailure).
  void reportFailure(int failed, const std::string& why);
  // Seconds spent in wait()/waitFlag() so far (time blocked on peers).
  double waitSeconds() const { return wait_ns_.load(std::memory_order_relaxed) * 1e-9; }
  // Blocks until a peer names this rank hung (returns what it said), or until the engine closes (returns "").
  // Only the heartbeat thread notices it (none: never named).
  std::string waitNamedHung();
  // This rank's progress record (progress.h), as its peers read it.
  ProgressRecord progress() const;
  // This rank's last collectives (progress.h), oldest first.
  std::vector<FlightEntry> flightRecord() const { return flight_.entries(); }
  const TransportStats& transportStats() const { return transport_->stats(); }
  std::vector<std::pair<std::string, const TransportStats*>> transportParts() const {
    return transport_->parts();
  }
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
  std::atomic<bool> closing_{false};  // set by beginClose(), possibly while another thread waits
  std::atomic<bool> closed_{false};
  std::unique_ptr<RegisteredBlock> control_;  // [abort | beats from left | from right]; made after transport_
  std::vector<uint64_t> abort_keys_;          // every rank's control block key
  mutable std::mutex failure_mu_;
  mutable Failure failure_;  // the first failure known here (latched)
  mutable std::atomic<bool> has_failure_{false};
  std::atomic<int> next_watch_{0};  // round-robin over the other peers while waiting
  void broadcastAbort(uint64_t word, int skip);
  // The heartbeat (see the top of this file): started by connect(), stopped by close().
  void heartbeatLoop();
  void declareStalled(int peer, double silent_s);
  std::thread heartbeat_;
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;
  // The failure known here (rank -1: none), latching -- and passing on -- a peer's record.
  Failure learn();
  Failure decode(uint64_t word) const;
  // Progress (the top of this file).
  friend class CollectiveScope;
  ProgressRecord* record() { return reinterpret_cast<ProgressRecord*>(control_->data() + 64); }
  // A wait in `op` lasted the progress timeout: names the laggard, if any (throws its PeerError).
  void checkProgress(const class CollectiveScope& op);
  std::mutex progress_mu_;  // the control block's read scratch
  FlightRecorder flight_{64};
  std::mutex hung_mu_;
  std::condition_variable hung_cv_;
  std::string hung_text_;  // a peer named this rank hung: what it said
  bool hung_stop_ = false;
  void noticeNamedHung(uint64_t own_word);
  std::atomic<uint64_t> wait_ns_{0};
  std::atomic<uint64_t> bytes_received_{0};
};

// A collective this rank runs, from entering it to leaving it (one per call, on the stack of the thread
// that runs it): counted in the engine's progress record, and what its waits look for a hung member of.
class CollectiveScope {
 public:
  // `kind` ("allreduce") and `name` (the ring's, possibly empty) label it; `members`: its engine ranks.
  // All three must outlive the scope.
  CollectiveScope(Engine& engine, const char* kind, const std::string& name, const std::vector<int>& members,
                  size_t bytes = 0);
  ~CollectiveScope();
  CollectiveScope(const CollectiveScope&) = delete;
  CollectiveScope& operator=(const CollectiveScope&) = delete;
  // The innermost scope of this thread, or null.
  static const CollectiveScope* current();

  Engine& engine;
  const char* kind;
  const std::string& name;
  const std::vector<int>& members;
  uint64_t number;  // this rank's collective #number (counted from 1)

 private:
  const CollectiveScope* outer_;
  size_t slot_;   // in the flight recorder
  int uncaught_;  // std::uncaught_exceptions() when it began: more at the end, it failed
};

// Names of the transports compiled into this build.
std::vector<std::string> nativeTransports();
// Empty when the verbs transport can run here; otherwise why not.
std::string verbsWhyNotViable();

}  // namespace rdkeras
