// Handshake: how two ranks prove to each other, over a fresh connection, that
// both hold the job's transport key -- without the key (or anything derived
// from it that could be replayed) ever crossing the wire. Every transport's
// set-up connections (shm's unix socket, tcp's two sockets per pair, verbs's
// liveness socket) go through it.
//
//   client -> server  Hello     magic, version, link, client rank, server rank,
//                               world size, channel, client nonce (32 B)
//   server -> client  Challenge status, server nonce (32 B),
//                               HMAC(key, "server" | Hello | server nonce)
//   client -> server  Proof     HMAC(key, "client" | Hello | server nonce)  [+ an fd]
//   server -> client  Welcome   status                                      [+ an fd]
//
// Both MACs cover both ranks, the link, the channel and both fresh nonces, and
// are compared in constant time: a recorded handshake is useless against a new
// nonce, a server's answer cannot be reflected as a client's proof, and a peer
// that does not hold the key learns nothing but a refusal. A file descriptor
// (shm's arena) is attached only after the other side has proven itself.
//
// The server side (acceptAuthenticated) runs every pending connection at once
// from one poll loop with fixed-size buffers: an unauthenticated connection
// costs ~200 bytes, gets kSecondsPerConnection at most, at most kMaxPending of
// them exist (the oldest is dropped first), and none of them can stall,
// refuse or fail the others. Nothing here encrypts the data that follows.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/common.h"
#include "engine/sha256.h"

namespace rdkeras {

enum class Link : uint16_t { kShm = 1, kTcp = 2, kVerbs = 3 };

// Who this process is, as the handshake sees it.
struct HandshakeIdentity {
  Link link;
  int rank;
  int world_size;
  std::string key;                   // the job's transport key (kKeyBytes)
  std::function<void()> watch = {};  // called about every 100 ms while waiting; throws to give up
};

namespace handshake {

constexpr uint32_t kMagic = 0x4b484452;  // "RDHK" little-endian
constexpr uint16_t kVersion = 1;
constexpr size_t kKeyBytes = 32;
constexpr size_t kNonceBytes = 32;
constexpr size_t kHelloBytes = 24 + kNonceBytes;
constexpr size_t kChallengeBytes = 8 + kNonceBytes + 32;
constexpr size_t kProofBytes = 8 + 32;
constexpr size_t kWelcomeBytes = 8;
constexpr double kSecondsPerConnection = 10;
constexpr size_t kMaxPending = 128;

enum Status : uint32_t {
  kOk = 0,
  kMalformed = 1,   // not a hello of this version, link and world
  kUnexpected = 2,  // this rank expects no (more) connection from that rank on that channel
  kBadProof = 3,    // the proof did not verify: the keys differ
};

using Nonce = std::array<uint8_t, kNonceBytes>;

struct Hello {
  Link link;
  uint32_t client_rank, server_rank, world_size, channel;
  Nonce nonce;
};
struct Challenge {
  uint32_t status;
  Nonce nonce;
  Digest mac;
};

std::array<uint8_t, kHelloBytes> encode(const Hello& h);
std::array<uint8_t, kChallengeBytes> encode(const Challenge& c);
std::array<uint8_t, kProofBytes> encodeProof(const Digest& mac);
std::array<uint8_t, kWelcomeBytes> encodeWelcome(uint32_t status);
// Each returns false, leaving *out unspecified, unless the n bytes are one well-formed message.
bool decode(const uint8_t* p, size_t n, Hello* out);
bool decode(const uint8_t* p, size_t n, Challenge* out);
bool decodeProof(const uint8_t* p, size_t n, Digest* mac);
bool decodeWelcome(const uint8_t* p, size_t n, uint32_t* status);

// The two MACs over an encoded Hello and the server's nonce.
Digest serverMac(const std::string& key, const uint8_t* hello, const Nonce& server_nonce);
Digest clientMac(const std::string& key, const uint8_t* hello, const Nonce& server_nonce);
Nonce freshNonce();
const char* linkName(Link link);

}  // namespace handshake

// Client side. Opens a connection with `dial()` (which throws PeerError if it
// cannot) and authenticates both ways with `server_rank` on `channel`. If the
// connection drops before the server answered (a flood of strangers may have
// crowded it out), it dials again until the deadline. Attaches `send_fd` to
// the proof (unix sockets only) and stores an fd attached to the welcome in
// *received_fd. Returns the connected, blocking socket.
int connectAuthenticated(const std::function<int()>& dial, const HandshakeIdentity& me, int server_rank,
                         uint32_t channel, const Deadline& deadline, int send_fd = -1,
                         int* received_fd = nullptr);

// Server side. Accepts on the non-blocking `listen_fd` until `pending()` is
// empty. `wanted(rank, channel)` says whether a connection claiming that rank
// and channel is expected now; `admit(fd, rank, channel, received_fd)` takes an
// authenticated, blocking socket (and the fd the client attached, or -1).
// `screen(fd)`, if given, may refuse a connection before it costs anything (shm:
// another user's). On timeout the error names the ranks pending() still lists.
void acceptAuthenticated(
    int listen_fd, const HandshakeIdentity& me, const Deadline& deadline,
    const std::function<std::vector<int>()>& pending,
    const std::function<bool(int rank, uint32_t channel)>& wanted,
    const std::function<void(int fd, int rank, uint32_t channel, int received_fd)>& admit, int send_fd = -1,
    const std::function<bool(int fd)>& screen = {});

}  // namespace rdkeras
