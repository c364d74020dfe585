// Errors, deadlines and the polling loop every wait in the engine goes through.
#pragma once

#include <sched.h>

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

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `ready()` until it returns true: spins first (a peer on another core
// answers in well under a microsecond), then yields, then sleeps briefly so an
// idle waiter does not burn a core. `check()` runs about every millisecond once
// the spin phase is over (peer liveness); it throws to abort the wait.
// Returns false if the deadline passed.
template <typename Ready, typename Check>
bool pollUntil(Ready&& ready, const Deadline& deadline, Check&& check) {
  for (int i = 0; i < 2048; ++i) {
    if (ready()) return true;
    cpuRelax();
  }
  const auto start = Clock::now();
  auto next_check = start;
  while (true) {
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
    } else if (waited < std::chrono::milliseconds(5)) {
      sched_yield();
    } else {
      struct timespec ts = {0, 50 * 1000};
      nanosleep(&ts, nullptr);
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
