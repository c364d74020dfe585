// RingAllreduce: sums (or averages) a list of tensors across all ranks.
//
// The classic bandwidth-optimal ring: every rank sends to rank+1 and receives
// from rank-1; for each bucket, N-1 reduce-scatter steps then N-1 allgather
// steps, each moving 1/N of the bucket. Reduce-scatter chunks land in a
// registered, double-buffered staging slot on the right neighbour (write, then
// flag; acked one-sidedly like a StaticChannel); the receiver adds them to its
// own input with a vectorized loop straight into its output block. Allgather
// chunks are written by the left neighbour straight into this rank's output
// block -- no staging, no copy on the receiving side.
//
// The inputs are read in place (e.g. TensorFlow's gradient buffers) and never
// concatenated; the outputs are views into one of two registered output
// blocks (alternating per call, so the previous call's results stay intact),
// each tensor starting on a 64-byte boundary. Every rank must pass tensors of
// the same sizes in the same order: each call's first message carries a
// signature of them (dtype, count, sizes), and a rank whose left member's
// differs raises and tells the others. One thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace rdkeras {

// The element types a reduction sums. float16/bfloat16 are wire types: each addition is done in float32 and
// rounded back (to nearest even), as Horovod's Compression.fp16 sums what NCCL hands it.
enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16 };
size_t dtypeSize(DType dtype);
const char* dtypeName(DType dtype);

// float32 <-> a 16-bit wire type (round to nearest even; NaN stays NaN, overflow becomes infinity), the
// way back scaled by `scale`.
void castToWire(const float* src, uint16_t* dst, size_t n, DType wire);
void castFromWire(const uint16_t* src, float* dst, size_t n, DType wire, float scale);

struct ConstSpan {
  const void* data;
  size_t bytes;
};

// What an allreduce returns: tensor i's sum starts at out + offsets[i] (64-byte aligned), in registered
// memory that stays intact until the next-but-one call.
struct AllreduceResult {
  uint8_t* out;
  std::vector<size_t> offsets;
};

// Registered memory an allreduce reads a wire-typed copy of its inputs from: `bytes` (its capacity),
// registered on first use and kept (a one-sided write from it may still be in flight when a call returns).
class WireScratch {
 public:
  WireScratch(TensorTracker& tracker, size_t bytes) : tracker_(tracker), bytes_(bytes) {}
  uint8_t* get(size_t bytes);

 private:
  TensorTracker& tracker_;
  size_t bytes_;
  std::unique_ptr<RegisteredBlock> block_;
};

// Runs `reduce` over `inputs` (float32) cast to `wire`, and casts the sums back into `outputs` (one float32
// buffer per input, as large), scaled by `scale`. The inputs' copies are laid out as the reduction lays out
// its inputs, in `scratch`.
void allreduceOnWire(const std::vector<ConstSpan>& inputs, const std::vector<float*>& outputs, DType wire,
                     float scale, WireScratch& scratch,
                     const std::function<AllreduceResult(const std::vector<ConstSpan>&)>& reduce);

// Pure arithmetic of the ring, shared by run() and the unit tests.
// Where each tensor starts in a ring's output block (64-byte aligned); *total is the padded size.
std::vector<size_t> ringLayout(const std::vector<ConstSpan>& inputs, size_t* total);
// Bytes [lo, hi) of chunk c (taken modulo n) when bucket [b0, b1) is split over n ranks:
// 64-byte aligned, in order, the last chunks possibly short or empty.
struct ChunkRange {
  size_t lo, hi;
};
ChunkRange ringChunk(size_t b0, size_t b1, int n, int c);

class RingAllreduce {
 public:
  // capacity_bytes: the largest total (with 64-byte padding per tensor) a call may
  // reduce; bucket_bytes: how much one ring pass moves; members: the engine ranks
  // in ring order (empty: all of them), this rank among them.
  RingAllreduce(std::shared_ptr<Engine> engine, size_t capacity_bytes, size_t bucket_bytes,
                std::vector<int> members = {});
  // Waits (a few seconds at most) for the right member's ack of the last chunk this rank sent: a
  // one-sided write into this ring's block, which must stay registered until it landed.
  ~RingAllreduce();
  RingAllreduce(const RingAllreduce&) = delete;
  RingAllreduce& operator=(const RingAllreduce&) = delete;

  std::string localDescriptor() const;
  // Descriptors of the left (whom we ack) and right (whom we write to) members.
  void connect(const std::string& left, const std::string& right);

  using Result = AllreduceResult;
  // Between its reduce-scatter and its allgather, a pass may hand the chunk this rank then holds summed
  // (bytes of the output block, padding included) to a hook that changes it in place: the hierarchical
  // allreduce sums it across hosts there.
  using ChunkHook = std::function<void(uint8_t* chunk, size_t bytes)>;
  // Reduces `inputs` (all of one dtype) into the next output block. With
  // `average`, the sum is divided by the number of members.
  Result run(const std::vector<ConstSpan>& inputs, DType dtype, bool average,
             const ChunkHook& between = nullptr);

  size_t capacity() const { return capacity_; }
  int size() const { return world_; }
  const std::shared_ptr<Engine>& engine() const { return engine_; }
  WireScratch& wireScratch() { return scratch_; }

 private:
  void reduceScatterStep(const std::vector<ConstSpan>& inputs, const std::vector<size_t>& offsets,
                         size_t send_begin, size_t send_end, bool send_from_inputs, size_t recv_begin,
                         size_t recv_end, uint8_t* out, DType dtype, double scale, uint64_t signature);
  void allgatherStep(uint8_t* out, size_t out_offset_in_region, size_t send_begin, size_t send_end);

  std::shared_ptr<Engine> engine_;
  std::vector<int> members_;
  int rank_, world_, left_,
      right_;  // rank_/world_: position among / count of members_; left_/right_: engine ranks
  size_t capacity_, bucket_bytes_, slot_bytes_;
  // One registered block: [out 0 | out 1 | slot 0 | slot 1 | flag 0 | flag 1 | ack | gather flag]
  std::unique_ptr<RegisteredBlock> registered_;
  uint8_t* block_ = nullptr;  // registered_->data()
  uint64_t right_key_ = 0, left_key_ = 0;
  uint64_t messages_ = 0;  // reduce-scatter messages sent (= received) so far
  uint64_t gathers_ = 0;   // allgather chunks received so far
  uint64_t calls_ = 0;
  uint64_t total_bytes_ = 0;  // of the current call (for error messages)
  size_t offSlot(int i) const { return 2 * capacity_ + i * slot_bytes_; }
  size_t offFlag(int i) const { return 2 * capacity_ + 2 * slot_bytes_ + i * 64; }
  size_t offAck() const { return offFlag(2); }
  size_t offGather() const { return offFlag(3); }
  size_t offSignature() const { return offFlag(4); }  // the left member's call signature
  WireScratch scratch_;
};

// What every member of an allreduce must agree on: dtype, count and sizes (FNV-1a; never 0).
uint64_t callSignature(const std::vector<ConstSpan>& inputs, DType dtype);

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
class DoublingAllreduce {
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

  size_t capacity() const { return capacity_; }
  int size() const { return world_; }
  const std::shared_ptr<Engine>& engine() const { return engine_; }
  WireScratch& wireScratch() { return scratch_; }
  // The member positions this one exchanges with, in order (the fold-in partner first where it has one).
  std::vector<int> partners() const;

 private:
  // Sends [begin, end) of the padded layout (from the inputs, or from `out`) to `peer`'s slot of `step`.
  void send(int peer, int step, const std::vector<ConstSpan>& inputs, const std::vector<size_t>& offsets,
            const uint8_t* out, size_t total, uint64_t signature);
  // Waits for `peer`'s message of `step`, checks its signature, acks it; returns the slot.
  const uint8_t* receive(int peer, int step, uint64_t signature, size_t total,
                         const std::vector<ConstSpan>& inputs, DType dtype);

  std::shared_ptr<Engine> engine_;
  std::vector<int> members_;
  int position_, world_, power_, steps_;  // power_: the largest power of 2 <= world_; steps_: log2(power_)
  size_t capacity_;
  std::unique_ptr<RegisteredBlock> registered_;
  uint8_t* block_ = nullptr;
  std::vector<uint64_t> keys_;  // by member position
  uint64_t calls_ = 0;
  std::vector<int> acked_by_;  // the engine ranks whose acks the destructor waits for, by step (-1: none)
  WireScratch scratch_;
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

// The sum over hosts: `inside` (this host's members, in the same order on every host) reduce-scatters each
// pass, `across` (the members at this rank's position on every host, which hold the same chunk) sums that
// chunk across hosts, and `inside` allgathers the result -- every host's links busy at once, each host
// sending 2(H-1)/H of the bytes between hosts. With `average`, divided by `world` (every rank). Returns
// `inside`'s output; every rank ends with the same bits. With `wire` a 16-bit type (inputs float32), the
// shards cross hosts as `wire`: half the bytes on the slow links, summed in float32 at every hop.
RingAllreduce::Result hierarchicalAllreduce(RingAllreduce& inside, RingAllreduce& across,
                                            const std::vector<ConstSpan>& inputs, DType dtype, bool average,
                                            int world, DType wire);

}  // namespace rdkeras
