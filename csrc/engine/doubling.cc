#include "engine/doubling.h"

#include <cstring>

#include "engine/copy.h"

namespace rdkeras {

namespace {

int largestPowerOfTwo(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

int log2Of(int power) {
  int k = 0;
  while ((1 << k) < power) ++k;
  return k;
}

}  // namespace

DoublingAllreduce::DoublingAllreduce(std::shared_ptr<Engine> engine, size_t capacity_bytes,
                                     std::vector<int> members)
    : CollectiveGroup(std::move(engine), capacity_bytes, std::move(members)),
      position_(positionOf(members_, engine_->rank())),
      power_(largestPowerOfTwo(world_)),
      steps_(log2Of(power_)),
      acked_by_(steps_ + 1, -1) {
  registered_ = std::make_unique<RegisteredBlock>(engine_->tracker(), offAck(steps_ + 1));
  block_ = registered_->data();
}

DoublingAllreduce::~DoublingAllreduce() {
  // A partner acks each message once it has read it: until then this rank's message may be read from its
  // block.
  if (calls_ == 0) return;
  for (int step = 0; step <= steps_; ++step)
    if (acked_by_[step] >= 0) engine_->settleFlag(block_ + offAck(step), calls_, acked_by_[step]);
}

std::string DoublingAllreduce::localDescriptor() const {
  return strCat("doubling;rank=", engine_->rank(), ";key=", registered_->key(), ";capacity=", capacity_);
}

void DoublingAllreduce::connect(const std::vector<std::string>& descriptors) {
  if (descriptors.size() != members_.size())
    throw EngineError(
        strCat("allreduce: ", descriptors.size(), " descriptors for ", members_.size(), " members"));
  keys_.assign(descriptors.size(), 0);
  const std::vector<int> needed = partners();
  for (size_t p = 0; p < descriptors.size(); ++p) {
    const std::string& d = descriptors[p];
    if (d.empty()) {  // not a partner of this member's: never written to
      if (std::find(needed.begin(), needed.end(), static_cast<int>(p)) != needed.end())
        throw EngineError(strCat("allreduce: no descriptor for partner rank ", members_[p]));
      continue;
    }
    if (fieldNumber(d, "rank") != static_cast<uint64_t>(members_[p]))
      throw EngineError(strCat("allreduce: descriptor ", p, " is rank ", field(d, "rank"), "'s, not rank ",
                               members_[p], "'s"));
    if (fieldNumber(d, "capacity") != capacity_)
      throw EngineError(strCat("allreduce: rank ", field(d, "rank"), " declared another capacity (", d,
                               ") than this rank (", localDescriptor(), ")"));
    keys_[p] = fieldNumber(d, "key");
  }
}

std::vector<int> DoublingAllreduce::partners() const {
  std::vector<int> out;
  if (position_ >= power_) return {position_ - power_};
  if (position_ + power_ < world_) out.push_back(position_ + power_);
  for (int k = 0; k < steps_; ++k) out.push_back(position_ ^ (1 << k));
  return out;
}

void DoublingAllreduce::send(int peer, int step, const std::vector<ConstSpan>& inputs,
                             const std::vector<size_t>& offsets, const uint8_t* out, size_t total,
                             uint64_t signature) {
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  const int rank = members_[peer], parity = static_cast<int>(calls_ % 2);
  const uint64_t key = keys_[peer];
  t.writeFlag(rank, key, offSignature(step, parity), signature, deadline);
  if (out == nullptr) {
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      t.write(rank, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), key,
              offSlot(step, parity) + lo, hi - lo, deadline);
    });
  } else if (total > 0) {
    t.write(rank, out, key, offSlot(step, parity), total, deadline);
  }
  t.writeFlag(rank, key, offFlag(step, parity), calls_ + 1, deadline);
  acked_by_[step] = rank;
}

const uint8_t* DoublingAllreduce::receive(int peer, int step, uint64_t signature, size_t total,
                                          const std::vector<ConstSpan>& inputs, DType dtype) {
  const int rank = members_[peer], parity = static_cast<int>(calls_ % 2);
  engine_->waitFlag(block_ + offFlag(step, parity), calls_ + 1, rank,
                    "allreduce: a partial sum from a partner");
  if (loadAcquire(block_ + offSignature(step, parity)) != signature) {
    size_t bytes = 0;
    for (const auto& in : inputs) bytes += in.bytes;
    const std::string why =
        strCat("allreduce: rank ", rank, " passed other tensors than this rank (rank ", engine_->rank(), ": ",
               inputs.size(), " tensors, ", bytes, " bytes of ", dtypeName(dtype),
               "); every member must pass the same sizes and dtype, in the same order");
    engine_->reportOwnFailure(why);
    throw EngineError(why);
  }
  engine_->countReceived(total);
  return block_ + offSlot(step, parity);
}

AllreduceResult DoublingAllreduce::run(const std::vector<ConstSpan>& inputs, DType dtype, bool average) {
  const CollectiveScope scope(*engine_, "allreduce", name_, members_, inputBytes(inputs));
  size_t total;
  std::vector<size_t> offsets = ringLayoutWithin(inputs, capacity_, "group", &total);
  const uint64_t signature = callSignature(inputs, dtype);
  const int parity = static_cast<int>(calls_ % 2);
  uint8_t* out = block_ + parity * capacity_;
  if (world_ > 1 && keys_.empty()) throw EngineError("allreduce: run() before connect()");
  Transport& t = engine_->transport();
  const size_t nt = engine_->transportOptions().nt_threshold;
  const double last_scale = average ? 1.0 / world_ : 1.0;
  auto addInputs = [&](const uint8_t* other, double scale) {  // out = inputs + other, tensor by tensor
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      addInto(dtype, out + lo, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), other + lo,
              hi - lo, scale, nt);
    });
  };
  auto ack = [&](int peer, int step) {
    t.writeFlag(members_[peer], keys_[peer], offAck(step), calls_ + 1, engine_->deadline());
  };
  const int fold = steps_;    // the step index of the fold in and back
  if (position_ >= power_) {  // hand the inputs over, get the sum back straight into this call's output block
    const int core = position_ - power_;
    send(core, fold, inputs, offsets, nullptr, total, signature);
    receive(core, fold, signature, total, inputs, dtype);
    ack(core, fold);
    ++calls_;
    return {out, std::move(offsets)};
  }
  bool from_inputs = true;  // `out` holds nothing yet: the partial sum is the inputs themselves
  if (position_ + power_ < world_) {
    const int extra = position_ + power_;
    const uint8_t* theirs = receive(extra, fold, signature, total, inputs, dtype);
    addInputs(theirs, steps_ == 0 ? last_scale : 1.0);
    ack(extra, fold);
    from_inputs = false;
  }
  for (int k = 0; k < steps_; ++k) {
    const int partner = position_ ^ (1 << k);
    send(partner, k, inputs, offsets, from_inputs ? nullptr : out, total, signature);
    const uint8_t* theirs = receive(partner, k, signature, total, inputs, dtype);
    const double scale = k == steps_ - 1 ? last_scale : 1.0;
    if (from_inputs) {
      addInputs(theirs, scale);
    } else {
      forEachSegment(inputs, offsets, 0, total, [&](size_t, size_t lo, size_t hi) {
        addInto(dtype, out + lo, out + lo, theirs + lo, hi - lo, scale, nt);
      });
    }
    ack(partner, k);
    from_inputs = false;
  }
  if (world_ == 1) {
    forEachSegment(inputs, offsets, 0, total, [&](size_t i, size_t lo, size_t hi) {
      std::memcpy(out + lo, static_cast<const uint8_t*>(inputs[i].data) + (lo - offsets[i]), hi - lo);
    });
  }
  if (position_ + power_ < world_) {  // the sum back to the member folded in, into its output block
    const int extra = position_ + power_;
    if (total > 0)
      t.write(members_[extra], out, keys_[extra], parity * capacity_, total, engine_->deadline());
    t.writeFlag(members_[extra], keys_[extra], offSignature(fold, parity), signature, engine_->deadline());
    t.writeFlag(members_[extra], keys_[extra], offFlag(fold, parity), calls_ + 1, engine_->deadline());
    acked_by_[fold] = members_[extra];
  }
  ++calls_;
  return {out, std::move(offsets)};
}

}  // namespace rdkeras
