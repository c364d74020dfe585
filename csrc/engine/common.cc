#include "engine/common.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace rdkeras {

void throwErrno(const std::string& what) {
  const int err = errno;
  throw EngineError(strCat(what, ": ", std::strerror(err)));
}

int Deadline::remainingMs(int cap) const {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, cap));
}

}  // namespace rdkeras
