#include "engine/common.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

namespace rdkeras {

void throwErrno(const std::string& what) {
  const int err = errno;
  throw EngineError(strCat(what, ": ", std::strerror(err)));
}

int Deadline::remainingMs(int cap) const {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, cap));
}

LocalWakeup& localWakeup() {
  static LocalWakeup wakeup;
  return wakeup;
}

void LocalWakeup::notify() {
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0)
    syscall(SYS_futex, &generation_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

void LocalWakeup::sleep(uint32_t seen, long ns) {
  // Counted before the kernel compares the generation with `seen`: a notify() after `seen` was read
  // either finds a sleeper to wake or has changed the word before the kernel looks at it.
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  struct timespec ts = {0, ns};
  syscall(SYS_futex, &generation_, FUTEX_WAIT_PRIVATE, seen, &ts, nullptr, 0);
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace rdkeras
