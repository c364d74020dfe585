#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/collectives.h"

namespace rdkeras {

// DoublingAllreduce: the latency-optimal sum for small tensors. Recursive doubling: at step k every member
// swaps its whole partial sum with the member 2^k positions away (position XOR 2^k) and adds -- log2(N)
// messages where the ring sends 2(N-1), each of all the bytes where the ring's carry 1/N. With N not a power
// of two, the members beyond the largest power P first hand their inputs to the member P positions before
// them and get the sum back at the end (two more messages). Both partners of a step add the same two operands
// (a + b == b + a in IEEE arithmetic), so every member ends with the same bits, as with the ring.
//
// Each step's message lands in a registered slot of the partner's (two per step, alternating per call: a
// partner writes a slot again only after it heard from this rank in the next call, by which time this rank
// read it); the inputs are read in place; the outputs alternate between two blocks as the ring's do.
class DoublingAllreduce : public CollectiveGroup {
 public:
  DoublingAllreduce(std::shared_ptr<Engine> engine, size_t capacity_bytes, std::vector<int> members = {});
  // Waits (a few seconds at most) for the acks of this rank's last messages, which are read from its block.
  ~DoublingAllreduce();
  DoublingAllreduce(const DoublingAllreduce&) = delete;
  DoublingAllreduce& operator=(const DoublingAllreduce&) = delete;

  std::string localDescriptor() const;
  // The members' descriptors, in the members' order ("" for a member that is not one of partners()).
  void connect(const std::vector<std::string>& descriptors);
  AllreduceResult run(const std::vector<ConstSpan>& inputs, DType dtype, bool average);

  // The member positions this one exchanges with, in order (the fold-in partner first where it has one).
  std::vector<int> partners() const;

 private:
  // Sends [begin, end) of the padded layout (from the inputs, or from `out`) to `peer`'s slot of `step`.
  void send(int peer, int step, const std::vector<ConstSpan>& inputs, const std::vector<size_t>& offsets,
            const uint8_t* out, size_t total, uint64_t signature);
  // Waits for `peer`'s message of `step`, checks its signature, acks it; returns the slot.
  const uint8_t* receive(int peer, int step, uint64_t signature, size_t total,
                         const std::vector<ConstSpan>& inputs, DType dtype);

  int position_, power_, steps_;  // power_: the largest power of 2 <= world_; steps_: log2(power_)
  std::unique_ptr<RegisteredBlock> registered_;
  uint8_t* block_ = nullptr;
  std::vector<uint64_t> keys_;  // by member position
  uint64_t calls_ = 0;
  std::vector<int> acked_by_;  // the engine ranks whose acks the destructor waits for, by step (-1: none)
  // Block: [out 0 | out 1 | slots (step, parity) | flags (step, parity) | signatures (step, parity) | acks
  // (step)] with steps_ + 1 steps: the doubling steps, then the fold (in from the member P after, back to
  // it).
  size_t offSlot(int step, int parity) const { return (2 + 2 * step + parity) * capacity_; }
  size_t offFlag(int step, int parity) const {
    return (2 * steps_ + 4) * capacity_ + (2 * step + parity) * 64;
  }
  size_t offSignature(int step, int parity) const { return offFlag(steps_ + 1 + step, parity); }
  size_t offAck(int step) const { return offFlag(2 * steps_ + 2, 0) + step * 64; }
};
}  // namespace rdkeras
