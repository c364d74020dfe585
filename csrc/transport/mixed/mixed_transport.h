// shm+tcp: one job over several hosts with several ranks on some of them. Each peer is
// reached by exactly one inner transport: shm when it shares this host (it can map our
// memory: the same host identity), tcp otherwise. The choice is made at connect() from
// the peers' descriptors, which carry both inner descriptors; every operation is then
// forwarded to the peer's transport, so semantics, errors and deadlines are theirs.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/arena.h"
#include "engine/transport.h"

namespace rdkeras {

class MixedTransport : public Transport {
 public:
  MixedTransport(int rank, int world_size, Arena& arena, const TransportOptions& options);
  ~MixedTransport() override;

  const char* name() const override { return "shm+tcp"; }
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
  int64_t lastHeardNs(int peer) const override;
  void cutOff(int peer, const std::string& why) override;
  std::vector<std::pair<std::string, const TransportStats*>> parts() const override;
  void shutdown() override;

 private:
  Transport& route(int peer);

  int rank_;
  int world_size_;
  std::unique_ptr<Transport> shm_, tcp_;
  std::vector<Transport*> by_peer_;  // set by connect(); null for this rank
};

}  // namespace rdkeras
