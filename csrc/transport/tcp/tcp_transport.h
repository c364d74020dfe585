// tcp: the one-sided semantics of the engine over plain TCP sockets.
//
// Each ordered pair (initiator -> target) has its own socket. The initiator's
// thread sends a fixed header (op, id, key, offset, length) and, for a write,
// the payload straight from the caller's buffer (sendmsg, no copy). On the
// target a progress thread per socket checks the key and bounds against the
// local region table and recv()s the payload straight into the registered
// region: no serialization and no intermediate buffer. Reads are answered on
// the same socket; the initiator's progress thread receives the payload
// straight into the caller's destination. One socket per direction means a
// progress thread never waits on its own peer's progress thread.
//
// Threads: two per peer (serve the peer's requests; receive replies to ours).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/arena.h"
#include "engine/transport.h"

namespace rdkeras {

class TcpTransport : public Transport {
 public:
  TcpTransport(int rank, int world_size, Arena& arena, const TransportOptions& options);
  ~TcpTransport() override;

  const char* name() const override { return "tcp"; }
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
  void shutdown() override;

 private:
  struct PendingRead {
    void* dst;
    uint64_t length;
    std::atomic<int> state{0};  // 0 waiting, 1 done, 2 failed
    bool busy = false;          // the reply thread is receiving into dst (guarded by Peer::mu)
    std::string error;
  };
  struct Peer {
    int out_fd = -1;  // our requests to the peer, its replies to us
    int in_fd = -1;   // the peer's requests to us, our replies
    std::mutex send_mu;
    std::mutex mu;  // guards pending, error, dead_reason
    std::map<uint64_t, std::shared_ptr<PendingRead>> pending;
    std::string async_error;  // reported by the target, raised on the next call
    std::atomic<bool> dead{false};
    std::string dead_reason;
    std::atomic<uint64_t> fences_acked{0};
    std::atomic<int64_t> last_heard_ns{0};  // a request or a reply from the peer arrived (steady clock)
    uint64_t next_id = 1;
    std::thread serve_thread, reply_thread;
  };

  Peer& live(int peer);
  void markDead(int peer, const std::string& why);
  void sendRequest(int peer, uint32_t op, uint64_t id, uint64_t key, uint64_t offset, uint64_t length,
                   const void* payload, size_t payload_len, const Deadline& deadline);
  void serveLoop(int peer);
  void replyLoop(int peer);
  void raisePending(int peer);

  int rank_;
  int world_size_;
  Arena& arena_;
  TransportOptions options_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> closing_{false};
  std::vector<std::unique_ptr<Peer>> peers_;
};

}  // namespace rdkeras
