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
// Closes `fd` unless it is already closed (-1), then marks it closed: the transports' shutdown()
// is idempotent and also runs after connect() closed the listener, so each socket may be met twice.
void closeFd(int& fd);
// A non-blocking listening TCP socket bound to `host` (the job's address, never a wildcard
// unless asked) on a free port, returned in *port.
int listenTcp(const std::string& host, int* port);
// A blocking TCP connection to host:port made before the deadline; PeerError names `peer` otherwise.
int connectTcp(const std::string& host, const std::string& port, const Deadline& deadline, int peer);
std::string randomHex(size_t bytes);
// "Same host" for rdkeras: equal for processes that can reach each other's shm, i.e. that share
// the kernel (boot_id), the network namespace (shm peers meet on an abstract unix socket, which
// belongs to it) and the PID namespace (CMA addresses the peer by pid). Two containers or network
// namespaces on one machine share boot_id but differ here. The one formula: Python's
// rdkeras.engine.host_identity() calls this.
std::string hostIdentity();

}  // namespace rdkeras
