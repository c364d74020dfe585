// shm: one-sided access between processes on one host.
//
// Each process's Arena is a memfd; at connect() the peers authenticate over an
// abstract unix socket (engine/handshake.h), swap arena fds (SCM_RIGHTS; no
// file anywhere) and map each other's arenas. A remote write is then one memcpy into the peer's mapping --
// the intra-host equivalent of an RDMA WRITE: the target's CPU does nothing. Regions outside the arena are
// reached with CMA (process_vm_writev/readv). The unix socket stays open only to detect a dead peer (EOF on
// exit). No background threads; all checks run in the caller.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/arena.h"
#include "engine/transport.h"

namespace rdkeras {

class ShmTransport : public Transport {
 public:
  ShmTransport(int rank, int world_size, Arena& arena, const TransportOptions& options);
  ~ShmTransport() override;

  const char* name() const override { return "shm"; }
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
  void shutdown() override;

 private:
  struct Peer {
    int sock = -1;
    pid_t pid = 0;
    ArenaMapping arena;
    bool dead = false;
  };
  Peer& live(int peer);
  // Resolves (key, offset, length) against the peer's table.
  RegionInfo resolve(const char* op, int peer, uint64_t key, uint64_t offset, size_t length);
  void cma(bool write, int peer, void* local, uint64_t remote_addr, size_t length);
  // Takes an authenticated socket and the peer's arena fd (closing both on failure).
  void addPeer(int peer, int sock, int arena_fd);

  int rank_;
  int world_size_;
  Arena& arena_;
  TransportOptions options_;
  int listen_fd_ = -1;
  std::string socket_name_;
  std::vector<std::unique_ptr<Peer>> peers_;
};

}  // namespace rdkeras
