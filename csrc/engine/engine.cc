#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>

#include "transport/mixed/mixed_transport.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#ifdef RDKERAS_WITH_VERBS
#include "transport/verbs/verbs_transport.h"
#endif

namespace rdkeras {

namespace {

// Makes this rank's transport of one kind. Only verbs uses the tracker: it becomes the tracker's
// registrar (memory_registrar.h).
using TransportFactory = std::unique_ptr<Transport> (*)(int rank, int world_size, Arena& arena,
                                                        TensorTracker& tracker,
                                                        const TransportOptions& options);

template <typename T>
std::unique_ptr<Transport> make(int rank, int world_size, Arena& arena, TensorTracker& /*tracker*/,
                                const TransportOptions& options) {
  return std::make_unique<T>(rank, world_size, arena, options);
}

#ifdef RDKERAS_WITH_VERBS
std::unique_ptr<Transport> makeVerbs(int rank, int world_size, Arena& arena, TensorTracker& tracker,
                                     const TransportOptions& options) {
  // The tracker holds the transport as its registrar; the transport holds only this function
  // (the Engine owns both, the tracker outliving the transport).
  auto verbs = std::make_unique<VerbsTransport>(
      rank, world_size, arena, options, [&tracker](const void* p, size_t n) { tracker.registerLocal(p, n); });
  tracker.setRegistrar(verbs.get());  // every registration becomes an ibv_reg_mr
  return verbs;
}
#endif

struct NativeTransport {
  const char* name;
  TransportFactory make;
};

// Every transport compiled into this build: the Engine makes its transport from this table, and
// nativeTransports() lists it.
constexpr NativeTransport kNativeTransports[] = {
    {"shm", make<ShmTransport>},
    {"tcp", make<TcpTransport>},
    {"shm+tcp", make<MixedTransport>},
#ifdef RDKERAS_WITH_VERBS
    {"verbs", makeVerbs},
#endif
};

}  // namespace

std::vector<std::string> nativeTransports() {
  std::vector<std::string> names;
  for (const NativeTransport& t : kNativeTransports) names.emplace_back(t.name);
  return names;
}

std::string verbsWhyNotViable() {
#ifdef RDKERAS_WITH_VERBS
  return VerbsTransport::whyNotViable();
#else
  return "this build of rdkeras has no verbs transport (it was built without rdma-core's headers: "
         "apt install libibverbs-dev, then reinstall rdkeras)";
#endif
}

Engine::Engine(int rank, int world_size, const EngineOptions& options)
    : rank_(rank), world_size_(world_size), options_(options) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw EngineError(strCat("invalid rank ", rank, " for world size ", world_size));
  if (!(options.timeout_s > 0)) throw EngineError("timeout must be positive");
  if (!(options.heartbeat_s >= 0)) throw EngineError("heartbeat timeout must be positive (or 0: none)");
  if (std::isnan(options.progress_s) || std::isinf(options.progress_s))
    throw EngineError("progress timeout must be a finite number of seconds (0: none; < 0: the default)");
  if (options_.progress_s < 0) options_.progress_s = EngineOptions::defaultProgress(options.timeout_s);
  arena_ = std::make_unique<Arena>(options.arena_bytes);
  tracker_ = std::make_unique<TensorTracker>(*arena_);
  for (const NativeTransport& t : kNativeTransports)
    if (options.transport == t.name)
      transport_ = t.make(rank, world_size, *arena_, *tracker_, options.transport_options);
  if (!transport_)
    throw EngineError(strCat("unknown or unavailable native transport '", options.transport, "'"));
  // After the transport: verbs registers it (an rkey peers can write the heartbeat with).
  control_ = std::make_unique<RegisteredBlock>(*tracker_, 192);
}

Engine::~Engine() { close(); }

std::string Engine::localDescriptor() const {
  return strCat(transport_->localDescriptor(), ";abort_key=", control_->key());
}

void Engine::connect(const std::vector<std::string>& descriptors, const std::string& key,
                     std::function<void()> watch, double timeout_s) {
  if (connected_) throw EngineError("engine already connected");
  if (static_cast<int>(descriptors.size()) != world_size_)
    throw EngineError(strCat("connect: ", descriptors.size(), " descriptors for a world of ", world_size_));
  abort_keys_.clear();
  for (const std::string& d : descriptors) abort_keys_.push_back(fieldNumber(d, "abort_key"));
  transport_->setSetupWatch(std::move(watch));
  transport_->connect(descriptors, key, timeout_s > 0 ? Deadline(timeout_s) : deadline());
  transport_->setSetupWatch({});
  connected_ = true;
  if (world_size_ > 1 && options_.heartbeat_s > 0) heartbeat_ = std::thread(&Engine::heartbeatLoop, this);
}

namespace {

// An abort record in one 8-byte word: (failed rank + 1) | (reporter + 1) << 32 | cause << 56.
// kHung comes with two words written before it (kHungOp, kHungAge: the collective not entered, and
// the milliseconds since the hung rank finished its last one when it was named).
enum Cause : uint64_t { kLost = 0, kStopped = 1, kStalled = 2, kHung = 3 };
uint64_t encodeAbort(int failed, int reporter, Cause cause) {
  return (static_cast<uint64_t>(failed) + 1) | (static_cast<uint64_t>(reporter) + 1) << 32 | cause << 56;
}

Engine::Failure decodeAbort(uint64_t word) {
  const uint64_t cause = word >> 56;
  return {static_cast<int>((word & 0xffffffff) - 1), static_cast<int>(((word >> 32) & 0xffffff) - 1),
          cause == kStopped ? "it stopped on an error of its own (see its log)"
          : cause == kStalled
              ? "it stalled: no heartbeat within the heartbeat timeout (the process is stopped, "
                "hung or swapped out)"
          : cause == kHung ? "it hung: alive, but it did not enter a collective the others wait in"
                           : "it exited or lost its connections"};
}

thread_local const CollectiveScope* t_collective = nullptr;

}  // namespace

// Control block: [abort word | beats from the left neighbour | beats from the right neighbour | hung op |
// hung age | - | this rank's progress record (64 bytes, from 64) | scratch a peer's record is read into].
constexpr uint64_t kBeatsFromLeft = 8, kBeatsFromRight = 16, kHungOp = 24, kHungAge = 32, kRecord = 64,
                   kScratch = 128;

Engine::Failure Engine::decode(uint64_t word) const {
  Failure f = decodeAbort(word);
  if (word >> 56 != kHung) return f;
  const uint8_t* block = control_->data();
  const uint64_t op = loadAcquire(block + kHungOp), age_ms = loadAcquire(block + kHungAge);
  // This thread's collective, if it is the one the hung rank has not entered, names it.
  const CollectiveScope* mine = t_collective;
  const std::string what = mine && mine->number == op ? collectiveText(mine->kind, mine->name, op)
                                                      : collectiveText("collective", "", op);
  char age[32];
  std::snprintf(age, sizeof(age), "%.1f", static_cast<double>(age_ms) * 1e-3);
  const std::string last = age_ms == UINT64_MAX
                               ? std::string("it had finished none when rank ")
                               : strCat("it had finished its last one ", age, " s before rank ");
  f.why = strCat("rank ", f.rank, " has not entered ", what, "; ", last, f.reporter,
                 " named it (it is alive but stuck outside the engine: in Python, a callback, a lock)");
  f.sentence = true;
  return f;
}

ProgressRecord Engine::progress() const {
  ProgressRecord r;
  std::memcpy(&r, control_->data() + kRecord, sizeof(r));
  return r;
}

void Engine::noticeNamedHung(uint64_t own_word) {
  if (own_word >> 56 != kHung || static_cast<int>((own_word & 0xffffffff) - 1) != rank_) return;
  {
    std::lock_guard<std::mutex> lock(hung_mu_);
    if (!hung_text_.empty()) return;
    hung_text_ = decode(own_word).why;
  }
  hung_cv_.notify_all();
}

std::string Engine::waitNamedHung() {
  std::unique_lock<std::mutex> lock(hung_mu_);
  hung_cv_.wait(lock, [&] { return !hung_text_.empty() || hung_stop_; });
  return hung_text_;
}

namespace {
int64_t wallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

CollectiveScope::CollectiveScope(Engine& e, const char* k, const std::string& n, const std::vector<int>& m,
                                 size_t bytes)
    : engine(e), kind(k), name(n), members(m), outer_(t_collective) {
  ProgressRecord* r = e.record();
  setLabel(r->label, kind, name);
  number = __atomic_add_fetch(&r->entered, 1, __ATOMIC_ACQ_REL);  // (peers only read it)
  uncaught_ = std::uncaught_exceptions();
  slot_ = e.flight_.begin(number, r->label, bytes, static_cast<uint32_t>(m.size()), wallNs());
  t_collective = this;
}

CollectiveScope::~CollectiveScope() {
  ProgressRecord* r = engine.record();
  const int64_t now = wallNs();
  engine.flight_.end(slot_, number, now, std::uncaught_exceptions() > uncaught_);
  storeRelease(&r->finished_ns, static_cast<uint64_t>(now));
  __atomic_add_fetch(&r->finished, 1, __ATOMIC_ACQ_REL);
  t_collective = outer_;
}

const CollectiveScope* CollectiveScope::current() { return t_collective; }

void Engine::checkProgress(const CollectiveScope& op) {
  std::vector<ProgressRecord> records(world_size_);
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    uint8_t* scratch = control_->data() + kScratch;
    for (int r : op.members) {
      if (r == rank_ || r < 0 || r >= world_size_) continue;
      try {
        transport_->read(r, scratch, abort_keys_[r], kRecord, sizeof(ProgressRecord), Deadline(1.0));
        std::memcpy(&records[r], scratch, sizeof(ProgressRecord));
      } catch (const std::exception&) {  // unreachable: the waits name it; here it counts as busy
        records[r].entered = 1;
      }
    }
  }
  const int laggard = findLaggard(records, op.members, rank_, op.number);
  if (laggard < 0) return;
  const ProgressRecord& its = records[laggard];
  const int64_t now = wallNs();
  const double age = secondsSince(its.finished_ns, now);
  const std::string why = describeLaggard(laggard, op.kind, op.name, op.number, its, age);
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.rank >= 0) return;  // a failure is known already: the wait names that one
    failure_ = {laggard, rank_, why, true};
    has_failure_.store(true, std::memory_order_release);
  }
  uint8_t* block = control_->data();
  storeRelease(block + kHungOp, op.number);
  storeRelease(block + kHungAge, age < 0 ? UINT64_MAX : static_cast<uint64_t>(age * 1e3));
  broadcastAbort(encodeAbort(laggard, rank_, kHung), -1);  // the laggard too: its face dumps its stacks
  localWakeup().notify();
  throw PeerError(why, laggard);
}

void Engine::heartbeatLoop() {
  using Seconds = std::chrono::duration<double>;
  const double silent_max = options_.heartbeat_s;
  const auto interval =
      std::chrono::duration_cast<Clock::duration>(Seconds(std::clamp(silent_max / 10, 0.05, 1.0)));
  const int left = (rank_ + world_size_ - 1) % world_size_, right = (rank_ + 1) % world_size_;
  struct Watch {
    int peer;
    uint64_t offset;
    uint64_t seen = 0;
    int64_t heard = 0;
    Clock::time_point since = Clock::now();
  };
  Watch watches[2] = {{left, kBeatsFromLeft}, {right, kBeatsFromRight}};
  const uint64_t* block = reinterpret_cast<const uint64_t*>(control_->data());
  // Between beats, this rank's own abort word every 50 ms: named hung, its stacks must reach its log before a
  // launcher that saw the others fail kills it.
  const auto tick = std::min<Clock::duration>(interval, std::chrono::milliseconds(50));
  for (uint64_t beat = 1;; ++beat) {
    for (auto next = Clock::now() + interval; Clock::now() < next;) {
      {
        std::unique_lock<std::mutex> lock(heartbeat_mu_);
        if (heartbeat_cv_.wait_for(lock, tick, [&] { return heartbeat_stop_; })) return;
      }
      noticeNamedHung(loadAcquire(block));
    }
    // I am my right neighbour's left neighbour, and my left neighbour's right one.
    for (const auto& [peer, offset] : {std::pair{right, kBeatsFromLeft}, std::pair{left, kBeatsFromRight}}) {
      try {
        transport_->writeFlag(peer, abort_keys_[peer], offset, beat, Deadline(Seconds(interval).count()));
      } catch (const std::exception&) {  // a dead peer is the waits' to name; a stalled one, the watch's
      }
    }
    const auto now = Clock::now();
    for (Watch& w : watches) {
      const uint64_t seen = loadAcquire(block + w.offset / 8);
      const int64_t heard = transport_->lastHeardNs(w.peer);
      if (seen != w.seen || heard != w.heard) {
        w.seen = seen;
        w.heard = heard;
        w.since = now;
      } else if (Seconds(now - w.since).count() > silent_max) {
        declareStalled(w.peer, Seconds(now - w.since).count());
        w.since = now;  // declared once (a later failure is latched already)
      }
    }
  }
}

void Engine::declareStalled(int peer, double silent_s) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.rank >= 0) return;  // a failure is known already: that one is the cause
    failure_ = {peer, rank_,
                strCat("rank ", peer, " stalled: no heartbeat for ", static_cast<int>(silent_s),
                       " s (the process is stopped, hung or swapped out)")};
    has_failure_.store(true, std::memory_order_release);
  }
  transport_->cutOff(peer, strCat("declared stalled by rank ", rank_, " (no heartbeat)"));
  broadcastAbort(encodeAbort(peer, rank_, kStalled), peer);
  localWakeup().notify();  // sleeping waits check the failure at once
}

bool Engine::failure(Failure* out) const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (failure_.rank >= 0) {
    *out = failure_;
    return true;
  }
  const uint64_t word = loadAcquire(control_->data());  // a peer's record, not latched yet
  if (word == 0) return false;
  *out = decode(word);
  return true;
}

Engine::Failure Engine::learn() {
  uint64_t forward = 0;
  Failure f;
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.rank < 0) {
      const uint64_t word = loadAcquire(control_->data());
      if (word == 0) return f;  // rank -1: nothing known
      failure_ = decode(word);
      has_failure_.store(true, std::memory_order_release);
      forward = word;
    }
    f = failure_;
  }
  // Pass a peer's record on before acting on it: whoever sees this rank leave has heard it first.
  if (forward) broadcastAbort(forward, f.rank);
  return f;
}

namespace {

PeerError describe(const Engine::Failure& f, int me, int lost) {
  if (f.reporter == me) return PeerError(f.why, f.rank);
  if (f.sentence)
    return PeerError(strCat(f.why, " (seen by rank ", f.reporter, ")",
                            lost >= 0 && lost != f.rank ? strCat("; this rank then lost rank ", lost) : ""),
                     f.rank);
  if (f.reporter == f.rank)
    return PeerError(strCat("rank ", f.rank, " stopped on an error of its own (see rank ", f.rank, "'s log)"),
                     f.rank);
  return PeerError(strCat("rank ", f.rank, " failed: ", f.why, " (seen by rank ", f.reporter, ")",
                          lost >= 0 && lost != f.rank ? strCat("; this rank then lost rank ", lost) : ""),
                   f.rank);
}

}  // namespace

void Engine::checkPeerFailure() {
  if (!has_failure_.load(std::memory_order_acquire) && loadAcquire(control_->data()) == 0) return;
  const Failure f = learn();
  if (f.rank >= 0 && f.rank != rank_) throw describe(f, rank_, -1);
}

void Engine::checkFailure() {
  if (!has_failure_.load(std::memory_order_acquire) && loadAcquire(control_->data()) == 0)
    return;  // one load
  const Failure f = learn();
  if (f.rank >= 0) throw describe(f, rank_, -1);
}

PeerError Engine::rootCause(const PeerError& err, int peer) {
  const int failed = err.rank() >= 0 ? err.rank() : peer;
  const Failure known = learn();
  if (known.rank >= 0) return describe(known, rank_, failed);  // someone saw a failure first: that one
  if (failed < 0 || failed >= world_size_ || failed == rank_) return err;  // nobody to blame or tell
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.rank >= 0) return describe(failure_, rank_, failed);  // another thread of ours, just now
    failure_ = {failed, rank_, err.what()};
    has_failure_.store(true, std::memory_order_release);
  }
  broadcastAbort(encodeAbort(failed, rank_, kLost), failed);
  return PeerError(err.what(), failed);
}

void Engine::reportFailure(int failed, const std::string& why) {
  if (failed == rank_) return reportOwnFailure(why);
  if (failed < 0 || failed >= world_size_) return;
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.rank >= 0) return;
    failure_ = {failed, rank_, why};
    has_failure_.store(true, std::memory_order_release);
  }
  broadcastAbort(encodeAbort(failed, rank_, kLost), failed);
}

void Engine::reportOwnFailure(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.rank >= 0) return;
    failure_ = {rank_, rank_, why};
    has_failure_.store(true, std::memory_order_release);
  }
  broadcastAbort(encodeAbort(rank_, rank_, kStopped), rank_);
}

void Engine::broadcastAbort(uint64_t word, int skip) {
  // Best effort and bounded: a rank that is gone too fails fast (<= 1 s).
  if (!connected_ || closed_) return;
  const uint8_t* block = control_->data();
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_ || r == skip) continue;
    try {
      if (word >> 56 == kHung)  // its two words first: a flag lands after every earlier write to that rank
        for (uint64_t at : {kHungOp, kHungAge})
          transport_->writeFlag(r, abort_keys_[r], at, loadAcquire(block + at), Deadline(1.0));
      transport_->writeFlag(r, abort_keys_[r], 0, word, Deadline(1.0));
    } catch (const std::exception&) {  // that one is unreachable as well; the others still hear
    }
  }
}

void Engine::beginClose() {
  closing_ = true;
  localWakeup().notify();  // another thread's sleeping wait sees it at once
  {
    std::lock_guard<std::mutex> lock(hung_mu_);
    hung_stop_ = true;
  }
  hung_cv_.notify_all();  // and waitNamedHung() returns
}

void Engine::close() {
  if (closed_) return;
  beginClose();
  {
    std::lock_guard<std::mutex> lock(heartbeat_mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  closed_ = true;
  if (transport_) transport_->shutdown();
}

Transport& Engine::transport() {
  if (!connected_ || closing_) throw EngineError(closing_ ? "engine is closed" : "engine is not connected");
  checkFailure();  // after a failure anywhere, every operation names it
  return *transport_;
}

void Engine::waitFlag(const void* flag, uint64_t value, int peer, const char* what) {
  wait([&] { return loadAcquire(flag) >= value; }, peer, what);
}

bool Engine::settleFlag(const void* flag, uint64_t value, int peer) noexcept {
  try {
    // The waits' own polling (a tcp delivery wakes it); a known failure or a gone peer ends it (throws).
    return pollUntil([&] { return loadAcquire(flag) >= value; }, Deadline(5.0),
                     [&] {
                       checkFailure();
                       transport().checkPeer(peer);
                     });
  } catch (const std::exception&) {
    return false;
  }
}

void Engine::wait(const std::function<bool()>& ready, int peer, const char* what) {
  Transport& t = transport();
  if (ready()) return;
  const Deadline deadline = this->deadline();
  const auto start = Clock::now();
  // In a collective, a wait that lasts the progress timeout looks for a member that has not entered it.
  const CollectiveScope* op = t_collective && &t_collective->engine == this ? t_collective : nullptr;
  const auto progress_every = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(op && world_size_ > 1 ? options_.progress_s : 0));
  auto next_progress = start + progress_every;
  bool ok;
  try {
    ok = pollUntil(ready, deadline, [&] {
      if (closing_.load(std::memory_order_acquire))
        throw EngineError(
            strCat("the engine was closed while this thread waited for rank ", peer, " (", what, ")"));
      checkFailure();
      if (progress_every.count() > 0 && Clock::now() >= next_progress) {
        next_progress = Clock::now() + progress_every;
        checkProgress(*op);
      }
      t.checkPeer(peer);
      if (world_size_ > 2) {  // one other peer per tick: a death anywhere is seen where it happened
        const int other = next_watch_.fetch_add(1, std::memory_order_relaxed) % world_size_;
        if (other != rank_ && other != peer) {
          try {
            t.checkPeer(other);
          } catch (const PeerError& e) {
            throw PeerError(e.what(), other);
          }
        }
      }
    });
  } catch (const PeerError& e) {
    wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
                       std::memory_order_relaxed);
    throw rootCause(e, peer);
  }
  wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
                     std::memory_order_relaxed);
  if (!ok)
    throw TimeoutError(
        strCat("timed out after ", deadline.seconds(), " s waiting for rank ", peer, " (", what, ")"));
}

}  // namespace rdkeras
