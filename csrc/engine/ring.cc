#include "engine/ring.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "engine/copy.h"

namespace rdkeras {

namespace {

// Runs a ring's hook on each pass's chunk, passes in order, on a thread of its own (see RingAllreduce::run).
class PassHooks {
 public:
  explicit PassHooks(const RingAllreduce::ChunkHook& hook) : hook_(hook), thread_([this] { loop(); }) {}
  // The caller failed (or is done): starts no further hook and waits for the one running, whose own waits
  // are bounded by the engine's deadline.
  ~PassHooks() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  PassHooks(const PassHooks&) = delete;
  PassHooks& operator=(const PassHooks&) = delete;

  void submit(uint8_t* chunk, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back({chunk, bytes});
    }
    cv_.notify_all();
  }
  // Until the first `count` hooks are done; rethrows what a hook threw.
  void waitDone(size_t count) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= count || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop() {
    while (true) {
      std::pair<uint8_t*, size_t> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || done_ < jobs_.size(); });
        if (stopping_) return;
        job = jobs_[done_];
      }
      try {
        hook_(job.first, job.second);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        error_ = std::current_exception();
        cv_.notify_all();
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++done_;
      }
      cv_.notify_all();
    }
  }

  const RingAllreduce::ChunkHook& hook_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<uint8_t*, size_t>> jobs_;
  size_t done_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started once the rest is initialised
};

}  // namespace

RingAllreduce::RingAllreduce(std::shared_ptr<Engine> engine, size_t capacity_bytes, size_t bucket_bytes,
                             std::vector<int> members)
    : CollectiveGroup(std::move(engine), capacity_bytes, std::move(members)),
      rank_(positionOf(members_, engine_->rank())),
      left_(members_[(rank_ + world_ - 1) % world_]),
      right_(members_[(rank_ + 1) % world_]),
      bucket_bytes_(roundUp(std::max<size_t>(bucket_bytes, kAlign * world_), kAlign * world_)) {
  // A slot holds one pass's chunk: never more than a pass (or the whole capacity) over the members.
  slot_bytes_ = roundUp((std::min(bucket_bytes_, capacity_) + world_ - 1) / world_, kAlign);
  registered_ = std::make_unique<RegisteredBlock>(engine_->tracker(), registeredBytes());
  block_ = registered_->data();
}

RingAllreduce::~RingAllreduce() {
  // With two members the ack travels ahead of the allgather's chunks on the same connection; with
  // more, the right member may ack after this rank has everything it needs.
  if (right_key_ != 0 && messages_ > 0) engine_->settleFlag(block_ + offAck(), messages_, right_);
}

std::string RingAllreduce::localDescriptor() const {
  return strCat("ring;rank=", engine_->rank(), ";key=", registered_->key(), ";capacity=", capacity_,
                ";bucket=", bucket_bytes_);
}

void RingAllreduce::connect(const std::string& left, const std::string& right) {
  for (const auto* d : {&left, &right}) {
    if (fieldNumber(*d, "capacity") != capacity_ || fieldNumber(*d, "bucket") != bucket_bytes_)
      throw EngineError(strCat("allreduce: rank ", field(*d, "rank"), " declared another capacity/bucket (",
                               *d, ") than this rank (", localDescriptor(), ")"));
  }
  if (fieldNumber(left, "rank") != static_cast<uint64_t>(left_) ||
      fieldNumber(right, "rank") != static_cast<uint64_t>(right_))
    throw EngineError("allreduce: neighbour descriptors from the wrong ranks");
  left_key_ = fieldNumber(left, "key");
  right_key_ = fieldNumber(right, "key");
}

ChunkRange ringChunk(size_t b0, size_t b1, int n, int c) {
  const size_t chunk = roundUp((b1 - b0 + n - 1) / n, kAlign);
  const size_t lo = std::min(b1, b0 + static_cast<size_t>((c % n + n) % n) * chunk);
  return {lo, std::min(b1, lo + chunk)};
}

void RingAllreduce::reduceScatterStep(const std::vector<ConstSpan>& inputs,
                                      const std::vector<size_t>& offsets, size_t send_begin, size_t send_end,
                                      bool send_from_inputs, size_t recv_begin, size_t recv_end, uint8_t* out,
                                      DType dtype, double scale, uint64_t signature) {
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  const uint64_t m = messages_;
  const int slot = m % 2;
  // Send: the right neighbour's slot m%2 is free once it acked message m-2.
  if (m >= 2) engine_->waitFlag(block_ + offAck(), m - 1, right_, "allreduce: ack from the right neighbour");
  // The call's first message: the right member learns what we reduce (ordered before the flag).
  if (signature) t.writeFlag(right_, right_key_, offSignature(slot), signature, deadline);
  if (send_from_inputs) {
    forEachSegment(inputs, offsets, send_begin, send_end, [&](size_t i, size_t lo, size_t hi) {
      t.write(right_, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), right_key_,
              offSlot(slot) + (lo - send_begin), hi - lo, deadline);
    });
  } else if (send_end > send_begin) {
    t.write(right_, out + send_begin, right_key_, offSlot(slot) + 0, send_end - send_begin, deadline);
  }
  t.writeFlag(right_, right_key_, offFlag(slot), m + 1, deadline);
  // Receive the left neighbour's partial sum and add our input to it.
  engine_->waitFlag(block_ + offFlag(slot), m + 1, left_, "allreduce: data from the left neighbour");
  if (signature && loadAcquire(block_ + offSignature(slot)) != signature) {
    const std::string why =
        strCat("allreduce: rank ", left_, " passed other tensors than this rank (rank ", engine_->rank(),
               ": ", inputs.size(), " tensors, ", total_bytes_, " bytes of ", dtypeName(dtype),
               "); every member must pass the same sizes and dtype, in the same order");
    engine_->reportOwnFailure(why);
    throw EngineError(why);
  }
  engine_->countReceived(recv_end - recv_begin);
  const uint8_t* staged = block_ + offSlot(slot);
  forEachSegment(inputs, offsets, recv_begin, recv_end, [&](size_t i, size_t lo, size_t hi) {
    const auto* in = static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]);
    addInto(dtype, out + lo, in, staged + (lo - recv_begin), hi - lo, scale,
            engine_->transportOptions().nt_threshold);
  });
  t.writeFlag(left_, left_key_, offAck(), m + 1, deadline);
  ++messages_;
}

void RingAllreduce::allgatherStep(uint8_t* out, size_t out_offset_in_region, size_t send_begin,
                                  size_t send_end) {
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  if (send_end > send_begin)
    t.write(right_, out + send_begin, right_key_, out_offset_in_region + send_begin, send_end - send_begin,
            deadline);
  t.writeFlag(right_, right_key_, offGather(), gathers_ + 1, deadline);
  engine_->waitFlag(block_ + offGather(), gathers_ + 1, left_, "allreduce: gathered chunk from the left");
  ++gathers_;
}

RingAllreduce::Result RingAllreduce::run(const std::vector<ConstSpan>& inputs, DType dtype, bool average,
                                         const ChunkHook& between) {
  const CollectiveScope scope(*engine_, "allreduce", name_, members_, inputBytes(inputs));
  size_t total;
  std::vector<size_t> offsets = ringLayoutWithin(inputs, capacity_, "ring", &total);
  total_bytes_ = 0;
  for (const auto& in : inputs) total_bytes_ += in.bytes;
  const uint64_t signature = callSignature(inputs, dtype);
  const size_t out_region_offset = nextOutput();
  uint8_t* out = block_ + out_region_offset;
  const int n = world_;
  if (n == 1) {
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      std::memcpy(out + lo, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), hi - lo);
    });
    if (between) {
      for (size_t b0 = 0; b0 == 0 || b0 < total; b0 += bucket_bytes_)  // the same passes as with members
        between(out + b0, std::min(total, b0 + bucket_bytes_) - b0);
    }
    return {out, std::move(offsets)};
  }
  if (right_key_ == 0) throw EngineError("allreduce: run() before connect()");
  const double inv = average ? 1.0 / n : 1.0;
  // Allgather of pass [b0, b1): at step s send the complete chunk rank+1-s; the left neighbour writes chunk
  // rank-s straight into our output block.
  auto allgather = [&](size_t b0, size_t b1) {
    for (int s = 0; s < n - 1; ++s) {
      const ChunkRange send = ringChunk(b0, b1, n, rank_ + 1 - s), recv = ringChunk(b0, b1, n, rank_ - s);
      allgatherStep(out, out_region_offset, send.lo, send.hi);
      engine_->countReceived(recv.hi - recv.lo);  // what the left neighbour wrote
    }
  };
  // With a hook and more than one pass, the hook of pass k runs on a thread of its own while this one
  // reduce-scatters pass k+1 and allgathers pass k-1: the same order of messages on every member.
  std::optional<PassHooks> hooks;
  if (between && total > bucket_bytes_) hooks.emplace(between);
  size_t passes = 0, gather_b0 = 0, gather_b1 = 0;  // the pass whose allgather waits for its hook
  // At least one pass, even for nothing: the signature must reach the neighbour every call.
  for (size_t b0 = 0; b0 == 0 || b0 < total; b0 += bucket_bytes_) {
    const size_t b1 = std::min(total, b0 + bucket_bytes_);
    // Reduce-scatter: at step s send chunk rank-s, receive chunk rank-s-1.
    for (int s = 0; s < n - 1; ++s) {
      const ChunkRange send = ringChunk(b0, b1, n, rank_ - s), recv = ringChunk(b0, b1, n, rank_ - s - 1);
      reduceScatterStep(inputs, offsets, send.lo, send.hi, s == 0, recv.lo, recv.hi, out, dtype,
                        s == n - 2 ? inv : 1.0, b0 == 0 && s == 0 ? signature : 0);
    }
    const ChunkRange mine = ringChunk(b0, b1, n, rank_ + 1);  // the chunk summed here
    if (!hooks) {
      if (between) between(out + mine.lo, mine.hi - mine.lo);
      allgather(b0, b1);
      continue;
    }
    hooks->submit(out + mine.lo, mine.hi - mine.lo);
    if (passes++ > 0) {
      hooks->waitDone(passes - 1);
      allgather(gather_b0, gather_b1);
    }
    gather_b0 = b0, gather_b1 = b1;
  }
  if (hooks) {
    hooks->waitDone(passes);
    allgather(gather_b0, gather_b1);
  }
  return {out, std::move(offsets)};
}

size_t RingAllreduce::shardBytes(size_t bytes, size_t item, const char* what) const {
  const size_t n = static_cast<size_t>(world_);
  if (bytes > capacity_)
    throw EngineError(
        strCat(what, " of ", bytes, " bytes exceeds this ring's capacity of ", capacity_, " bytes"));
  if (bytes % (n * kAlign) != 0 || bytes % item != 0)
    throw EngineError(strCat(what, ": ", bytes, " bytes do not split into ", n, " shards of a multiple of ",
                             kAlign, " bytes each; pad the buffer"));
  return bytes / n;
}

uint8_t* RingAllreduce::reduceScatter(const std::vector<ConstSpan>& inputs, DType dtype, bool average) {
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const ConstSpan& part : inputs) {
    offsets.push_back(total);
    total += part.bytes;
  }
  const CollectiveScope scope(*engine_, "reduce-scatter", name_, members_, total);
  const int n = world_;
  const size_t shard = shardBytes(total, dtypeSize(dtype), "reduce-scatter");
  total_bytes_ = total;
  // Not an allreduce's signature of the same bytes: n tensors of one shard each.
  const uint64_t signature = callSignature(std::vector<ConstSpan>(n, ConstSpan{nullptr, shard}), dtype);
  uint8_t* out = block_ + nextOutput();
  uint8_t* mine = out + rank_ * shard;
  if (n == 1) {
    forEachSegment(inputs, offsets, 0, shard, [&](size_t i, size_t lo, size_t hi) {
      std::memcpy(mine + lo, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), hi - lo);
    });
    return mine;
  }
  if (right_key_ == 0) throw EngineError("reduce-scatter: called before connect()");
  const double inv = average ? 1.0 / n : 1.0;
  // Pass k moves piece k (a slot's bytes) of every shard: at step s send chunk rank-s-1, receive chunk
  // rank-s-2, so the last step leaves shard `rank` summed here.
  const size_t piece = slot_bytes_;
  auto chunk = [&](int c, size_t p0) {
    const size_t at = static_cast<size_t>((c % n + n) % n) * shard;
    return ChunkRange{at + p0, at + std::min(shard, p0 + piece)};
  };
  for (size_t p0 = 0; p0 == 0 || p0 < shard; p0 += piece) {
    for (int s = 0; s < n - 1; ++s) {
      const ChunkRange send = chunk(rank_ - s - 1, p0), recv = chunk(rank_ - s - 2, p0);
      reduceScatterStep(inputs, offsets, send.lo, send.hi, s == 0, recv.lo, recv.hi, out, dtype,
                        s == n - 2 ? inv : 1.0, p0 == 0 && s == 0 ? signature : 0);
    }
  }
  return mine;
}

uint8_t* RingAllreduce::allgather(ConstSpan shard_in) {
  const CollectiveScope scope(*engine_, "allgather", name_, members_, shard_in.bytes * world_);
  const int n = world_;
  const size_t shard = shard_in.bytes;
  shardBytes(shard * n, 1, "allgather");
  total_bytes_ = shard * n;
  const size_t region = nextOutput();
  uint8_t* out = block_ + region;
  if (shard && out + rank_ * shard != shard_in.data) std::memcpy(out + rank_ * shard, shard_in.data, shard);
  if (n == 1) return out;
  if (right_key_ == 0) throw EngineError("allgather: called before connect()");
  Transport& t = engine_->transport();
  const uint64_t call = ++allgathers_;
  // The left member may write into this block from now on; the right one into ours once it says so.
  t.writeFlag(left_, left_key_, offReady(), call, engine_->deadline());
  engine_->waitFlag(block_ + offReady(), call, right_, "allgather: the right member to enter the call");
  const uint64_t signature =
      callSignature(std::vector<ConstSpan>(n, ConstSpan{nullptr, shard}), DType::kFloat64);
  t.writeFlag(right_, right_key_, offGatherSignature(), signature, engine_->deadline());
  const size_t piece = slot_bytes_;
  bool checked = false;
  for (size_t p0 = 0; p0 == 0 || p0 < shard; p0 += piece) {
    // At step s send the complete shard rank-s (its piece), receive shard rank-s-1 from the left.
    for (int s = 0; s < n - 1; ++s) {
      const size_t send = static_cast<size_t>((rank_ - s + n) % n) * shard;
      const size_t len = std::min(shard, p0 + piece) - std::min(shard, p0);
      allgatherStep(out, region, send + p0, send + p0 + len);
      if (!checked && loadAcquire(block_ + offGatherSignature()) != signature) {
        const std::string why =
            strCat("allgather: rank ", left_, " passed another shard size than this rank (rank ",
                   engine_->rank(), ": ", shard, " bytes); every member must pass the same");
        engine_->reportOwnFailure(why);
        throw EngineError(why);
      }
      checked = true;
      engine_->countReceived(len);  // the left member's piece of shard rank-s-1
    }
  }
  return out;
}

}  // namespace rdkeras
