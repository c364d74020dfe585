// pollUntil: how a wait for a peer spends the core it shares with the compute.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "engine/common.h"

using namespace rdkeras;

TEST_CASE("a long wait wakes up a few hundred times, not thousands, and still sees the flag") {
  // A bucket of gradients on a slow link: the waiter shares its core with backprop, so every
  // wake-up takes the core from the compute. The sleeps grow with the time waited (1/32 of it).
  std::atomic<bool> flag{false};
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    flag.store(true, std::memory_order_release);
  });
  const auto start = Clock::now();
  long late_polls = 0;  // after the first 10 ms: the phase that lasts
  const bool ok = pollUntil(
      [&] {
        if (Clock::now() - start > std::chrono::milliseconds(10)) ++late_polls;
        return flag.load(std::memory_order_acquire);
      },
      Deadline(10.0), [] {});
  setter.join();
  CHECK(ok);
  // Sleeps of waited/32, at most 1 ms: from 10 to 32 ms at most 32 ln(3.2) + 1 = 38 polls (60
  // allowed), then one a millisecond: about 310 for a 300 ms wait (a loaded machine only makes the
  // sleeps longer). The fixed 50 us sleeps this replaced polled about 2300 times.
  const double waited_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  CHECK(waited_ms >= 300.0);
  CHECK(late_polls <= 60 + static_cast<long>(waited_ms - 32.0));
}

TEST_CASE("a wait that outlives its deadline returns false after checking the peer") {
  int checks = 0;
  const bool ok = pollUntil([] { return false; }, Deadline(0.05), [&] { ++checks; });
  CHECK_FALSE(ok);
  CHECK(checks >= 1);  // liveness is checked while waiting, not only at the end
}

TEST_CASE("a sleeping wait is woken by a delivery in this process, and never sleeps through one") {
  LocalWakeup& wakeup = localWakeup();
  // A delivery between reading the generation and sleeping: the sleep returns at once.
  uint32_t seen = wakeup.generation();
  wakeup.notify();
  auto start = Clock::now();
  wakeup.sleep(seen, 900 * 1000 * 1000);
  CHECK(Clock::now() - start < std::chrono::milliseconds(450));  // not the 900 ms timeout
  // A delivery while asleep wakes it (tcp's progress thread after a flag).
  seen = wakeup.generation();
  std::thread notifier([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    wakeup.notify();
  });
  start = Clock::now();
  wakeup.sleep(seen, 900 * 1000 * 1000);
  notifier.join();
  CHECK(Clock::now() - start < std::chrono::milliseconds(450));
  CHECK(wakeup.generation() != seen);
}
