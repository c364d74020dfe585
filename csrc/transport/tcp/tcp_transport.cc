#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/handshake.h"
#include "engine/socket_util.h"

namespace rdkeras {
namespace {

enum Op : uint32_t {
  kWrite = 1,  // payload follows
  kFlag = 2,   // length field carries the value
  kReadReq = 3,
  kFence = 4,
  kReadResp = 5,  // payload follows
  kFenceAck = 6,
  kError = 7,  // length bytes of message follow; id names the failed op
};

struct Header {
  uint32_t op;
  uint32_t reserved;
  uint64_t id;
  uint64_t key;
  uint64_t offset;
  uint64_t length;
};

// The handshake's channel number says which way requests flow on a socket.
constexpr uint32_t kRoleInitiator = 0;  // the connector sends requests on this socket
constexpr uint32_t kRoleTarget = 1;     // the acceptor sends requests on this socket

// A target's error report is one short message; anything longer is a protocol error.
constexpr uint64_t kMaxErrorBytes = 4096;
// Background threads reply with this deadline; a dead initiator ends them sooner (EPIPE).
constexpr double kReplyTimeoutS = 600;

void tuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setSocketBuffers(fd, 8 << 20);
}

}  // namespace

TcpTransport::TcpTransport(int rank, int world_size, Arena& arena, const TransportOptions& options)
    : rank_(rank), world_size_(world_size), arena_(arena), options_(options) {
  listen_fd_ = listenTcp(options_.bind_host, &port_);
  for (int r = 0; r < world_size; ++r) peers_.push_back(std::make_unique<Peer>());
}

TcpTransport::~TcpTransport() { shutdown(); }

std::string TcpTransport::localDescriptor() const {
  return strCat("tcp;host=", options_.advertise_host, ";port=", port_);
}

void TcpTransport::connect(const std::vector<std::string>& descriptors, const std::string& key,
                           const Deadline& deadline) {
  if (static_cast<int>(descriptors.size()) != world_size_)
    throw EngineError("tcp: need one descriptor per rank");
  const HandshakeIdentity id{Link::kTcp, rank_, world_size_, key, setup_watch_};
  auto mine = [&](int r) { return r != rank_ && !descriptors[r].empty(); };  // empty: not tcp's peer
  // Rank r connects to ranks below it (two sockets each), then accepts from ranks above.
  for (int r = 0; r < rank_; ++r) {
    if (!mine(r)) continue;
    const std::string host = field(descriptors[r], "host"), port = field(descriptors[r], "port");
    for (uint32_t role : {kRoleInitiator, kRoleTarget}) {
      const int fd = connectAuthenticated(
          [&] {
            const int fd = connectTcp(host, port, deadline, r);
            tuneSocket(fd);
            return fd;
          },
          id, r, role, deadline);
      (role == kRoleInitiator ? peers_[r]->out_fd : peers_[r]->in_fd) = fd;
    }
  }
  auto slot = [&](int rank, uint32_t role) -> int& {
    return role == kRoleInitiator ? peers_[rank]->in_fd : peers_[rank]->out_fd;
  };
  acceptAuthenticated(
      listen_fd_, id, deadline,
      [&] {
        std::vector<int> left;
        for (int r = rank_ + 1; r < world_size_; ++r)
          if (mine(r) && (peers_[r]->in_fd < 0 || peers_[r]->out_fd < 0)) left.push_back(r);
        return left;
      },
      [&](int rank, uint32_t role) {
        return rank > rank_ && mine(rank) && (role == kRoleInitiator || role == kRoleTarget) &&
               slot(rank, role) < 0;
      },
      [&](int fd, int rank, uint32_t role, int) {
        tuneSocket(fd);
        slot(rank, role) = fd;
      });
  closeFd(listen_fd_);
  for (int r = 0; r < world_size_; ++r) {
    if (!mine(r)) continue;
    peers_[r]->serve_thread = std::thread(&TcpTransport::serveLoop, this, r);
    peers_[r]->reply_thread = std::thread(&TcpTransport::replyLoop, this, r);
  }
}

void TcpTransport::markDead(int peer, const std::string& why) {
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lock(p.mu);
  if (!p.dead.exchange(true)) p.dead_reason = why;
  for (auto& [id, pending] : p.pending) {
    if (pending->busy) continue;  // the reply thread settles it
    int expected = 0;
    if (pending->state.compare_exchange_strong(expected, 2)) pending->error = p.dead_reason;
  }
  localWakeup().notify();
}

namespace {
int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}
}  // namespace

int64_t TcpTransport::lastHeardNs(int peer) const {
  if (peer < 0 || peer >= world_size_ || peer == rank_ || !peers_[peer]) return 0;
  return peers_[peer]->last_heard_ns.load(std::memory_order_relaxed);
}

void TcpTransport::cutOff(int peer, const std::string& why) {
  if (peer < 0 || peer >= world_size_ || peer == rank_ || !peers_[peer]) return;
  markDead(peer, why);
  Peer& p = *peers_[peer];
  // Sends blocked on the peer's full socket, and reads waiting for its answer, fail now.
  if (p.out_fd >= 0) ::shutdown(p.out_fd, SHUT_RDWR);
  if (p.in_fd >= 0) ::shutdown(p.in_fd, SHUT_RDWR);
}

void TcpTransport::checkPeer(int peer) {
  if (peer < 0 || peer >= world_size_ || peer == rank_)
    throw EngineError(strCat("tcp: no connection to rank ", peer));
  Peer& p = *peers_[peer];
  if (p.dead.load()) {
    std::lock_guard<std::mutex> lock(p.mu);
    throw PeerError(strCat("rank ", peer, ": ", p.dead_reason), peer);
  }
}

TcpTransport::Peer& TcpTransport::live(int peer) {
  checkPeer(peer);
  Peer& p = *peers_[peer];
  if (p.out_fd < 0) throw EngineError(strCat("tcp: not connected to rank ", peer));
  return p;
}

void TcpTransport::raisePending(int peer) {
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lock(p.mu);
  if (!p.async_error.empty()) {
    std::string e;
    e.swap(p.async_error);
    throw RemoteAccessError(e);
  }
}

void TcpTransport::sendRequest(int peer, uint32_t op, uint64_t id, uint64_t key, uint64_t offset,
                               uint64_t length, const void* payload, size_t payload_len,
                               const Deadline& deadline) {
  Peer& p = live(peer);
  raisePending(peer);
  Header h = {op, 0, id, key, offset, length};
  struct iovec iov[2] = {{&h, sizeof(h)}, {const_cast<void*>(payload), payload_len}};
  std::lock_guard<std::mutex> lock(p.send_mu);
  try {
    sendAll(p.out_fd, iov, payload_len ? 2 : 1, deadline, strCat("rank ", peer));
  } catch (const PeerError&) {
    markDead(peer, "connection lost (process exited?)");
    checkPeer(peer);  // throws, naming the rank
    throw;
  }
}

void TcpTransport::write(int peer, const void* src, uint64_t key, uint64_t offset, size_t length,
                         const Deadline& deadline) {
  sendRequest(peer, kWrite, 0, key, offset, length, src, length, deadline);
  countWrite(length);
}

void TcpTransport::writeFlag(int peer, uint64_t key, uint64_t offset, uint64_t value,
                             const Deadline& deadline) {
  checkFlagOffset(offset);
  sendRequest(peer, kFlag, 0, key, offset, value, nullptr, 0, deadline);
  countFlag();
}

void TcpTransport::read(int peer, void* dst, uint64_t key, uint64_t offset, size_t length,
                        const Deadline& deadline) {
  Peer& p = live(peer);
  auto pending = std::make_shared<PendingRead>();
  pending->dst = dst;
  pending->length = length;
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    id = p.next_id++;
    p.pending[id] = pending;
  }
  auto forget = [&] {
    std::lock_guard<std::mutex> lock(p.mu);
    p.pending.erase(id);
  };
  try {
    sendRequest(peer, kReadReq, id, key, offset, length, nullptr, 0, deadline);
  } catch (...) {
    forget();
    throw;
  }
  const bool done =
      pollUntil([&] { return pending->state.load(std::memory_order_acquire) != 0; }, deadline, [] {});
  if (!done) {
    // The reply may be landing in dst right now: break the connection and wait
    // until the reply thread has let go of it before the caller frees dst.
    markDead(peer, strCat("a read timed out after ", deadline.seconds(), " s; connection closed"));
    ::shutdown(p.out_fd, SHUT_RDWR);
    while (pending->state.load() == 0) sched_yield();  // set by markDead or the reply thread
    forget();
    throw TimeoutError(strCat("tcp: timed out after ", deadline.seconds(), " s waiting for rank ", peer,
                              " to answer a read of ", length, " bytes"));
  }
  forget();
  if (pending->state.load() == 2) {
    if (p.dead.load()) throw PeerError(strCat("rank ", peer, ": ", pending->error), peer);
    throw RemoteAccessError(pending->error);
  }
  countRead(length);
}

void TcpTransport::flush(int peer, const Deadline& deadline) {
  Peer& p = live(peer);
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    id = p.next_id++;
  }
  sendRequest(peer, kFence, id, 0, 0, 0, nullptr, 0, deadline);
  const bool done = pollUntil([&] { return p.fences_acked.load(std::memory_order_acquire) >= id; }, deadline,
                              [&] { checkPeer(peer); });
  if (!done)
    throw TimeoutError(strCat("tcp: timed out after ", deadline.seconds(), " s waiting for rank ", peer,
                              " to complete earlier operations"));
  raisePending(peer);
}

void TcpTransport::serveLoop(int peer) {
  const int fd = peers_[peer]->in_fd;
  std::vector<char> drain;
  auto reply = [&](uint32_t op, uint64_t id, const void* payload, uint64_t len, uint64_t failed_op = 0) {
    Header h = {op, 0, id, 0, failed_op, len};
    struct iovec iov[2] = {{&h, sizeof(h)}, {const_cast<void*>(payload), len}};
    sendAll(fd, iov, len ? 2 : 1, Deadline(kReplyTimeoutS), strCat("rank ", peer));
  };
  try {
    Header h;
    while (recvAll(fd, &h, sizeof(h))) {
      peers_[peer]->last_heard_ns.store(nowNs(), std::memory_order_relaxed);
      const char* op_name = h.op == kWrite ? "write" : h.op == kFlag ? "writeFlag" : "read";
      const uint64_t access_len = h.op == kFlag ? 8 : h.length;
      uint8_t* target = nullptr;
      std::string error;
      if (h.op == kWrite || h.op == kFlag || h.op == kReadReq) {
        RegionInfo info;
        try {
          if (!arena_.table().lookup(h.key, &info)) throwUnknownKey(op_name, rank_, h.key);
          checkBounds(op_name, rank_, h.key, info.length, h.offset, access_len);
          if (h.op == kFlag) {
            checkFlagOffset(h.offset);
            if (info.kind != RegionKind::kArena)  // as shm refuses: a flag is polled in the arena
              throw RemoteAccessError(
                  "writeFlag: flags must live in the arena (allocate them from the engine)");
          }
          target = (info.kind == RegionKind::kArena ? arena_.base() + info.addr
                                                    : reinterpret_cast<uint8_t*>(info.addr)) +
                   h.offset;
        } catch (const RemoteAccessError& e) {
          error = e.what();
        }
      }
      switch (h.op) {
        case kWrite:
          if (target) {
            if (!recvAll(fd, target, h.length)) throw PeerError("eof");
            peers_[peer]->last_heard_ns.store(nowNs(), std::memory_order_relaxed);  // a long payload ended
          } else {
            for (uint64_t left = h.length; left > 0;) {  // discard the payload
              drain.resize(std::min<uint64_t>(left, 1 << 20));
              if (!recvAll(fd, drain.data(), drain.size())) throw PeerError("eof");
              left -= drain.size();
            }
            reply(kError, h.id, error.data(), error.size(), h.op);
          }
          break;
        case kFlag:
          if (target) {
            storeRelease(target, h.length);
            localWakeup().notify();  // the waits for flags are this process's
          } else {
            reply(kError, h.id, error.data(), error.size(), h.op);
          }
          break;
        case kReadReq:
          if (target)
            reply(kReadResp, h.id, target, h.length);
          else
            reply(kError, h.id, error.data(), error.size(), h.op);
          break;
        case kFence:
          reply(kFenceAck, h.id, nullptr, 0);
          break;
        default:
          throw EngineError(strCat("tcp: protocol error from rank ", peer, " (op ", h.op, ")"));
      }
    }
  } catch (const std::exception& e) {
    (void)e;
  }
  if (!closing_.load()) markDead(peer, "closed the connection (process exited?)");
}

void TcpTransport::replyLoop(int peer) {
  Peer& p = *peers_[peer];
  const int fd = p.out_fd;
  std::string why = "closed the connection (process exited?)";
  Header h;
  while (recvAll(fd, &h, sizeof(h))) {
    p.last_heard_ns.store(nowNs(), std::memory_order_relaxed);
    if (h.op == kFenceAck) {
      p.fences_acked.store(h.id, std::memory_order_release);
      localWakeup().notify();
      continue;
    }
    std::shared_ptr<PendingRead> pending;
    {
      std::lock_guard<std::mutex> lock(p.mu);
      auto it = p.pending.find(h.id);
      if (it != p.pending.end() && it->second->state.load() == 0) {
        pending = it->second;
        pending->busy = true;  // markDead must not settle it while we write into dst
      }
    }
    // Settles the read (if any) so that the caller's wait ends, whatever happens next.
    auto settle = [&](bool ok, const std::string& error) {
      if (!pending) return;
      std::lock_guard<std::mutex> lock(p.mu);
      if (!ok) pending->error = error;
      pending->busy = false;
      pending->state.store(ok ? 1 : 2, std::memory_order_release);
      localWakeup().notify();
    };
    if (h.op == kReadResp) {
      if (!pending || pending->length != h.length) {
        why = strCat("answered a read it was not asked for (", h.length, " bytes): protocol error");
        settle(false, why);
        break;
      }
      const bool ok = recvAll(fd, pending->dst, h.length);
      settle(ok, "connection lost during a read");
      if (!ok) break;
    } else if (h.op == kError && h.length <= kMaxErrorBytes) {
      std::string msg(h.length, '\0');
      const bool ok = recvAll(fd, msg.data(), msg.size());
      if (pending) {
        settle(false, ok ? msg : "connection lost during an error report");
      } else if (ok) {
        std::lock_guard<std::mutex> lock(p.mu);
        if (p.async_error.empty()) p.async_error = msg;
      }
      if (!ok) break;
    } else {
      why = strCat("sent a malformed reply (op ", h.op, ", ", h.length, " bytes): protocol error");
      settle(false, why);
      break;
    }
  }
  if (!closing_.load()) markDead(peer, why);
}

void TcpTransport::shutdown() {
  closing_.store(true);
  for (auto& p : peers_) {
    for (int fd : {p->in_fd, p->out_fd})
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }
  for (auto& p : peers_) {
    if (p->serve_thread.joinable()) p->serve_thread.join();
    if (p->reply_thread.joinable()) p->reply_thread.join();
    closeFd(p->in_fd);
    closeFd(p->out_fd);
  }
  closeFd(listen_fd_);
}

}  // namespace rdkeras
