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

size_t FlightRecorder::begin(uint64_t number, const char (&label)[40], uint64_t bytes, uint32_t members,
                             int64_t start_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t slot = next_++ % slots_.size();
  FlightEntry& e = slots_[slot];
  e.number = number;
  std::memcpy(e.label, label, sizeof(e.label));
  e.bytes = bytes;
  e.members = members;
  e.start_ns = start_ns;
  e.end_ns = 0;
  e.failed = false;
  return slot;
}

void FlightRecorder::end(size_t slot, uint64_t number, int64_t end_ns, bool failed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slots_[slot].number != number) return;
  slots_[slot].end_ns = end_ns;
  slots_[slot].failed = failed;
}

std::vector<FlightEntry> FlightRecorder::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightEntry> out;
  const size_t n = slots_.size();
  for (uint64_t i = next_ > n ? next_ - n : 0; i < next_; ++i) out.push_back(slots_[i % n]);
  return out;
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
