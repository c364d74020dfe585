#include "engine/progress.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "engine/common.h"

namespace rdkeras {

std::string ProgressRecord::labelText() const { return std::string(label, strnlen(label, sizeof(label))); }

void setLabel(char (&label)[40], const char* kind, const std::string& name) {
  // Once per collective: no allocation.
  size_t at = 0;
  const auto put = [&](const char* p, size_t n) {
    n = std::min(n, sizeof(label) - 1 - at);
    std::memcpy(label + at, p, n);
    at += n;
  };
  put(kind, std::strlen(kind));
  if (!name.empty()) {
    put(" ", 1);
    put(name.data(), name.size());
  }
  std::memset(label + at, 0, sizeof(label) - at);
}

int findLaggard(const std::vector<ProgressRecord>& records, const std::vector<int>& members, int me,
                uint64_t my_entered) {
  int laggard = -1;
  for (int r : members) {
    if (r == me || r < 0 || r >= static_cast<int>(records.size())) continue;
    const ProgressRecord& p = records[r];
    if (p.inCollective() || p.finished >= my_entered) continue;
    if (laggard < 0 || p.finished < records[laggard].finished ||
        (p.finished == records[laggard].finished && r < laggard))
      laggard = r;
  }
  return laggard;
}

double secondsSince(int64_t finished_ns, int64_t now_ns) {
  if (finished_ns <= 0) return -1;
  return std::max<double>(0, static_cast<double>(now_ns - finished_ns) * 1e-9);
}

std::string collectiveText(const char* kind, const std::string& name, uint64_t number) {
  return name.empty() ? strCat(kind, " #", number) : strCat(kind, " #", number, " (", name, ")");
}

std::string describeLaggard(int laggard, const std::string& kind, const std::string& name, uint64_t op_number,
                            const ProgressRecord& its, double age_s) {
  char age[32];
  std::snprintf(age, sizeof(age), "%.1f", age_s);
  const std::string last = its.finished == 0 || age_s < 0 ? std::string("it has finished none yet")
                                                          : strCat("it finished #", its.finished, " (",
                                                                   its.labelText(), ") ", age, " s ago");
  return strCat(
      "rank ", laggard, " has not entered ", collectiveText(kind.c_str(), name, op_number), "; ", last,
      " (it is alive -- its heartbeat goes on -- but stuck outside the engine: in Python, a callback, "
      "a lock; its log has its stack)");
}

}  // namespace rdkeras
