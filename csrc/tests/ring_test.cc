// The ring allreduce: its layout and chunk arithmetic, and RingAllreduce itself run by N engines in
// this process (one thread per rank), so a wrong step schedule gives wrong sums here.
#include "engine/ring.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/doubling.h"
#include "engine/hierarchical.h"

using namespace rdkeras;

TEST_CASE("the layout starts every tensor on a 64-byte boundary, in order, without overlap") {
  std::vector<ConstSpan> inputs;
  for (size_t bytes : {4, 64, 0, 65, 1000, 8, 4096}) inputs.push_back({nullptr, bytes});
  size_t total = 0;
  const std::vector<size_t> offsets = ringLayout(inputs, &total);
  REQUIRE(offsets.size() == inputs.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    CHECK(offsets[i] % 64 == 0);
    const size_t end = i + 1 < offsets.size() ? offsets[i + 1] : total;
    CHECK(offsets[i] + inputs[i].bytes <= end);
  }
  CHECK(total % 64 == 0);
  CHECK(total == 64 + 64 + 0 + 128 + 1024 + 64 + 4096);
}

TEST_CASE("a bucket's chunks tile it exactly, aligned, for every world size") {
  for (int n = 1; n <= 9; ++n) {
    for (size_t b0 : {size_t{0}, size_t{64 * 1000}}) {
      for (size_t len : {size_t{0}, size_t{64}, size_t{64 * 7}, size_t{64 * 1001}, size_t{1} << 20}) {
        const size_t b1 = b0 + len;
        size_t at = b0;
        for (int c = 0; c < n; ++c) {
          const ChunkRange r = ringChunk(b0, b1, n, c);
          CHECK(r.lo == at);  // chunks follow each other with no gap or overlap
          CHECK(r.hi >= r.lo);
          CHECK(r.hi <= b1);
          if (r.hi < b1) CHECK((r.hi - b0) % 64 == 0);  // all but the last boundary aligned
          at = r.hi;
        }
        CHECK(at == b1);  // and cover the bucket
      }
    }
  }
}

TEST_CASE("chunk indices wrap around the ring, negative ones too") {
  for (int n : {2, 3, 5}) {
    for (int c = -2 * n; c < 3 * n; ++c) {
      const ChunkRange a = ringChunk(0, 64 * 100, n, c), b = ringChunk(0, 64 * 100, n, ((c % n) + n) % n);
      CHECK(a.lo == b.lo);
      CHECK(a.hi == b.hi);
    }
  }
}

namespace {

// Runs fn(rank) on one thread per rank; rethrows the first exception any of them raised.
template <typename Fn>
void onEveryRank(int world, Fn&& fn) {
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// `world` engines of one job in this process, connected to each other.
std::vector<std::shared_ptr<Engine>> connectedEngines(int world, const std::string& transport) {
  EngineOptions options;
  options.transport = transport;
  options.arena_bytes = size_t{64} << 20;
  options.timeout_s = 30;
  std::vector<std::shared_ptr<Engine>> engines;
  std::vector<std::string> descriptors;
  for (int r = 0; r < world; ++r) {
    engines.push_back(std::make_shared<Engine>(r, world, options));
    descriptors.push_back(engines.back()->localDescriptor());
  }
  const std::string key(32, 'k');
  onEveryRank(world, [&](int r) { engines[r]->connect(descriptors, key); });
  return engines;
}

// Rank r's element j of tensor i in call `call`: small integers, so every sum is exact in float32.
double contribution(int r, size_t i, size_t j, int call) {
  return static_cast<double>((r + 1) * static_cast<int>((j * 7 + i + call) % 13) - 6);
}

// Rank r's inputs of call `call`: one tensor of contribution()s per count; *data keeps them alive.
template <typename T>
std::vector<ConstSpan> callInputs(int r, int call, const std::vector<size_t>& counts,
                                  std::vector<std::vector<T>>* data) {
  data->assign(counts.size(), {});
  std::vector<ConstSpan> inputs;
  for (size_t i = 0; i < counts.size(); ++i) {
    for (size_t j = 0; j < counts[i]; ++j) (*data)[i].push_back(static_cast<T>(contribution(r, i, j, call)));
    inputs.push_back({(*data)[i].data(), counts[i] * sizeof(T)});
  }
  return inputs;
}

// Adds to *wrong a line for each tensor of `result` that is not the sum (mean) of `members`' contributions.
template <typename T>
void checkSums(const AllreduceResult& result, const std::vector<size_t>& counts,
               const std::vector<int>& members, int call, bool average, std::vector<std::string>* wrong) {
  for (size_t i = 0; i < counts.size(); ++i) {
    const T* got = reinterpret_cast<const T*>(result.out + result.offsets[i]);
    for (size_t j = 0; j < counts[i]; ++j) {
      double want = 0;
      for (int m : members) want += contribution(m, i, j, call);
      if (average) want /= static_cast<double>(members.size());
      if (std::fabs(static_cast<double>(got[j]) - want) > 1e-6 * (1 + std::fabs(want))) {
        wrong->push_back(strCat("call ", call, " tensor ", i, " element ", j, ": ", got[j], " != ", want));
        break;  // one line per tensor
      }
    }
  }
}

std::vector<int> allOf(int world) {
  std::vector<int> members;
  for (int r = 0; r < world; ++r) members.push_back(r);
  return members;
}

struct RingCase {
  int world;
  std::vector<int> members;  // in ring order; empty: every rank
  size_t bucket_bytes;
  DType dtype;
};

template <typename T>
void checkRing(const RingCase& c, const std::string& transport) {
  // Odd element counts (an empty tensor, primes, one past a 64-byte line), so chunks split tensors
  // mid-way and the last chunks are short or empty.
  const std::vector<size_t> counts = {1, 3, 0, 17, 1000, 17, 4099};
  auto engines = connectedEngines(c.world, transport);
  std::vector<int> members = c.members;
  if (members.empty())
    for (int r = 0; r < c.world; ++r) members.push_back(r);
  const int n = static_cast<int>(members.size());
  size_t capacity = 0;
  for (size_t count : counts) capacity += count * sizeof(T) + 64;

  std::vector<std::shared_ptr<RingAllreduce>> rings(c.world);
  for (int r : members)
    rings[r] = std::make_shared<RingAllreduce>(engines[r], capacity, c.bucket_bytes, c.members);
  for (int p = 0; p < n; ++p)
    rings[members[p]]->connect(rings[members[(p + n - 1) % n]]->localDescriptor(),
                               rings[members[(p + 1) % n]]->localDescriptor());

  std::vector<std::vector<std::string>> wrong(c.world);
  onEveryRank(c.world, [&](int r) {
    if (!rings[r]) return;  // not a member
    for (int call = 0; call < 3; ++call) {
      const bool average = call == 1;
      std::vector<std::vector<T>> data;
      const std::vector<ConstSpan> inputs = callInputs(r, call, counts, &data);
      checkSums<T>(rings[r]->run(inputs, c.dtype, average), counts, members, call, average, &wrong[r]);
    }
  });
  rings.clear();  // before the engines: each waits for its right member's last ack
  for (int r = 0; r < c.world; ++r) {
    INFO("rank ", r, ": ", wrong[r].size(), " wrong tensors, first: ", wrong[r].empty() ? "" : wrong[r][0]);
    CHECK(wrong[r].empty());
  }
}

}  // namespace

TEST_CASE("RingAllreduce sums exactly on every rank, over several ranks, buckets and dtypes") {
  for (int world : {2, 3, 4, 5}) {
    for (size_t bucket : {size_t{4} << 10, size_t{1} << 20}) {  // several passes, and one
      CAPTURE(world);
      CAPTURE(bucket);
      checkRing<float>({world, {}, bucket, DType::kFloat32}, "shm");
      checkRing<double>({world, {}, bucket, DType::kFloat64}, "shm");
    }
  }
}

TEST_CASE("RingAllreduce over tcp, and over a subgroup listed out of order") {
  checkRing<float>({3, {}, size_t{4} << 10, DType::kFloat32}, "tcp");
  checkRing<float>({4, {3, 0, 2}, size_t{4} << 10, DType::kFloat32}, "shm");
}

TEST_CASE("hierarchicalAllreduce sums exactly on every rank: hosts x workers, passes and dtypes") {
  // Rank r is worker r % L of host r / L; `inside` rings the host's workers, `across` the workers at one
  // position on every host.
  const std::vector<size_t> counts = {1, 3, 0, 17, 1000, 17, 4099};
  for (auto [hosts, locals] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}, std::pair{2, 1}}) {
    for (size_t bucket : {size_t{4} << 10, size_t{1} << 20}) {
      CAPTURE(hosts);
      CAPTURE(locals);
      CAPTURE(bucket);
      const int world = hosts * locals;
      auto engines = connectedEngines(world, "shm");
      size_t capacity = 0;
      for (size_t count : counts) capacity += count * sizeof(float) + 64;
      std::vector<std::shared_ptr<RingAllreduce>> inside(world), across(world);
      for (int r = 0; r < world; ++r) {
        std::vector<int> host, position;
        for (int l = 0; l < locals; ++l) host.push_back(r / locals * locals + l);
        for (int h = 0; h < hosts; ++h) position.push_back(h * locals + r % locals);
        inside[r] = std::make_shared<RingAllreduce>(engines[r], capacity, bucket, host);
        across[r] = std::make_shared<RingAllreduce>(engines[r], bucket, bucket, position);
      }
      auto connect = [&](std::vector<std::shared_ptr<RingAllreduce>>& rings, auto ring_of) {
        for (int r = 0; r < world; ++r) {
          const std::vector<int> m = ring_of(r);
          const int n = static_cast<int>(m.size()),
                    at = static_cast<int>(std::find(m.begin(), m.end(), r) - m.begin());
          if (n > 1)
            rings[r]->connect(rings[m[(at + n - 1) % n]]->localDescriptor(),
                              rings[m[(at + 1) % n]]->localDescriptor());
        }
      };
      connect(inside, [&](int r) {
        std::vector<int> m;
        for (int l = 0; l < locals; ++l) m.push_back(r / locals * locals + l);
        return m;
      });
      connect(across, [&](int r) {
        std::vector<int> m;
        for (int h = 0; h < hosts; ++h) m.push_back(h * locals + r % locals);
        return m;
      });
      std::vector<std::vector<std::string>> wrong(world);
      onEveryRank(world, [&](int r) {
        for (int call = 0; call < 3; ++call) {
          const bool average = call == 1;
          std::vector<std::vector<float>> data;
          const std::vector<ConstSpan> inputs = callInputs(r, call, counts, &data);
          const RingAllreduce::Result result = hierarchicalAllreduce(
              *inside[r], *across[r], inputs, DType::kFloat32, average, world, DType::kFloat32);
          checkSums<float>(result, counts, allOf(world), call, average, &wrong[r]);
        }
      });
      inside.clear();
      across.clear();
      for (int r = 0; r < world; ++r) {
        INFO("rank ", r, ": ", wrong[r].size(),
             " wrong tensors, first: ", wrong[r].empty() ? "" : wrong[r][0]);
        CHECK(wrong[r].empty());
      }
    }
  }
}

TEST_CASE("DoublingAllreduce sums exactly on every rank, powers of two or not, calls after calls") {
  const std::vector<size_t> counts = {1, 3, 0, 17, 1000, 17, 4099};
  for (int world = 1; world <= 9; ++world) {
    CAPTURE(world);
    auto engines = connectedEngines(world, world == 3 ? "tcp" : "shm");
    size_t capacity = 0;
    for (size_t count : counts) capacity += count * sizeof(float) + 64;
    std::vector<std::shared_ptr<DoublingAllreduce>> groups(world);
    for (int r = 0; r < world; ++r) groups[r] = std::make_shared<DoublingAllreduce>(engines[r], capacity);
    std::vector<std::string> descriptors;
    for (int r = 0; r < world; ++r) descriptors.push_back(groups[r]->localDescriptor());
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> partners(
          world);  // only the partners' descriptors, as the Python side passes them
      for (int p : groups[r]->partners()) partners[p] = descriptors[p];
      if (world > 1) groups[r]->connect(partners);
    }
    std::vector<std::vector<std::string>> wrong(world);
    std::vector<std::vector<float>> first(world);  // rank r's bits of call 1, tensor 4
    onEveryRank(world, [&](int r) {
      for (int call = 0; call < 5; ++call) {
        const bool average = call % 2 == 1;
        std::vector<std::vector<float>> data;
        const std::vector<ConstSpan> inputs = callInputs(r, call, counts, &data);
        const AllreduceResult result = groups[r]->run(inputs, DType::kFloat32, average);
        const float* kept = reinterpret_cast<const float*>(result.out + result.offsets[4]);
        if (call == 1) first[r].assign(kept, kept + counts[4]);
        checkSums<float>(result, counts, allOf(world), call, average, &wrong[r]);
      }
    });
    groups.clear();  // before the engines: each waits for its partners' last acks
    for (int r = 0; r < world; ++r) {
      INFO("rank ", r, ": ", wrong[r].size(), " wrong tensors, first: ", wrong[r].empty() ? "" : wrong[r][0]);
      CHECK(wrong[r].empty());
      CHECK(first[r] == first[0]);  // the same bits everywhere (averages are inexact)
    }
  }
}

TEST_CASE("the wire types round to nearest even; sums on the wire add in float32") {
  const std::vector<float> in = {1.0f,     1.0f + 0x1p-11f, 1.0f + 0x3p-11f, 65504.0f,       65520.0f,
                                 0x1p-24f, 0x1p-25f,        -2.5f,           1.0f + 0x1p-8f, 1.0f + 0x3p-8f};
  std::vector<uint16_t> wire(in.size());
  std::vector<float> back(in.size());
  castToWire(in.data(), wire.data(), in.size(), DType::kFloat16);
  castFromWire(wire.data(), back.data(), in.size(), DType::kFloat16, 1.0f);
  const std::vector<float> half = {1.0f,     1.0f, 1.0f + 0x4p-11f, 65504.0f,       INFINITY,
                                   0x1p-24f, 0.0f, -2.5f,           1.0f + 0x1p-8f, 1.0f + 0x3p-8f};
  CHECK(back == half);
  castToWire(in.data(), wire.data(), in.size(), DType::kBFloat16);
  castFromWire(wire.data(), back.data(), in.size(), DType::kBFloat16, 2.0f);  // scaled on the way back
  const std::vector<float> brain = {2.0f,     2.0f,     2.0f,  2 * 65536.0f, 2 * 65536.0f,
                                    0x1p-23f, 0x1p-24f, -5.0f, 2.0f,         2.0f + 0x4p-7f};
  CHECK(back == brain);
}

namespace {

// Reduce-scatter then allgather over rings of `world` ranks: every member's shard is the sum (mean) of every
// member's bytes of it, and the allgather hands every member all shards in member order; calls alternate
// output blocks, so the previous call's results stay intact.
void checkShards(int world, size_t bucket_bytes, size_t shard_floats, const std::string& transport) {
  auto engines = connectedEngines(world, transport);
  const size_t total = shard_floats * world;
  std::vector<std::shared_ptr<RingAllreduce>> rings(world);
  for (int r = 0; r < world; ++r)
    rings[r] = std::make_shared<RingAllreduce>(engines[r], total * sizeof(float) + 64, bucket_bytes);
  for (int r = 0; r < world; ++r)
    rings[r]->connect(rings[(r + world - 1) % world]->localDescriptor(),
                      rings[(r + 1) % world]->localDescriptor());
  std::vector<std::vector<std::string>> wrong(world);
  onEveryRank(world, [&](int r) {
    for (int call = 0; call < 3; ++call) {
      const bool average = call == 1;
      std::vector<float> input(total);
      for (size_t j = 0; j < total; ++j) input[j] = static_cast<float>(contribution(r, 0, j, call));
      const auto* mine = reinterpret_cast<const float*>(
          rings[r]->reduceScatter({input.data(), total * sizeof(float)}, DType::kFloat32, average));
      std::vector<float> shard(mine, mine + shard_floats);  // (the next call may reuse the block)
      for (size_t j = 0; j < shard_floats; ++j) {
        double want = 0;
        for (int m = 0; m < world; ++m) want += contribution(m, 0, r * shard_floats + j, call);
        if (average) want /= world;
        if (std::fabs(shard[j] - want) > 1e-6 * (1 + std::fabs(want))) {
          wrong[r].push_back(strCat("call ", call, " shard element ", j, ": ", shard[j], " != ", want));
          break;
        }
      }
      for (auto& v : shard) v += static_cast<float>(r);  // what the member made of its shard
      const auto* all =
          reinterpret_cast<const float*>(rings[r]->allgather({shard.data(), shard_floats * sizeof(float)}));
      for (size_t j = 0; j < total; ++j) {
        const int owner = static_cast<int>(j / shard_floats);
        double want = 0;
        for (int m = 0; m < world; ++m) want += contribution(m, 0, j, call);
        if (average) want /= world;
        want += owner;
        if (std::fabs(all[j] - want) > 1e-6 * (1 + std::fabs(want))) {
          wrong[r].push_back(strCat("call ", call, " gathered element ", j, ": ", all[j], " != ", want));
          break;
        }
      }
    }
  });
  rings.clear();
  for (int r = 0; r < world; ++r) {
    INFO("rank ", r, ": ", wrong[r].empty() ? "" : wrong[r][0]);
    CHECK(wrong[r].empty());
  }
}

}  // namespace

TEST_CASE("reduceScatter and allgather: each member's shard summed, then every shard everywhere") {
  for (int world : {1, 2, 3, 4}) {
    for (size_t bucket : {size_t{1} << 10, size_t{1} << 20}) {  // several passes per shard, and one
      for (size_t shard_floats : {size_t{0}, size_t{16}, size_t{16 * 97}}) {
        CAPTURE(world);
        CAPTURE(bucket);
        CAPTURE(shard_floats);
        checkShards(world, bucket, shard_floats, "shm");
      }
    }
  }
  checkShards(3, size_t{1} << 10, 16 * 40, "tcp");
}

TEST_CASE("reduceScatter and allgather refuse a buffer that does not split into aligned shards") {
  auto engines = connectedEngines(1, "shm");
  RingAllreduce ring(engines[0], 1 << 12, 1 << 10);
  std::vector<float> data(1 << 11);
  CHECK_THROWS_WITH_AS(ring.reduceScatter({data.data(), 100}, DType::kFloat32, false),
                       doctest::Contains("pad the buffer"), EngineError);
  CHECK_THROWS_WITH_AS(ring.allgather({data.data(), 8192}), doctest::Contains("exceeds this ring's capacity"),
                       EngineError);
}

TEST_CASE("a ring's slots are no larger than its capacity over the members, however large the bucket") {
  // A small ring (a sync or a row gather) beside 64 MiB buckets: its two slots once took 2 x 64 MiB / N of
  // zeroed, resident shared memory; a slot never holds more than one member's chunk of a whole call.
  auto engines = connectedEngines(2, "shm");
  const size_t capacity = 1 << 20, bucket = size_t{64} << 20;
  const uint64_t before = engines[0]->tracker().counters().bytes_registered;
  RingAllreduce ring(engines[0], capacity, bucket);
  const uint64_t registered = engines[0]->tracker().counters().bytes_registered - before;
  CHECK(registered >= 3 * capacity);         // two output regions and two slots of half the capacity each
  CHECK(registered <= 3 * capacity + 4096);  // (and a few flags)
}
