// Progress liveness: which collective each rank is in, or finished last, where its peers can read it.
//
// The heartbeat names a rank whose process stopped. A rank that lives but hangs outside the engine (a Python
// callback that sleeps, a deadlock on a lock, a numpy_function that never returns) still beats; without more,
// whoever waits for it times out naming the neighbour it waits for. So every rank counts the collectives it
// enters and finishes in a record in its control block (one-sidedly readable, like the heartbeat words), and
// a wait in a collective that lasts longer than the progress timeout reads the members' records: a member in
// no collective that has not finished the one this rank waits in is the laggard (engine.h says what follows).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace rdkeras {

// One rank's record, as it lies in its control block (64 bytes, read whole).
struct ProgressRecord {
  uint64_t entered = 0;     // collectives entered so far (the current one included)
  uint64_t finished = 0;    // collectives finished so far (entered - finished: how many are under way)
  int64_t finished_ns = 0;  // wall-clock (system_clock) ns at which it finished the last one; 0: none yet
  char label[40] = {};      // the last one entered ("allreduce ring grads"), NUL-terminated, maybe cut short
  bool inCollective() const { return entered > finished; }
  std::string labelText() const;
};
static_assert(sizeof(ProgressRecord) == 64, "the record is one cache line, read in one transfer");

// The flight recorder: a rank's last collectives, dumped on a failure (rdkeras/flight.py) for
// `rdkeras postmortem` to line up across ranks.
struct FlightEntry {
  uint64_t number = 0;  // this rank's collective #number (0: an empty slot)
  char label[40] = {};  // as ProgressRecord::label
  uint64_t bytes = 0;   // the bytes it was called with
  uint32_t members = 0;
  int64_t start_ns = 0, end_ns = 0;  // wall clock; end 0: under way
  bool failed = false;               // it ended on an error
};

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity) : slots_(capacity) {}
  // Records a collective's start; returns its slot for end().
  size_t begin(uint64_t number, const char (&label)[40], uint64_t bytes, uint32_t members, int64_t start_ns);
  void end(size_t slot, uint64_t number, int64_t end_ns,
           bool failed);  // (nothing if the slot was taken since)
  // The entries, oldest first.
  std::vector<FlightEntry> entries() const;

 private:
  mutable std::mutex mu_;
  std::vector<FlightEntry> slots_;
  uint64_t next_ = 0;
};

// "kind name" (or "kind"), cut to fit a record's label.
void setLabel(char (&label)[40], const char* kind, const std::string& name);

// The laggard of a collective this rank (`me`) waits in as its collective #`my_entered`: among `members` (the
// collective's ranks; records indexed by rank), those in no collective that have not finished #`my_entered`,
// the one furthest behind (fewest finished), ties to the lower rank. -1 if there is none (every member is in
// a collective or past this one: slow, not hung -- the heartbeat and the timeout are for those).
int findLaggard(const std::vector<ProgressRecord>& records, const std::vector<int>& members, int me,
                uint64_t my_entered);

// What the rank that found `laggard` says: "rank 1 has not entered allreduce #1234 (ring grads); it finished
// #1233 (allreduce ring grads) 12.0 s ago ..." (`age_s` < 0: it finished none yet).
std::string describeLaggard(int laggard, const std::string& kind, const std::string& name, uint64_t op_number,
                            const ProgressRecord& its, double age_s);

// "allreduce #12 (ring grads)", or "allreduce #12" without a name.
std::string collectiveText(const char* kind, const std::string& name, uint64_t number);

// Seconds between a record's finished_ns and `now_ns` (wall clock), never negative; -1 if it finished none.
double secondsSince(int64_t finished_ns, int64_t now_ns);

}  // namespace rdkeras
