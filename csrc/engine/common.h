// Errors, deadlines and the polling loop every wait in the engine goes through.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace rdkeras {

// Base of every error the engine raises; the binding maps each to a Python class.
class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A wait ran past its deadline; the message names whom it waited for.
class TimeoutError : public EngineError {
 public:
  using EngineError::EngineError;
};
// A peer process died or closed its connection; the message names its rank,
// and rank() is that rank where the thrower knows it (-1 otherwise).
class PeerError : public EngineError {
 public:
  explicit PeerError(const std::string& what, int rank = -1) : EngineError(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};
// A peer could not prove it holds the job's key (or refused our proof).
class AuthenticationError : public EngineError {
 public:
  using EngineError::EngineError;
};
// A one-sided access named a stale/unknown key or fell outside the region.
class RemoteAccessError : public EngineError {
 public:
  using EngineError::EngineError;
};

template <typename... Args>
std::string strCat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

// Throws EngineError("<what>: <strerror(errno)>").
[[noreturn]] void throwErrno(const std::string& what);

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  explicit Deadline(double seconds)
      : seconds_(seconds),
        end_(Clock::now() +
             std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds))) {}
  bool expired() const { return Clock::now() >= end_; }
  double seconds() const { return seconds_; }
  // Milliseconds left, clamped to [0, cap] (for poll(2)).
  int remainingMs(int cap) const;

 private:
  double seconds_;
  Clock::time_point end_;
};

// n rounded up to a multiple of a.
inline size_t roundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Wakes the waits of this process when one of its own threads has delivered
// something they may be polling for (tcp's progress threads after a flag, a read's
// payload or a fence ack). Waits that only a peer process or a NIC can end (shm,
// verbs) are not woken: they sleep their time out and poll again.
class LocalWakeup {
 public:
  // The current generation: read before polling, sleep on it after.
  uint32_t generation() const { return generation_.load(std::memory_order_acquire); }
  // After the store that a waiter polls for: a syscall only while someone sleeps.
  void notify();
  // Sleeps up to `ns` unless notify() ran since `seen` was read.
  void sleep(uint32_t seen, long ns);

 private:
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> sleepers_{0};
};
LocalWakeup& localWakeup();

// Polls `ready()` until it returns true: spins first (a peer on another core
// answers in well under a microsecond), yields until a millisecond has passed,
// then sleeps a thirty-second of the time waited so far (20 us to 1 ms), or
// until a thread of this process delivers (LocalWakeup). A long wait -- a
// gradient bucket on a slow link -- so wakes up at most a thousand times a
// second, not ten thousand: on a core shared with backprop each wake-up takes
// the core from the compute (docs/evaluation/design-choices.md measures it); a
// flag a peer process writes is seen at most ~3% of the wait late, one tcp's
// progress thread stores at once. `check()` runs about every millisecond once
// the spin phase is over (peer liveness); it throws to abort the wait. Returns
// false if the deadline passed.
template <typename Ready, typename Check>
bool pollUntil(Ready&& ready, const Deadline& deadline, Check&& check) {
  for (int i = 0; i < 2048; ++i) {
    if (ready()) return true;
    cpuRelax();
  }
  const auto start = Clock::now();
  auto next_check = start;
  while (true) {
    const uint32_t seen = localWakeup().generation();  // before ready(): a delivery after it ends the sleep
    if (ready()) return true;
    const auto now = Clock::now();
    if (now >= next_check) {
      check();
      if (deadline.expired()) return ready();
      next_check = now + std::chrono::milliseconds(1);
    }
    const auto waited = now - start;
    if (waited < std::chrono::microseconds(200)) {
      for (int i = 0; i < 64; ++i) cpuRelax();
    } else if (waited < std::chrono::milliseconds(1)) {
      sched_yield();
    } else {
      const long ns = std::clamp<long>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count() / 32, 20 * 1000, 1000 * 1000);
      localWakeup().sleep(seen, ns);
    }
  }
}

// Orders every earlier store (including non-temporal ones, which glibc's memcpy
// uses for large copies) before later stores: the "flag after data" fence.
inline void storeFence() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

inline uint64_t loadAcquire(const void* p) {
  return __atomic_load_n(static_cast<const uint64_t*>(p), __ATOMIC_ACQUIRE);
}
inline void storeRelease(void* p, uint64_t v) {
  __atomic_store_n(static_cast<uint64_t*>(p), v, __ATOMIC_RELEASE);
}

}  // namespace rdkeras
