#include "engine/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace rdkeras {

void sendAll(int fd, struct iovec* iov, int iovcnt, const Deadline& deadline, const std::string& peer) {
  while (iovcnt > 0) {
    struct msghdr msg = {};
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (deadline.expired())
          throw TimeoutError(strCat("timed out after ", deadline.seconds(), " s sending to ", peer,
                                    " (it stopped reading)"));
        struct pollfd p = {fd, POLLOUT, 0};
        poll(&p, 1, deadline.remainingMs(100) + 1);
        continue;
      }
      throw PeerError(strCat("lost connection to ", peer, " while sending: ", std::strerror(errno)));
    }
    size_t left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
}

bool recvAll(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = recv(fd, p, n, MSG_WAITALL);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void recvAll(int fd, void* buf, size_t n, const Deadline& deadline, const std::string& peer) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    if (!waitReadable(fd, deadline))
      throw TimeoutError(strCat("timed out after ", deadline.seconds(), " s waiting for ", peer));
    const ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
    if (r == 0) throw PeerError(strCat(peer, " closed the connection"));
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw PeerError(strCat("lost connection to ", peer, ": ", std::strerror(errno)));
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

bool waitReadable(int fd, const Deadline& deadline) {
  while (true) {
    struct pollfd p = {fd, POLLIN, 0};
    const int r = poll(&p, 1, deadline.remainingMs(100));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) throwErrno("poll");
    if (deadline.expired()) return false;
  }
}

void setSocketBuffers(int fd, int bytes) {
  // Best effort: the kernel caps these at net.core.{r,w}mem_max.
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

void closeFd(int& fd) {
  if (fd < 0) return;
  close(fd);
  fd = -1;
}

int connectTcp(const std::string& host, const std::string& port, const Deadline& deadline, int peer) {
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0)
    throw EngineError(strCat("tcp: cannot resolve rank ", peer, "'s address ", host, ": ", gai_strerror(rc)));
  int fd = -1;
  std::string why = "no address";
  for (auto* ai = res; ai && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      why = std::strerror(errno);
      closeFd(fd);
      continue;
    }
    struct pollfd p = {fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, deadline.remainingMs(1 << 30)) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      why = err ? std::strerror(err) : "timed out";
      closeFd(fd);
    }
  }
  freeaddrinfo(res);
  if (fd < 0)
    throw PeerError(strCat("tcp: cannot connect to rank ", peer, " at ", host, ":", port, ": ", why), peer);
  // Back to blocking mode: sends pass MSG_DONTWAIT themselves.
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

int listenTcp(const std::string& host, int* port) {
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  struct addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), "0", &hints, &res); rc != 0)
    throw EngineError(strCat("cannot listen on ", host, ": ", gai_strerror(rc)));
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const bool ok = fd >= 0 && bind(fd, res->ai_addr, res->ai_addrlen) == 0 && listen(fd, 128) == 0;
  const int err = errno;
  freeaddrinfo(res);
  if (!ok) {
    if (fd >= 0) close(fd);
    errno = err;
    throwErrno(strCat("listen on ", host));
  }
  struct sockaddr_storage addr;
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

std::string randomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  if (getrandom(raw.data(), bytes, 0) != static_cast<ssize_t>(bytes)) throwErrno("getrandom");
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

std::string hostIdentity() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  auto ns = [](const char* path) {
    char link[128] = {0};
    const ssize_t n = readlink(path, link, sizeof(link) - 1);
    return n > 0 ? std::string(link, n) : std::string("?");
  };
  return strCat(boot_id, "/", ns("/proc/self/ns/net"), "/", ns("/proc/self/ns/pid"));
}

}  // namespace rdkeras
