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
#include "engine/socket_util.h"

namespace rdkeras {
namespace {

constexpr uint32_t kHelloMagic = 0x53484d31;  // "SHM1"

struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t pid;
  uint32_t secret_len;
  char secret[128];
};

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

ShmTransport::ShmTransport(int rank, int world_size, Arena& arena)
    : rank_(rank), world_size_(world_size), arena_(arena) {
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

void ShmTransport::handshake(int sock, int peer, const std::string& secret, bool initiator,
                             const Deadline& deadline) {
  if (secret.size() > sizeof(Hello::secret)) throw EngineError("job secret too long");
  auto send_hello = [&] {
    Hello hello = {
        kHelloMagic, rank_, static_cast<int32_t>(getpid()), static_cast<uint32_t>(secret.size()), {}};
    std::memcpy(hello.secret, secret.data(), secret.size());
    struct iovec iov = {&hello, sizeof(hello)};
    alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    struct msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    struct cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    const int fd = arena_.fd();
    std::memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    if (sendmsg(sock, &msg, MSG_NOSIGNAL) != sizeof(hello))
      throwErrno(strCat("shm: sending arena to ", peerName(peer)));
  };
  auto recv_hello = [&](Hello* hello) -> int {
    if (!waitReadable(sock, deadline))
      throw TimeoutError(strCat("shm: timed out after ", deadline.seconds(), " s waiting for ",
                                peerName(peer), " to answer"));
    struct iovec iov = {hello, sizeof(*hello)};
    alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    struct msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0)
      throw PeerError(strCat("shm: ", peerName(peer), " refused the connection (wrong job secret?)"));
    struct cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    if (n != sizeof(*hello) || hello->magic != kHelloMagic || !cm || cm->cmsg_type != SCM_RIGHTS)
      throw EngineError("shm: malformed hello from a peer");
    int fd;
    std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    return fd;
  };
  Hello hello;
  int fd;
  if (initiator) {
    send_hello();
    fd = recv_hello(&hello);
  } else {
    fd = recv_hello(&hello);
    const bool ok = hello.secret_len == secret.size() &&
                    std::memcmp(hello.secret, secret.data(), secret.size()) == 0 && hello.rank > rank_ &&
                    hello.rank < world_size_ && !peers_[hello.rank];
    if (!ok) {
      close(fd);
      throw EngineError(strCat("shm: refused a connection claiming rank ", hello.rank,
                               " (wrong job secret or duplicate rank)"));
    }
    peer = hello.rank;
    send_hello();
  }
  auto p = std::make_unique<Peer>();
  p->sock = sock;
  p->pid = hello.pid;
  try {
    p->arena = ArenaMapping(fd);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);  // the mapping keeps the memfd alive
  peers_[peer] = std::move(p);
}

void ShmTransport::connect(const std::vector<std::string>& descriptors, const std::string& secret,
                           const Deadline& deadline) {
  if (static_cast<int>(descriptors.size()) != world_size_)
    throw EngineError("shm: need one descriptor per rank");
  const std::string me = hostIdentity();
  for (int r = 0; r < world_size_; ++r) {
    if (field(descriptors[r], "host") != me)
      throw EngineError(strCat("shm transport needs every rank on one host, but rank ", r,
                               " is on another host (or network namespace); use transport='tcp'"));
  }
  // Lower ranks accept, higher ranks connect: rank r connects to 0..r-1, then
  // accepts r+1..n-1, so no cycle of waits can form.
  for (int r = 0; r < rank_; ++r) {
    const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0) throwErrno("socket(AF_UNIX)");
    socklen_t len;
    sockaddr_un addr = abstractAddress(field(descriptors[r], "sock"), &len);
    if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      close(sock);
      throwErrno(strCat("shm: connecting to ", peerName(r)));
    }
    try {
      handshake(sock, r, secret, true, deadline);
    } catch (...) {
      close(sock);
      throw;
    }
  }
  for (int accepted = rank_ + 1; accepted < world_size_; ++accepted) {
    if (!waitReadable(listen_fd_, deadline)) {
      std::string missing;
      for (int r = rank_ + 1; r < world_size_; ++r)
        if (!peers_[r]) missing += strCat(missing.empty() ? "" : ", ", r);
      throw TimeoutError(strCat("shm: timed out after ", deadline.seconds(), " s waiting for rank(s) ",
                                missing, " to connect"));
    }
    const int sock = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (sock < 0) {
      if (errno == EAGAIN || errno == EINTR) {
        --accepted;
        continue;
      }
      throwErrno("shm: accept");
    }
    try {
      handshake(sock, -1, secret, false, deadline);
    } catch (...) {
      close(sock);
      throw;
    }
  }
  close(listen_fd_);
  listen_fd_ = -1;
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
  if (p.dead) throw PeerError(strCat("rank ", peer, " (pid ", p.pid, ") exited or closed its connection"));
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
    transferCopy(peers_[peer]->arena.base() + info.addr + offset, src, length);
  else
    cma(true, peer, const_cast<void*>(src), info.addr + offset, length);
}

void ShmTransport::read(int peer, void* dst, uint64_t key, uint64_t offset, size_t length, const Deadline&) {
  const RegionInfo info = resolve("read", peer, key, offset, length);
  countRead(length);
  if (length == 0) return;
  if (info.kind == RegionKind::kArena)
    transferCopy(dst, peers_[peer]->arena.base() + info.addr + offset, length);
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
  for (auto& p : peers_) {
    if (p && p->sock >= 0) {
      close(p->sock);
      p->sock = -1;
    }
  }
  peers_.clear();
  peers_.resize(world_size_);
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
}

}  // namespace rdkeras
