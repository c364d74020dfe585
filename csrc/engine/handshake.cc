#include "engine/handshake.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>

#include "engine/socket_util.h"

namespace rdkeras {
namespace handshake {
namespace {

// Little-endian fields, so that hosts of either byte order agree.
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

Digest mac(const std::string& key, const char* label, const uint8_t* hello, const Nonce& server_nonce) {
  HmacSha256 h(key.data(), key.size());
  h.update(label, std::strlen(label) + 1);  // the label's NUL separates it from the hello
  h.update(hello, kHelloBytes);
  h.update(server_nonce.data(), server_nonce.size());
  return h.finish();
}

}  // namespace

std::array<uint8_t, kHelloBytes> encode(const Hello& h) {
  std::array<uint8_t, kHelloBytes> out{};
  put32(&out[0], kMagic);
  put32(&out[4], uint32_t{kVersion} | uint32_t{static_cast<uint16_t>(h.link)} << 16);
  put32(&out[8], h.client_rank);
  put32(&out[12], h.server_rank);
  put32(&out[16], h.world_size);
  put32(&out[20], h.channel);
  std::memcpy(&out[24], h.nonce.data(), kNonceBytes);
  return out;
}

bool decode(const uint8_t* p, size_t n, Hello* out) {
  if (n != kHelloBytes || get32(p) != kMagic) return false;
  const uint32_t vl = get32(p + 4);
  if ((vl & 0xffff) != kVersion) return false;
  const uint16_t link = static_cast<uint16_t>(vl >> 16);
  if (link < static_cast<uint16_t>(Link::kShm) || link > static_cast<uint16_t>(Link::kVerbs)) return false;
  out->link = static_cast<Link>(link);
  out->client_rank = get32(p + 8);
  out->server_rank = get32(p + 12);
  out->world_size = get32(p + 16);
  out->channel = get32(p + 20);
  std::memcpy(out->nonce.data(), p + 24, kNonceBytes);
  return true;
}

std::array<uint8_t, kChallengeBytes> encode(const Challenge& c) {
  std::array<uint8_t, kChallengeBytes> out{};
  put32(&out[0], kMagic);
  put32(&out[4], c.status);
  std::memcpy(&out[8], c.nonce.data(), kNonceBytes);
  std::memcpy(&out[8 + kNonceBytes], c.mac.data(), c.mac.size());
  return out;
}

bool decode(const uint8_t* p, size_t n, Challenge* out) {
  if (n != kChallengeBytes || get32(p) != kMagic) return false;
  out->status = get32(p + 4);
  std::memcpy(out->nonce.data(), p + 8, kNonceBytes);
  std::memcpy(out->mac.data(), p + 8 + kNonceBytes, out->mac.size());
  return true;
}

std::array<uint8_t, kProofBytes> encodeProof(const Digest& m) {
  std::array<uint8_t, kProofBytes> out{};
  put32(&out[0], kMagic);
  std::memcpy(&out[8], m.data(), m.size());
  return out;
}

bool decodeProof(const uint8_t* p, size_t n, Digest* m) {
  if (n != kProofBytes || get32(p) != kMagic || get32(p + 4) != 0) return false;
  std::memcpy(m->data(), p + 8, m->size());
  return true;
}

std::array<uint8_t, kWelcomeBytes> encodeWelcome(uint32_t status) {
  std::array<uint8_t, kWelcomeBytes> out{};
  put32(&out[0], kMagic);
  put32(&out[4], status);
  return out;
}

bool decodeWelcome(const uint8_t* p, size_t n, uint32_t* status) {
  if (n != kWelcomeBytes || get32(p) != kMagic) return false;
  *status = get32(p + 4);
  return true;
}

Digest serverMac(const std::string& key, const uint8_t* hello, const Nonce& server_nonce) {
  return mac(key, "rdkeras handshake v1 server", hello, server_nonce);
}

Digest clientMac(const std::string& key, const uint8_t* hello, const Nonce& server_nonce) {
  return mac(key, "rdkeras handshake v1 client", hello, server_nonce);
}

Nonce freshNonce() {
  Nonce n;
  if (getrandom(n.data(), n.size(), 0) != static_cast<ssize_t>(n.size())) throwErrno("getrandom");
  return n;
}

const char* linkName(Link link) {
  switch (link) {
    case Link::kShm:
      return "shm";
    case Link::kTcp:
      return "tcp";
    case Link::kVerbs:
      return "verbs";
  }
  return "?";
}

}  // namespace handshake

namespace {

using namespace handshake;

void checkKey(const HandshakeIdentity& me) {
  if (me.key.size() != kKeyBytes)
    throw EngineError(
        strCat(linkName(me.link), ": the transport key must be ", kKeyBytes, " bytes, got ", me.key.size()));
}

// Sends one message (one packet on a unix socket), optionally with an fd; non-blocking, all or nothing.
bool sendMessage(int fd, const uint8_t* p, size_t n, int attach_fd) {
  struct iovec iov = {const_cast<uint8_t*>(p), n};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (attach_fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    struct cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &attach_fd, sizeof(int));
  }
  ssize_t r;
  do {
    r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (r < 0 && errno == EINTR);
  return r == static_cast<ssize_t>(n);
}

// Receives what is there (up to `room` bytes) without blocking. Returns bytes
// read, 0 on EOF, -1 if nothing is there yet, -2 on error. Any fd that arrives
// is kept in *fd if fd is non-null and empty, else closed (strangers may send
// many).
ssize_t receiveSome(int sock, uint8_t* p, size_t room, int* fd) {
  struct iovec iov = {p, room};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t r;
  do {
    r = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? -1 : -2;
  for (struct cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
      if (fd && *fd < 0)
        *fd = got;
      else
        close(got);
    }
  }
  return r;
}

void setBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK); }

// Client-side: receives exactly n bytes before the deadline. Returns false on
// EOF or reset (the server dropped us); throws TimeoutError on the deadline.
bool receiveExact(int sock, uint8_t* p, size_t n, const Deadline& deadline, int* fd,
                  const std::string& peer) {
  size_t have = 0;
  while (have < n) {
    if (!waitReadable(sock, deadline))
      throw TimeoutError(strCat("timed out after ", deadline.seconds(), " s waiting for ", peer,
                                " to answer the handshake"));
    const ssize_t r = receiveSome(sock, p + have, n - have, fd);
    if (r == -1) continue;
    if (r <= 0) return false;
    have += static_cast<size_t>(r);
  }
  return true;
}

std::string refusal(uint32_t status, const HandshakeIdentity& me, int server_rank, uint32_t channel) {
  const std::string who = strCat(linkName(me.link), ": rank ", server_rank);
  switch (status) {
    case kMalformed:
      return strCat(who,
                    " did not understand this rank's hello (another rdkeras version, transport or world "
                    "size?)");
    case kUnexpected:
      return strCat(who, " expects no connection from rank ", me.rank, " on channel ", channel,
                    " (is another process running as rank ", me.rank, "?)");
    case kBadProof:
      return strCat(who,
                    " refused this rank's proof: the job keys differ (every rank needs the same "
                    "RDKERAS_JOB_TOKEN)");
    default:
      return strCat(who, " refused the connection (status ", status, ")");
  }
}

}  // namespace

int connectAuthenticated(const std::function<int()>& dial, const HandshakeIdentity& me, int server_rank,
                         uint32_t channel, const Deadline& deadline, int send_fd, int* received_fd) {
  checkKey(me);
  const std::string peer = strCat("rank ", server_rank);
  for (int attempt = 0;; ++attempt) {
    if (me.watch) me.watch();
    if (attempt > 0) {
      if (deadline.expired())
        throw PeerError(
            strCat(linkName(me.link), ": ", peer,
                   " kept closing the connection during the handshake (gave up after ", attempt, " tries)"),
            server_rank);
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20 * attempt, 500)));
    }
    const int fd = dial();
    auto fail = [&](auto error) {
      close(fd);
      throw error;
    };
    Hello hello{me.link,
                static_cast<uint32_t>(me.rank),
                static_cast<uint32_t>(server_rank),
                static_cast<uint32_t>(me.world_size),
                channel,
                freshNonce()};
    const auto hello_bytes = encode(hello);
    struct iovec iov = {const_cast<uint8_t*>(hello_bytes.data()), hello_bytes.size()};
    try {
      sendAll(fd, &iov, 1, deadline, peer);
    } catch (const PeerError&) {
      close(fd);
      continue;
    }
    uint8_t buf[kChallengeBytes];
    if (!receiveExact(fd, buf, sizeof(buf), deadline, nullptr, peer)) {
      close(fd);
      continue;  // dropped before it answered
    }
    Challenge challenge;
    if (!decode(buf, sizeof(buf), &challenge))
      fail(EngineError(strCat(linkName(me.link), ": the process at ", peer,
                              "'s address does not speak rdkeras's handshake")));
    if (challenge.status != kOk) fail(EngineError(refusal(challenge.status, me, server_rank, channel)));
    const Digest expect = serverMac(me.key, hello_bytes.data(), challenge.nonce);
    if (!equalConstantTime(expect.data(), challenge.mac.data(), expect.size()))
      fail(AuthenticationError(
          strCat(linkName(me.link), ": the process at ", peer,
                 "'s address could not prove it holds this job's key (a process of another "
                 "job, or an impostor); every rank needs the same RDKERAS_JOB_TOKEN")));
    const auto proof = encodeProof(clientMac(me.key, hello_bytes.data(), challenge.nonce));
    if (!sendMessage(fd, proof.data(), proof.size(), send_fd)) {
      close(fd);
      continue;
    }
    uint8_t welcome[kWelcomeBytes];
    int got_fd = -1;
    if (!receiveExact(fd, welcome, sizeof(welcome), deadline, received_fd ? &got_fd : nullptr, peer)) {
      if (got_fd >= 0) close(got_fd);
      close(fd);
      continue;
    }
    uint32_t status;
    if (!decodeWelcome(welcome, sizeof(welcome), &status) || status != kOk) {
      if (got_fd >= 0) close(got_fd);
      fail(EngineError(refusal(decodeWelcome(welcome, sizeof(welcome), &status) ? status : kMalformed, me,
                               server_rank, channel)));
    }
    if (received_fd) *received_fd = got_fd;
    setBlocking(fd);
    return fd;
  }
}

namespace {

// One unauthenticated connection on the server side.
struct Pending {
  int fd;
  Clock::time_point until;
  bool proving = false;  // hello answered; waiting for the proof
  uint8_t buf[kHelloBytes] = {};
  size_t have = 0;
  std::array<uint8_t, kHelloBytes> hello_bytes{};
  Hello hello{};
  Nonce nonce{};
  int attached = -1;  // an fd that came with the proof

  ~Pending() {
    if (attached >= 0) close(attached);
    if (fd >= 0) close(fd);
  }
};

}  // namespace

void acceptAuthenticated(
    int listen_fd, const HandshakeIdentity& me, const Deadline& deadline,
    const std::function<std::vector<int>()>& pending,
    const std::function<bool(int rank, uint32_t channel)>& wanted,
    const std::function<void(int fd, int rank, uint32_t channel, int received_fd)>& admit, int send_fd,
    const std::function<bool(int fd)>& screen) {
  checkKey(me);
  std::deque<std::unique_ptr<Pending>> conns;  // oldest first
  const auto per_connection =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kSecondsPerConnection));
  // Answers a finished message; returns false when the connection is done with (dropped or admitted).
  auto step = [&](Pending& c) -> bool {
    if (!c.proving) {
      std::memcpy(c.hello_bytes.data(), c.buf, kHelloBytes);
      const bool ok = decode(c.buf, kHelloBytes, &c.hello) && c.hello.link == me.link &&
                      c.hello.server_rank == static_cast<uint32_t>(me.rank) &&
                      c.hello.world_size == static_cast<uint32_t>(me.world_size) &&
                      c.hello.client_rank < static_cast<uint32_t>(me.world_size) &&
                      c.hello.client_rank != static_cast<uint32_t>(me.rank);
      if (!ok || !wanted(static_cast<int>(c.hello.client_rank), c.hello.channel)) {
        const auto refuse = encode(Challenge{ok ? kUnexpected : kMalformed, {}, {}});
        sendMessage(c.fd, refuse.data(), refuse.size(), -1);
        return false;
      }
      c.nonce = freshNonce();
      const auto challenge =
          encode(Challenge{kOk, c.nonce, serverMac(me.key, c.hello_bytes.data(), c.nonce)});
      if (!sendMessage(c.fd, challenge.data(), challenge.size(), -1)) return false;
      c.proving = true;
      c.have = 0;
      return true;
    }
    Digest got;
    const Digest expect = clientMac(me.key, c.hello_bytes.data(), c.nonce);
    if (!decodeProof(c.buf, kProofBytes, &got) || !equalConstantTime(got.data(), expect.data(), got.size())) {
      const auto refuse = encodeWelcome(kBadProof);
      sendMessage(c.fd, refuse.data(), refuse.size(), -1);
      return false;
    }
    const int rank = static_cast<int>(c.hello.client_rank);
    if (!wanted(rank, c.hello.channel)) {  // another connection for it finished first
      const auto refuse = encodeWelcome(kUnexpected);
      sendMessage(c.fd, refuse.data(), refuse.size(), -1);
      return false;
    }
    const auto welcome = encodeWelcome(kOk);
    if (!sendMessage(c.fd, welcome.data(), welcome.size(), send_fd)) return false;
    setBlocking(c.fd);
    const int fd = c.fd, attached = c.attached;
    c.fd = c.attached = -1;  // ownership passes to admit
    admit(fd, rank, c.hello.channel, attached);
    return false;
  };

  auto next_watch = Clock::now();
  for (std::vector<int> left = pending(); !left.empty(); left = pending()) {
    if (me.watch && Clock::now() >= next_watch) {
      me.watch();
      next_watch = Clock::now() + std::chrono::milliseconds(100);
    }
    if (deadline.expired()) {
      std::string names;
      for (int r : left) names += strCat(names.empty() ? "" : ", ", r);
      throw TimeoutError(strCat(linkName(me.link), ": timed out after ", deadline.seconds(),
                                " s waiting for rank(s) ", names, " to connect"));
    }
    std::vector<struct pollfd> fds = {{listen_fd, POLLIN, 0}};
    auto wake = Clock::now() + std::chrono::milliseconds(100);
    for (const auto& c : conns) {
      fds.push_back({c->fd, POLLIN, 0});
      wake = std::min(wake, c->until);
    }
    const int ms = static_cast<int>(std::clamp<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count() + 1, 0, 100));
    if (poll(fds.data(), fds.size(), std::min(ms, deadline.remainingMs(100))) < 0 && errno != EINTR)
      throwErrno("poll");
    // Existing connections first (fds[i+1] is conns[i]); then new ones.
    std::vector<bool> drop(conns.size(), false);
    for (size_t i = 0; i < conns.size(); ++i) {
      if (!(fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Pending& c = *conns[i];
      const size_t need = c.proving ? kProofBytes : kHelloBytes;
      const ssize_t r = receiveSome(c.fd, c.buf + c.have, need - c.have, c.proving ? &c.attached : nullptr);
      if (r == -1) continue;
      if (r <= 0) {
        drop[i] = true;
        continue;
      }
      c.have += static_cast<size_t>(r);
      if (c.have == need) drop[i] = !step(c);
    }
    const auto now = Clock::now();
    std::deque<std::unique_ptr<Pending>> kept;
    for (size_t i = 0; i < conns.size(); ++i)
      if (!drop[i] && conns[i]->until > now) kept.push_back(std::move(conns[i]));
    conns.swap(kept);
    if (fds[0].revents & POLLIN) {
      while (true) {
        const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;  // EAGAIN: none left (other errors: that connection is gone)
        if (screen && !screen(fd)) {
          close(fd);
          continue;
        }
        if (conns.size() >= kMaxPending) conns.pop_front();  // the oldest stranger makes room
        auto c = std::make_unique<Pending>();
        c->fd = fd;
        c->until =
            std::min(now + per_connection, now + std::chrono::milliseconds(deadline.remainingMs(1 << 30)));
        conns.push_back(std::move(c));
      }
    }
  }
}

}  // namespace rdkeras
