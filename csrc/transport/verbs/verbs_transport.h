// verbs: one-sided access over InfiniBand/RoCE with libibverbs (RC queue pairs).
//
// One RC queue pair per peer, one completion queue, one protection domain.
// Every registration through the TensorTracker becomes an ibv_reg_mr (this
// class is the tracker's MemoryRegistrar, and knows the tracker only as the
// RegisterLocal it calls for an unregistered local buffer: memory_registrar.h)
// and the region table entry carries the MR's rkey. An initiator learns
// (address, length, rkey) of a peer's region by RDMA-reading the entry from the
// peer's region table (the arena header, registered for remote read at start)
// the first time it uses a key; an unknown or stale key is refused right there,
// and bounds are checked against the entry before anything is posted. write =
// RDMA WRITE, read = RDMA READ, writeFlag = an 8-byte RDMA WRITE on the same
// queue pair after the data (RC executes them in order, and each operation here
// waits for its completion). A TCP connection per peer carries nothing after
// setup: its EOF tells that the peer died while we only wait on local memory.
// Operations are serialized by one mutex (post, then poll the CQ to completion).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/arena.h"
#include "engine/memory_registrar.h"
#include "engine/transport.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_lib.h"

namespace rdkeras {

class VerbsTransport : public Transport, public MemoryRegistrar {
 public:
  VerbsTransport(int rank, int world_size, Arena& arena, const TransportOptions& options,
                 RegisterLocal register_local);
  ~VerbsTransport() override;

  // Empty when verbs can work here; otherwise why not.
  static std::string whyNotViable();

  const char* name() const override { return "verbs"; }
  std::string localDescriptor() const override;
  void connect(const std::vector<std::string>& descriptors, const std::string& key,
               const Deadline& deadline) override;
  void write(int peer, const void* src, uint64_t key, uint64_t offset, size_t length,
             const Deadline& deadline) override;
  void read(int peer, void* dst, uint64_t key, uint64_t offset, size_t length,
            const Deadline& deadline) override;
  void writeFlag(int peer, uint64_t key, uint64_t offset, uint64_t value, const Deadline& deadline) override;
  void flush(int peer, const Deadline& deadline) override;
  void checkPeer(int peer) override;
  bool needsLocalRegistration() const override { return true; }
  void shutdown() override;

  uint64_t registerMemory(const void* p, size_t n) override;
  void deregisterMemory(uint64_t rkey) override;

 private:
  struct Peer {
    struct ibv_qp* qp = nullptr;
    int sock = -1;
    bool dead = false;
    std::string why;
    uint64_t arena_base = 0, header_rkey = 0;
    std::unordered_map<uint64_t, RegionInfo> regions;  // key -> entry read from the peer
  };
  Peer& live(int peer);
  void fail(int peer, const std::string& why);
  uint32_t lkey(const void* p, size_t n);
  RegionInfo remoteRegion(const char* op, int peer, uint64_t key, uint64_t offset, size_t length,
                          const Deadline& deadline);
  uint64_t remoteAddress(int peer, const RegionInfo& info, uint64_t offset) const;
  // Posts one signaled work request and waits for its completion.
  void post(int peer, enum ibv_wr_opcode opcode, void* local, uint32_t lkey, size_t length, uint64_t raddr,
            uint32_t rkey, const Deadline& deadline);
  void modify(struct ibv_qp* qp, struct ibv_qp_attr& attr, int mask, const char* state);

  int rank_, world_size_;
  Arena& arena_;
  TransportOptions options_;
  RegisterLocal register_local_;
  const VerbsLib* lib_;
  VerbsDevice device_;  // closed by the destructor
  struct ibv_pd* pd_ = nullptr;
  struct ibv_cq* cq_ = nullptr;
  struct ibv_mr* header_mr_ = nullptr;
  std::unique_ptr<uint8_t[]> scratch_;  // flag values and table entries, registered
  struct ibv_mr* scratch_mr_ = nullptr;
  std::vector<Peer> peers_;
  std::vector<uint32_t> psn_;
  int listen_fd_ = -1, listen_port_ = 0;
  std::mutex op_mu_;  // one operation in flight
  std::mutex mr_mu_;
  std::map<std::pair<uintptr_t, uint32_t>, struct ibv_mr*> mrs_;  // (start, rkey) -> MR
  uint64_t next_wr_ = 1;
};

}  // namespace rdkeras
