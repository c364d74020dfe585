// Progress liveness (engine/progress.h): who the laggard is, what its error says, and three engines in this
// process where one lives but never enters a ring allreduce: the other two name it, and it hears it was
// named.
#include "engine/progress.h"

#include <doctest/doctest.h>

#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/ring.h"

using namespace rdkeras;

namespace {

ProgressRecord record(uint64_t entered, uint64_t finished) {
  ProgressRecord r;
  r.entered = entered;
  r.finished = finished;
  return r;
}

}  // namespace

TEST_CASE("the laggard is the member in no collective that has not finished this one") {
  // Rank 0 waits in its collective #5; rank 1 finished #4 and is outside the engine; rank 2 is in #5.
  std::vector<ProgressRecord> records = {record(5, 4), record(4, 4), record(5, 4)};
  CHECK(findLaggard(records, {0, 1, 2}, 0, 5) == 1);
  CHECK(findLaggard(records, {0, 1, 2}, 2, 5) == 1);  // every survivor finds the same one
  // Every member in a collective (slow, not hung): none.
  records[1] = record(5, 4);
  CHECK(findLaggard(records, {0, 1, 2}, 0, 5) == -1);
  // A member past this collective is not behind it.
  records[1] = record(5, 5);
  CHECK(findLaggard(records, {0, 1, 2}, 0, 5) == -1);
}

TEST_CASE("the one furthest behind is the laggard; ties go to the lower rank; only members count") {
  std::vector<ProgressRecord> records = {record(9, 8), record(7, 7), record(5, 5), record(5, 5),
                                         record(1, 1)};
  CHECK(findLaggard(records, {0, 1, 2, 3}, 0, 9) == 2);  // 2 and 3 finished 5: the lower rank
  CHECK(findLaggard(records, {0, 1, 3}, 0, 9) == 3);
  CHECK(findLaggard(records, {0, 1, 2, 3, 4}, 0, 9) == 4);
  CHECK(findLaggard(records, {0}, 0, 9) == -1);
  CHECK(findLaggard(records, {0, 7, -1}, 0, 9) == -1);  // ranks outside the records are ignored
}

TEST_CASE("the error names the laggard, the collective it has not entered and when it finished its last") {
  ProgressRecord its = record(1233, 1233);
  setLabel(its.label, "allreduce", "ring grads");
  CHECK(its.labelText() == "allreduce ring grads");
  const std::string why = describeLaggard(1, "allreduce", "ring grads", 1234, its, 12.04);
  CHECK(why.rfind("rank 1 has not entered allreduce #1234 (ring grads); it finished #1233 "
                  "(allreduce ring grads) 12.0 s ago",
                  0) == 0);
  CHECK(describeLaggard(2, "allgather", "", 1, record(0, 0), -1)
            .rfind("rank 2 has not entered allgather #1; it has finished none yet", 0) == 0);
  // A label too long for the record is cut, NUL-terminated.
  setLabel(its.label, "allreduce", std::string(100, 'x'));
  CHECK(its.labelText().size() == sizeof(its.label) - 1);
  CHECK(secondsSince(0, 5) == -1);
  CHECK(secondsSince(2'000'000'000, 1'000'000'000) == 0);  // another host's clock ahead: never negative
  CHECK(secondsSince(1'000'000'000, 3'500'000'000) == doctest::Approx(2.5));
}

TEST_CASE("a live rank that never enters an allreduce is named by the others, and hears it was named") {
  const int world = 3;
  EngineOptions options;
  options.transport = "shm";
  options.arena_bytes = size_t{64} << 20;
  options.timeout_s = 30;
  options.heartbeat_s = 2;
  options.progress_s = 1;
  std::vector<std::shared_ptr<Engine>> engines;
  std::vector<std::string> descriptors;
  for (int r = 0; r < world; ++r) {
    engines.push_back(std::make_shared<Engine>(r, world, options));
    descriptors.push_back(engines.back()->localDescriptor());
  }
  std::vector<std::shared_ptr<RingAllreduce>> rings(world);
  std::vector<std::string> errors(world);
  std::vector<int> blamed(world, -2);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        engines[r]->connect(descriptors, std::string(32, 'k'));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  threads.clear();
  for (int r = 0; r < world; ++r) {
    REQUIRE(errors[r].empty());
    rings[r] = std::make_shared<RingAllreduce>(engines[r], 4096, 4096);
    rings[r]->setName("ring grads");
  }
  for (int r = 0; r < world; ++r)
    rings[r]->connect(rings[(r + world - 1) % world]->localDescriptor(),
                      rings[(r + 1) % world]->localDescriptor());
  std::string named;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> x(16, 1.0f);
      try {
        rings[r]->run({{x.data(), x.size() * sizeof(float)}}, DType::kFloat32, false);  // #1: everyone
        if (r == 1) {
          named = engines[r]->waitNamedHung();  // "hung" outside the engine until it is named
          return;
        }
        rings[r]->run({{x.data(), x.size() * sizeof(float)}}, DType::kFloat32,
                      false);  // #2: rank 1 never comes
      } catch (const PeerError& e) {
        errors[r] = e.what();
        blamed[r] = e.rank();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r : {0, 2}) {
    INFO("rank ", r, ": ", errors[r]);
    CHECK(blamed[r] == 1);
    CHECK(errors[r].find("rank 1 has not entered allreduce #2 (ring grads)") != std::string::npos);
  }
  CHECK(named.find("rank 1 has not entered collective #2") == 0);
  CHECK(engines[1]->progress().finished == 1);
  CHECK(engines[0]->progress().entered == 2);
  const std::vector<FlightEntry> flight = engines[0]->flightRecord();
  REQUIRE(flight.size() == 2);
  CHECK(flight[1].number == 2);
  CHECK(flight[1].bytes == 64);
  CHECK(flight[1].failed);
  CHECK(!flight[0].failed);
  CHECK(engines[1]->flightRecord().size() == 1);
  for (auto& e : engines) e->close();
}

TEST_CASE("the flight recorder keeps the last collectives, oldest first, and marks how each ended") {
  FlightRecorder recorder(3);
  CHECK(recorder.entries().empty());
  char label[40] = {};
  setLabel(label, "allreduce", "ring grads");
  for (uint64_t n = 1; n <= 5; ++n) {
    const size_t slot = recorder.begin(n, label, 100 * n, 3, static_cast<int64_t>(n) * 10);
    if (n < 5) recorder.end(slot, n, static_cast<int64_t>(n) * 10 + 5, n == 4);
  }
  const std::vector<FlightEntry> entries = recorder.entries();
  REQUIRE(entries.size() == 3);
  CHECK(entries[0].number == 3);
  CHECK(entries[2].number == 5);
  CHECK(entries[0].bytes == 300);
  CHECK(std::string(entries[0].label) == "allreduce ring grads");
  CHECK(entries[0].end_ns == 35);
  CHECK(!entries[0].failed);
  CHECK(entries[1].failed);
  CHECK(entries[2].end_ns == 0);  // under way
  recorder.end(0, 1, 99, false);  // slot 0 holds #4 now: a late end of #1 changes nothing
  CHECK(recorder.entries()[1].end_ns == 45);
}
