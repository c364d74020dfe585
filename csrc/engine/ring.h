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
#include <utility>
#include <vector>

#include "engine/collectives.h"

namespace rdkeras {

// Pure arithmetic of the ring, shared by run() and the unit tests.
// Bytes [lo, hi) of chunk c (taken modulo n) when bucket [b0, b1) is split over n ranks:
// 64-byte aligned, in order, the last chunks possibly short or empty.
struct ChunkRange {
  size_t lo, hi;
};
ChunkRange ringChunk(size_t b0, size_t b1, int n, int c);

class RingAllreduce : public CollectiveGroup {
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

  // The two halves of run() on their own, over one flat buffer of size() shards of equal bytes (a multiple
  // of 64), member p owning shard p -- the layout sharded optimizers keep.
  // reduceScatter: this member's shard of the sum (mean) of every member's `input`, in the next output block;
  // the input may come in consecutive parts (read where they lie: no copy into one buffer first).
  uint8_t* reduceScatter(const std::vector<ConstSpan>& parts, DType dtype, bool average);
  uint8_t* reduceScatter(ConstSpan input, DType dtype, bool average) {
    return reduceScatter(std::vector<ConstSpan>{input}, dtype, average);
  }
  // allgather: every member's `shard` (same bytes everywhere), in member order, in the next output block.
  // The left member writes into this one's block only once this one has entered the call (a flag each call).
  uint8_t* allgather(ConstSpan shard);

 private:
  void reduceScatterStep(const std::vector<ConstSpan>& inputs, const std::vector<size_t>& offsets,
                         size_t send_begin, size_t send_end, bool send_from_inputs, size_t recv_begin,
                         size_t recv_end, uint8_t* out, DType dtype, double scale, uint64_t signature);
  void allgatherStep(uint8_t* out, size_t out_offset_in_region, size_t send_begin, size_t send_end);
  // The next output block: its offset in the registered block (they alternate call by call).
  size_t nextOutput() { return (calls_++ % 2) * capacity_; }
  // Shard size of a flat buffer of `bytes` over the members, checked (capacity, alignment, dtype).
  size_t shardBytes(size_t bytes, size_t item, const char* what) const;

  int rank_, left_, right_;  // rank_: position among members_; left_/right_: engine ranks
  size_t bucket_bytes_, slot_bytes_;
  // One registered block: [out 0 | out 1 | slot 0 | slot 1 | flag 0 | flag 1 | ack | gather flag |
  //                        signature 0 | signature 1 | ready | allgather signature]
  std::unique_ptr<RegisteredBlock> registered_;
  uint8_t* block_ = nullptr;  // registered_->data()
  uint64_t right_key_ = 0, left_key_ = 0;
  uint64_t messages_ = 0;  // reduce-scatter messages sent (= received) so far
  uint64_t gathers_ = 0;   // allgather chunks received so far
  uint64_t calls_ = 0;
  uint64_t allgathers_ = 0;   // allgather() calls so far (the ready flag counts them)
  uint64_t total_bytes_ = 0;  // of the current call (for error messages)
  size_t offSlot(int i) const { return 2 * capacity_ + i * slot_bytes_; }
  size_t offFlag(int i) const { return 2 * capacity_ + 2 * slot_bytes_ + i * 64; }
  size_t offAck() const { return offFlag(2); }
  size_t offGather() const { return offFlag(3); }
  // The left member's call signature, one per slot: it comes with the call's first message, and a slot is
  // written again only once this member acked what it held.
  size_t offSignature(int slot) const { return offFlag(4 + slot); }
  size_t offReady() const { return offFlag(6); }            // the right member entered allgather() #n
  size_t offGatherSignature() const { return offFlag(7); }  // the left member's allgather() signature
  size_t registeredBytes() const { return offFlag(8); }
};

}  // namespace rdkeras
