// Small blocking-socket helpers shared by the transports; all bounded by deadlines.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <string>
#include <vector>

#include "engine/common.h"

namespace rdkeras {

// Sends every byte of `iov` (MSG_NOSIGNAL). Throws PeerError naming `peer` if
// the connection is gone and TimeoutError if the deadline passes first.
void sendAll(int fd, struct iovec* iov, int iovcnt, const Deadline& deadline, const std::string& peer);
// Receives exactly n bytes, blocking without a deadline (progress threads;
// shutdown(2) wakes them). Returns false on EOF or error.
bool recvAll(int fd, void* buf, size_t n);
// Receives exactly n bytes before the deadline; throws like sendAll.
void recvAll(int fd, void* buf, size_t n, const Deadline& deadline, const std::string& peer);
// Waits until `fd` is readable (e.g. a listening socket has a connection).
bool waitReadable(int fd, const Deadline& deadline);
void setSocketBuffers(int fd, int bytes);
// A non-blocking listening TCP socket bound to `host` (the job's address, never a wildcard
// unless asked) on a free port, returned in *port.
int listenTcp(const std::string& host, int* port);
// A blocking TCP connection to host:port made before the deadline; PeerError names `peer` otherwise.
int connectTcp(const std::string& host, const std::string& port, const Deadline& deadline, int peer);
std::string randomHex(size_t bytes);
// An identifier equal for processes that share a host and network namespace.
std::string hostIdentity();

}  // namespace rdkeras
