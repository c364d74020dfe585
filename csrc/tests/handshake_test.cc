// The transport handshake: message encoding, what the MACs bind, and whole handshakes over loopback.
#include "engine/handshake.h"

#include <doctest/doctest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "engine/socket_util.h"

using namespace rdkeras;
using namespace rdkeras::handshake;

namespace {

const std::string kKey(32, 'k');

Hello sampleHello() { return Hello{Link::kTcp, 1, 0, 2, 1, freshNonce()}; }

// A server (rank 0 of 2) accepting rank 1 on channels 0 and 1, in a thread.
struct Server {
  int listen_fd = -1, port = 0;
  std::atomic<int> admitted{0};
  std::string error;
  std::thread thread;
  std::vector<int> fds;

  explicit Server(const std::string& key, double seconds = 20) {
    listen_fd = listenTcp("127.0.0.1", &port);
    thread = std::thread([this, key, seconds] {
      bool got[2] = {false, false};
      try {
        acceptAuthenticated(
            listen_fd, HandshakeIdentity{Link::kTcp, 0, 2, key}, Deadline(seconds),
            [&] { return got[0] && got[1] ? std::vector<int>{} : std::vector<int>{1}; },
            [&](int rank, uint32_t ch) { return rank == 1 && ch < 2 && !got[ch]; },
            [&](int fd, int, uint32_t ch, int) {
              got[ch] = true;
              fds.push_back(fd);
              ++admitted;
            });
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
  }
  ~Server() {
    if (thread.joinable()) thread.join();
    for (int fd : fds) close(fd);
    close(listen_fd);
  }
};

int dialTo(int port) { return connectTcp("127.0.0.1", std::to_string(port), Deadline(5), 0); }

void sendBytes(int fd, const void* p, size_t n) {
  REQUIRE(send(fd, p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n));
}

// Reads exactly n bytes (blocking); false on EOF.
bool readBytes(int fd, void* p, size_t n) { return recvAll(fd, p, n); }

// After a proof on `fd` the server must refuse: it answers kBadProof, admits nobody for it, and
// still admits the two real channels of rank 1 afterwards.
void expectRefusedThenRealPeersAdmitted(Server& server, int fd) {
  uint8_t w[kWelcomeBytes];
  uint32_t status = kOk;
  REQUIRE(readBytes(fd, w, sizeof(w)));
  REQUIRE(decodeWelcome(w, sizeof(w), &status));
  CHECK(status == kBadProof);
  close(fd);
  CHECK(server.admitted == 0);
  const HandshakeIdentity me{Link::kTcp, 1, 2, kKey};
  close(connectAuthenticated([&] { return dialTo(server.port); }, me, 0, 0, Deadline(10)));
  close(connectAuthenticated([&] { return dialTo(server.port); }, me, 0, 1, Deadline(10)));
  server.thread.join();
  CHECK(server.admitted == 2);
}

}  // namespace

TEST_CASE("messages round-trip, and anything else is refused") {
  const Hello h = sampleHello();
  const auto bytes = encode(h);
  Hello back;
  REQUIRE(decode(bytes.data(), bytes.size(), &back));
  CHECK(back.link == h.link);
  CHECK(back.client_rank == 1);
  CHECK(back.server_rank == 0);
  CHECK(back.world_size == 2);
  CHECK(back.channel == 1);
  CHECK(back.nonce == h.nonce);
  CHECK_FALSE(decode(bytes.data(), bytes.size() - 1, &back));  // truncated
  for (size_t i : {0, 4, 6}) {                                 // magic, version, link
    auto bad = bytes;
    bad[i] ^= 0x40;
    CHECK_FALSE(decode(bad.data(), bad.size(), &back));
  }
  const Challenge c{kOk, freshNonce(), serverMac(kKey, bytes.data(), freshNonce())};
  const auto cb = encode(c);
  Challenge cback;
  REQUIRE(decode(cb.data(), cb.size(), &cback));
  CHECK(cback.mac == c.mac);
  CHECK(cback.nonce == c.nonce);
  Digest m;
  const auto p = encodeProof(c.mac);
  REQUIRE(decodeProof(p.data(), p.size(), &m));
  CHECK(m == c.mac);
  uint32_t status;
  const auto w = encodeWelcome(kBadProof);
  REQUIRE(decodeWelcome(w.data(), w.size(), &status));
  CHECK(status == kBadProof);
  CHECK_FALSE(decodeWelcome(w.data(), 7, &status));
}

TEST_CASE("the MACs bind every byte of the hello, the server's nonce, the key and the direction") {
  const auto hello = encode(sampleHello());
  const Nonce nonce = freshNonce();
  const Digest server = serverMac(kKey, hello.data(), nonce), client = clientMac(kKey, hello.data(), nonce);
  CHECK(server != client);  // a server's answer is not a client's proof
  for (size_t i = 0; i < hello.size(); ++i) {
    auto changed = hello;
    changed[i] ^= 1;
    CHECK(clientMac(kKey, changed.data(), nonce) != client);
  }
  Nonce other = nonce;
  other[31] ^= 1;
  CHECK(clientMac(kKey, hello.data(), other) != client);  // a new nonce: a recorded proof is useless
  CHECK(clientMac(std::string(32, 'K'), hello.data(), nonce) != client);
  CHECK(freshNonce() != freshNonce());
}

TEST_CASE("two ranks with the same key connect; the server admits both channels") {
  Server server(kKey);
  const HandshakeIdentity me{Link::kTcp, 1, 2, kKey};
  const int a = connectAuthenticated([&] { return dialTo(server.port); }, me, 0, 0, Deadline(10));
  const int b = connectAuthenticated([&] { return dialTo(server.port); }, me, 0, 1, Deadline(10));
  server.thread.join();
  CHECK(server.error == "");
  CHECK(server.admitted == 2);
  close(a);
  close(b);
}

TEST_CASE("a wrong key fails on both sides, and the server still takes the right one") {
  Server server(kKey);
  const HandshakeIdentity stranger{Link::kTcp, 1, 2, std::string(32, 'x')};
  CHECK_THROWS_WITH_AS(
      connectAuthenticated([&] { return dialTo(server.port); }, stranger, 0, 0, Deadline(10)),
      doctest::Contains("could not prove it holds this job's key"), AuthenticationError);
  // By hand: a proof made with another key is refused with kBadProof.
  const int fd = dialTo(server.port);
  const auto hello = encode(Hello{Link::kTcp, 1, 0, 2, 0, freshNonce()});
  sendBytes(fd, hello.data(), hello.size());
  uint8_t buf[kChallengeBytes];
  REQUIRE(readBytes(fd, buf, sizeof(buf)));
  Challenge c;
  REQUIRE(decode(buf, sizeof(buf), &c));
  CHECK(c.status == kOk);
  const auto proof = encodeProof(clientMac(std::string(32, 'x'), hello.data(), c.nonce));
  sendBytes(fd, proof.data(), proof.size());
  expectRefusedThenRealPeersAdmitted(server, fd);
}

TEST_CASE("a recorded proof replayed on a new connection is refused") {
  Server server(kKey);
  const auto hello = encode(Hello{Link::kTcp, 1, 0, 2, 0, freshNonce()});
  uint8_t buf[kChallengeBytes];
  Challenge c;
  // Connection 1: record the (valid) proof for its nonce without using it.
  const int first = dialTo(server.port);
  sendBytes(first, hello.data(), hello.size());
  REQUIRE(readBytes(first, buf, sizeof(buf)));
  REQUIRE(decode(buf, sizeof(buf), &c));
  const auto recorded = encodeProof(clientMac(kKey, hello.data(), c.nonce));
  close(first);
  // Connection 2: the same hello gets a new nonce; the recorded proof does not answer it.
  const int second = dialTo(server.port);
  sendBytes(second, hello.data(), hello.size());
  REQUIRE(readBytes(second, buf, sizeof(buf)));
  Challenge c2;
  REQUIRE(decode(buf, sizeof(buf), &c2));
  CHECK(c2.nonce != c.nonce);
  sendBytes(second, recorded.data(), recorded.size());
  expectRefusedThenRealPeersAdmitted(server, second);
}

TEST_CASE("silent and half-finished strangers do not hold up the real peer") {
  // The server gives up before any stranger's own time is up: it must serve the real peer meanwhile.
  Server server(kKey, kSecondsPerConnection * 0.8);
  std::vector<int> idle;
  for (size_t i = 0; i < kMaxPending + 20; ++i) {  // more than the server keeps: it drops the oldest
    const int fd = dialTo(server.port);
    const auto hello = encode(Hello{Link::kTcp, 1, 0, 2, 0, freshNonce()});
    if (i % 2) sendBytes(fd, hello.data(), 10);  // half a hello; the others say nothing
    idle.push_back(fd);
  }
  const HandshakeIdentity me{Link::kTcp, 1, 2, kKey};
  close(connectAuthenticated([&] { return dialTo(server.port); }, me, 0, 0, Deadline(10)));
  close(connectAuthenticated([&] { return dialTo(server.port); }, me, 0, 1, Deadline(10)));
  server.thread.join();
  CHECK(server.admitted == 2);
  for (int fd : idle) close(fd);
}

TEST_CASE("a server that expects nobody more times out naming the missing rank") {
  Server server(kKey, 0.3);
  server.thread.join();
  CHECK(server.error.find("waiting for rank(s) 1 to connect") != std::string::npos);
}
