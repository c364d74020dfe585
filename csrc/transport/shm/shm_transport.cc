#include "transport/shm/shm_transport.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "engine/copy.h"
#include "engine/handshake.h"
#include "engine/socket_util.h"

namespace rdkeras {
namespace {

sockaddr_un abstractAddress(const std::string& name, socklen_t* len) {
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  addr.sun_path[0] = '\0';  // abstract namespace: no file is created
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

std::string peerName(int peer) { return strCat("rank ", peer); }

}  // namespace

ShmTransport::ShmTransport(int rank, int world_size, Arena& arena, const TransportOptions& options)
    : rank_(rank), world_size_(world_size), arena_(arena), options_(options) {
  // Yama (ptrace_scope=1) would refuse CMA between sibling workers; allow any
  // process of this user, as Open MPI's vader does. No-op where Yama is absent.
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  socket_name_ = strCat("rdkeras-shm-", getpid(), "-", randomHex(8));
  listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) throwErrno("socket(AF_UNIX)");
  socklen_t len;
  sockaddr_un addr = abstractAddress(socket_name_, &len);
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) throwErrno("bind(shm socket)");
  if (listen(listen_fd_, 128) != 0) throwErrno("listen(shm socket)");
  peers_.resize(world_size);
}

ShmTransport::~ShmTransport() { shutdown(); }

std::string ShmTransport::localDescriptor() const {
  return strCat("shm;host=", hostIdentity(), ";sock=", socket_name_, ";pid=", getpid());
}

void ShmTransport::addPeer(int peer, int sock, int arena_fd) {
  auto p = std::make_unique<Peer>();
  p->sock = sock;
  struct ucred cred = {};
  socklen_t len = sizeof(cred);
  // The kernel's word for the peer's pid (CMA targets it): no hello can claim another process.
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    close(sock);
    close(arena_fd);
    throwErrno(strCat("shm: SO_PEERCRED of ", peerName(peer)));
  }
  p->pid = cred.pid;
  if (arena_fd < 0) {
    close(sock);
    throw EngineError(strCat("shm: ", peerName(peer), " sent no arena"));
  }
  try {
    p->arena = ArenaMapping(arena_fd);
  } catch (...) {
    close(sock);
    close(arena_fd);
    throw;
  }
  close(arena_fd);  // the mapping keeps the memfd alive
  peers_[peer] = std::move(p);
}

void ShmTransport::connect(const std::vector<std::string>& descriptors, const std::string& key,
                           const Deadline& deadline) {
  if (static_cast<int>(descriptors.size()) != world_size_)
    throw EngineError("shm: need one descriptor per rank");
  const std::string me = hostIdentity();
  auto mine = [&](int r) { return r == rank_ || !descriptors[r].empty(); };  // empty: not shm's peer
  for (int r = 0; r < world_size_; ++r) {
    if (mine(r) && field(descriptors[r], "host") != me)
      throw EngineError(strCat("shm transport needs every rank on one host, but rank ", r,
                               " is on another host (or network namespace); use transport='tcp'"));
  }
  const HandshakeIdentity id{Link::kShm, rank_, world_size_, key, setup_watch_};
  // Lower ranks accept, higher ranks connect: rank r connects to 0..r-1, then
  // accepts r+1..n-1, so no cycle of waits can form. Arena fds are exchanged
  // only once both sides proved they hold the job's key.
  for (int r = 0; r < rank_; ++r) {
    if (!mine(r)) continue;
    const std::string name = field(descriptors[r], "sock");
    auto dial = [&] {
      const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
      if (sock < 0) throwErrno("socket(AF_UNIX)");
      socklen_t len;
      sockaddr_un addr = abstractAddress(name, &len);
      if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
        const int err = errno;
        close(sock);
        throw PeerError(strCat("shm: cannot connect to ", peerName(r), ": ", std::strerror(err)), r);
      }
      return sock;
    };
    int arena_fd = -1;
    const int sock = connectAuthenticated(dial, id, r, 0, deadline, arena_.fd(), &arena_fd);
    addPeer(r, sock, arena_fd);
  }
  const uid_t uid = getuid();
  acceptAuthenticated(
      listen_fd_, id, deadline,
      [&] {
        std::vector<int> left;
        for (int r = rank_ + 1; r < world_size_; ++r)
          if (mine(r) && !peers_[r]) left.push_back(r);
        return left;
      },
      [&](int rank, uint32_t channel) { return rank > rank_ && mine(rank) && channel == 0 && !peers_[rank]; },
      [&](int fd, int rank, uint32_t, int arena_fd) { addPeer(rank, fd, arena_fd); }, arena_.fd(),
      [uid](int fd) {  // the abstract socket is open to every local user: only ours get a handshake
        struct ucred cred = {};
        socklen_t len = sizeof(cred);
        return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid == uid;
      });
  closeFd(listen_fd_);
}

ShmTransport::Peer& ShmTransport::live(int peer) {
  if (peer < 0 || peer >= world_size_ || peer == rank_ || !peers_[peer])
    throw EngineError(strCat("shm: no connection to rank ", peer));
  // Only the cached verdict: a syscall per operation would triple small-message
  // latency. Writing into a dead peer's mapping is harmless; waits poll the
  // socket (checkPeer) and name the dead peer.
  if (peers_[peer]->dead) checkPeer(peer);
  return *peers_[peer];
}

void ShmTransport::checkPeer(int peer) {
  if (peer < 0 || peer >= world_size_ || !peers_[peer])
    throw EngineError(strCat("shm: no connection to rank ", peer));
  Peer& p = *peers_[peer];
  if (!p.dead) {
    // Nothing is ever sent on this socket after the handshake: readable means EOF.
    struct pollfd pfd = {p.sock, POLLIN | POLLRDHUP, 0};
    if (poll(&pfd, 1, 0) > 0) p.dead = true;
  }
  if (p.dead)
    throw PeerError(strCat("rank ", peer, " (pid ", p.pid, ") exited or closed its connection"), peer);
}

RegionInfo ShmTransport::resolve(const char* op, int peer, uint64_t key, uint64_t offset, size_t length) {
  Peer& p = live(peer);
  RegionInfo info;
  if (!p.arena.table().lookup(key, &info)) throwUnknownKey(op, peer, key);
  checkBounds(op, peer, key, info.length, offset, length);
  if (info.kind == RegionKind::kArena &&
      (info.addr > p.arena.capacity() || info.length > p.arena.capacity() - info.addr))
    throw RemoteAccessError(strCat(op, ": rank ", peer, "'s region table is corrupt"));
  return info;
}

void ShmTransport::cma(bool write, int peer, void* local, uint64_t remote_addr, size_t length) {
  const pid_t pid = peers_[peer]->pid;
  auto* lp = static_cast<char*>(local);
  while (length > 0) {
    struct iovec l = {lp, length};
    struct iovec r = {reinterpret_cast<void*>(remote_addr), length};
    const ssize_t n =
        write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n <= 0) {
      if (errno == ESRCH) {
        peers_[peer]->dead = true;
        checkPeer(peer);
      }
      throwErrno(strCat("shm: ", write ? "process_vm_writev" : "process_vm_readv", " to rank ", peer,
                        errno == EPERM ? " (not permitted: run workers as one user; check "
                                         "/proc/sys/kernel/yama/ptrace_scope)"
                                       : ""));
    }
    lp += n;
    remote_addr += n;
    length -= n;
  }
}

void ShmTransport::write(int peer, const void* src, uint64_t key, uint64_t offset, size_t length,
                         const Deadline&) {
  const RegionInfo info = resolve("write", peer, key, offset, length);
  countWrite(length);
  if (length == 0) return;
  if (info.kind == RegionKind::kArena)
    transferCopy(peers_[peer]->arena.base() + info.addr + offset, src, length, options_.nt_threshold);
  else
    cma(true, peer, const_cast<void*>(src), info.addr + offset, length);
}

void ShmTransport::read(int peer, void* dst, uint64_t key, uint64_t offset, size_t length, const Deadline&) {
  const RegionInfo info = resolve("read", peer, key, offset, length);
  countRead(length);
  if (length == 0) return;
  if (info.kind == RegionKind::kArena)
    transferCopy(dst, peers_[peer]->arena.base() + info.addr + offset, length, options_.nt_threshold);
  else
    cma(false, peer, dst, info.addr + offset, length);
}

void ShmTransport::writeFlag(int peer, uint64_t key, uint64_t offset, uint64_t value, const Deadline&) {
  checkFlagOffset(offset);
  const RegionInfo info = resolve("writeFlag", peer, key, offset, 8);
  if (info.kind != RegionKind::kArena)
    throw RemoteAccessError("writeFlag: flags must live in the arena (allocate them from the engine)");
  storeFence();  // memcpy may have used non-temporal stores
  storeRelease(peers_[peer]->arena.base() + info.addr + offset, value);
  countFlag();
}

void ShmTransport::flush(int peer, const Deadline&) {
  live(peer);
  checkPeer(peer);  // every operation completed synchronously; only liveness is left to report
}

void ShmTransport::shutdown() {
  for (auto& p : peers_)
    if (p) closeFd(p->sock);
  peers_.clear();
  peers_.resize(world_size_);
  closeFd(listen_fd_);
}

}  // namespace rdkeras
