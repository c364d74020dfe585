#include "transport/mixed/mixed_transport.h"

#include "engine/socket_util.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace rdkeras {
namespace {

// The inner descriptors travel hex-encoded: theirs use the same ';' and '=' as ours.
std::string toHex(const std::string& s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * s.size());
  for (unsigned char c : s) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string fromHex(const std::string& hex, int peer) {
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw EngineError(strCat("shm+tcp: rank ", peer, "'s descriptor is not hex-encoded"));
  };
  if (hex.size() % 2) throw EngineError(strCat("shm+tcp: rank ", peer, "'s descriptor has an odd length"));
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<char>(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
  return out;
}

}  // namespace

MixedTransport::MixedTransport(int rank, int world_size, Arena& arena, const TransportOptions& options)
    : rank_(rank),
      world_size_(world_size),
      shm_(std::make_unique<ShmTransport>(rank, world_size, arena, options)),
      tcp_(std::make_unique<TcpTransport>(rank, world_size, arena, options)) {}

MixedTransport::~MixedTransport() { shutdown(); }

std::string MixedTransport::localDescriptor() const {
  return strCat("shm+tcp;host=", hostIdentity(), ";shm=", toHex(shm_->localDescriptor()),
                ";tcp=", toHex(tcp_->localDescriptor()));
}

void MixedTransport::connect(const std::vector<std::string>& descriptors, const std::string& key,
                             const Deadline& deadline) {
  if (static_cast<int>(descriptors.size()) != world_size_)
    throw EngineError("shm+tcp: need one descriptor per rank");
  // An empty descriptor tells an inner transport that another one reaches that peer.
  std::vector<std::string> local(world_size_), remote(world_size_);
  by_peer_.assign(world_size_, nullptr);
  const std::string me = hostIdentity();
  for (int r = 0; r < world_size_; ++r) {
    const bool same_host = field(descriptors[r], "host") == me;
    if (r == rank_ || same_host) local[r] = fromHex(field(descriptors[r], "shm"), r);
    if (r == rank_ || !same_host) remote[r] = fromHex(field(descriptors[r], "tcp"), r);
    if (r != rank_) by_peer_[r] = same_host ? shm_.get() : tcp_.get();
  }
  // Every rank sets up shm first: it only involves ranks of one host, so no rank can be
  // waiting for tcp from a rank that is still waiting for shm from it.
  shm_->setSetupWatch(setup_watch_);
  tcp_->setSetupWatch(setup_watch_);
  shm_->connect(local, key, deadline);
  tcp_->connect(remote, key, deadline);
}

Transport& MixedTransport::route(int peer) {
  if (peer < 0 || peer >= world_size_ || peer == rank_ || by_peer_.empty() || !by_peer_[peer])
    throw EngineError(strCat("shm+tcp: no connection to rank ", peer));
  return *by_peer_[peer];
}

void MixedTransport::write(int peer, const void* src, uint64_t key, uint64_t offset, size_t length,
                           const Deadline& deadline) {
  route(peer).write(peer, src, key, offset, length, deadline);
  countWrite(length);
}

void MixedTransport::read(int peer, void* dst, uint64_t key, uint64_t offset, size_t length,
                          const Deadline& deadline) {
  route(peer).read(peer, dst, key, offset, length, deadline);
  countRead(length);
}

void MixedTransport::writeFlag(int peer, uint64_t key, uint64_t offset, uint64_t value,
                               const Deadline& deadline) {
  route(peer).writeFlag(peer, key, offset, value, deadline);
  countFlag();
}

void MixedTransport::flush(int peer, const Deadline& deadline) { route(peer).flush(peer, deadline); }

void MixedTransport::checkPeer(int peer) { route(peer).checkPeer(peer); }

int64_t MixedTransport::lastHeardNs(int peer) const {
  const Transport* t = peer >= 0 && peer < static_cast<int>(by_peer_.size()) ? by_peer_[peer] : nullptr;
  return t ? t->lastHeardNs(peer) : 0;
}

void MixedTransport::cutOff(int peer, const std::string& why) { route(peer).cutOff(peer, why); }

std::vector<std::pair<std::string, const TransportStats*>> MixedTransport::parts() const {
  return {{"shm", &shm_->stats()}, {"tcp", &tcp_->stats()}};
}

void MixedTransport::shutdown() {
  shm_->shutdown();
  tcp_->shutdown();
}

}  // namespace rdkeras
