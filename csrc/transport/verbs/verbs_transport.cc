#include "transport/verbs/verbs_transport.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "engine/handshake.h"
#include "engine/socket_util.h"
#include "transport/verbs/verbs_device.h"

namespace rdkeras {
namespace {

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
constexpr size_t kScratchBytes = 4096;

std::string hex(const uint8_t* p, size_t n) {
  static const char* k = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += {k[p[i] >> 4], k[p[i] & 15]};
  return s;
}

void unhex(const std::string& s, uint8_t* out, size_t n) {
  auto digit = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw EngineError("verbs: malformed GID in a descriptor");
  };
  if (s.size() != 2 * n) throw EngineError("verbs: malformed GID in a descriptor");
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(digit(s[2 * i]) << 4 | digit(s[2 * i + 1]));
}

}  // namespace

std::string VerbsTransport::whyNotViable() {
  std::string why;
  const VerbsLib* lib = VerbsLib::load(&why);
  if (!lib) return why;
  int n = 0;
  struct ibv_device** list = lib->get_device_list(&n);
  if (list) lib->free_device_list(list);
  return n > 0 ? "" : kNoRdmaDevice;
}

VerbsTransport::VerbsTransport(int rank, int world_size, Arena& arena, const TransportOptions& options,
                               RegisterLocal register_local)
    : rank_(rank),
      world_size_(world_size),
      arena_(arena),
      options_(options),
      register_local_(std::move(register_local)) {
  std::string why;
  lib_ = VerbsLib::load(&why);
  if (!lib_) throw EngineError("transport 'verbs' is not viable: " + why);
  device_ = openVerbsDevice(*lib_, options_);
  pd_ = lib_->alloc_pd(device_.ctx);
  cq_ = lib_->create_cq(device_.ctx, 256, nullptr, nullptr, 0);
  if (!pd_ || !cq_)
    throw EngineError(strCat("verbs: cannot allocate a protection domain / CQ on ", device_.name));
  // Peers read region table entries straight from our arena header.
  header_mr_ = lib_->reg_mr(pd_, arena_.base(), Arena::kHeaderBytes, kAccess);
  scratch_.reset(new uint8_t[kScratchBytes]());
  scratch_mr_ = lib_->reg_mr(pd_, scratch_.get(), kScratchBytes, kAccess);
  if (!header_mr_ || !scratch_mr_)
    throw EngineError(strCat("verbs: ibv_reg_mr failed (", std::strerror(errno),
                             "); raise the locked-memory limit: ulimit -l unlimited (or memlock in "
                             "/etc/security/limits.conf)"));
  peers_.resize(world_size);
  psn_.resize(world_size);
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    struct ibv_qp_init_attr init = {};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 64;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    peers_[r].qp = lib_->create_qp(pd_, &init);
    if (!peers_[r].qp) throw EngineError(strCat("verbs: cannot create a queue pair for rank ", r));
    struct ibv_qp_attr attr = {};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = device_.port;
    attr.qp_access_flags = kAccess;
    modify(peers_[r].qp, attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
    uint32_t psn;
    getrandom(&psn, sizeof(psn), 0);
    psn_[r] = psn & 0xffffff;
  }
  // The liveness connection's listener (nothing flows on it after setup).
  listen_fd_ = listenTcp(options_.bind_host, &listen_port_);
}

VerbsTransport::~VerbsTransport() {
  shutdown();
  for (auto& [k, mr] : mrs_) lib_->dereg_mr(mr);
  if (scratch_mr_) lib_->dereg_mr(scratch_mr_);
  if (header_mr_) lib_->dereg_mr(header_mr_);
  if (cq_) lib_->destroy_cq(cq_);
  if (pd_) lib_->dealloc_pd(pd_);
  if (device_.ctx) lib_->close_device(device_.ctx);
}

void VerbsTransport::modify(struct ibv_qp* qp, struct ibv_qp_attr& attr, int mask, const char* state) {
  if (int rc = lib_->modify_qp(qp, &attr, mask); rc != 0)
    throw EngineError(strCat("verbs: moving a queue pair to ", state, " failed: ", std::strerror(rc)));
}

std::string VerbsTransport::localDescriptor() const {
  std::string qpns;
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_) qpns += strCat(";qpn", r, "=", peers_[r].qp->qp_num, ";psn", r, "=", psn_[r]);
  return strCat("verbs;device=", device_.name, ";gid=", hex(device_.gid.raw, 16),
                ";lid=", device_.port_attr.lid, qpns, ";base=", reinterpret_cast<uintptr_t>(arena_.base()),
                ";hdr_rkey=", header_mr_->rkey, ";host=", options_.advertise_host, ";port=", listen_port_);
}

void VerbsTransport::connect(const std::vector<std::string>& descriptors, const std::string& key,
                             const Deadline& deadline) {
  if (static_cast<int>(descriptors.size()) != world_size_)
    throw EngineError("verbs: need one descriptor per rank");
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const std::string& d = descriptors[r];
    Peer& p = peers_[r];
    p.arena_base = fieldNumber(d, "base");
    p.header_rkey = fieldNumber(d, "hdr_rkey", UINT32_MAX);
    struct ibv_qp_attr attr = {};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = device_.port_attr.active_mtu;
    attr.dest_qp_num = static_cast<uint32_t>(fieldNumber(d, strCat("qpn", rank_), 0xffffff));
    attr.rq_psn = static_cast<uint32_t>(fieldNumber(d, strCat("psn", rank_), 0xffffff));
    attr.max_dest_rd_atomic = 16;
    attr.min_rnr_timer = 12;
    attr.ah_attr.is_global = 1;
    unhex(field(d, "gid"), attr.ah_attr.grh.dgid.raw, 16);
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(device_.gid_index);
    attr.ah_attr.grh.hop_limit = 64;
    attr.ah_attr.dlid = static_cast<uint16_t>(fieldNumber(d, "lid", UINT16_MAX));
    attr.ah_attr.port_num = device_.port;
    modify(p.qp, attr,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
           "RTR");
    attr = {};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;   // 4.096 us * 2^14 = 67 ms per try
    attr.retry_cnt = 6;  // rxe treats 7 as "forever"
    attr.rnr_retry = 6;
    attr.sq_psn = psn_[r];
    attr.max_rd_atomic = 16;
    modify(p.qp, attr,
           IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
               IBV_QP_MAX_QP_RD_ATOMIC,
           "RTS");
  }
  // Liveness connections, authenticated: rank r connects to ranks below it, accepts those above.
  const HandshakeIdentity id{Link::kVerbs, rank_, world_size_, key, setup_watch_};
  for (int r = 0; r < rank_; ++r) {
    const std::string host = field(descriptors[r], "host"), port = field(descriptors[r], "port");
    peers_[r].sock =
        connectAuthenticated([&] { return connectTcp(host, port, deadline, r); }, id, r, 0, deadline);
  }
  acceptAuthenticated(
      listen_fd_, id, deadline,
      [&] {
        std::vector<int> left;
        for (int r = rank_ + 1; r < world_size_; ++r)
          if (peers_[r].sock < 0) left.push_back(r);
        return left;
      },
      [&](int rank, uint32_t channel) { return rank > rank_ && channel == 0 && peers_[rank].sock < 0; },
      [&](int fd, int rank, uint32_t, int) { peers_[rank].sock = fd; });
  closeFd(listen_fd_);
}

void VerbsTransport::fail(int peer, const std::string& why) {
  Peer& p = peers_[peer];
  if (!p.dead) p.why = why;
  p.dead = true;
}

void VerbsTransport::checkPeer(int peer) {
  if (peer < 0 || peer >= world_size_ || peer == rank_ || !peers_[peer].qp)
    throw EngineError(strCat("verbs: no connection to rank ", peer));
  Peer& p = peers_[peer];
  if (!p.dead && p.sock >= 0) {
    struct pollfd pfd = {p.sock, POLLIN | POLLRDHUP, 0};
    if (poll(&pfd, 1, 0) > 0) fail(peer, "exited or closed its connection");
  }
  if (p.dead) throw PeerError(strCat("rank ", peer, " ", p.why), peer);
}

VerbsTransport::Peer& VerbsTransport::live(int peer) {
  checkPeer(peer);
  return peers_[peer];
}

uint64_t VerbsTransport::registerMemory(const void* p, size_t n) {
  struct ibv_mr* mr = lib_->reg_mr(pd_, const_cast<void*>(p), std::max<size_t>(n, 1), kAccess);
  if (!mr)
    throw EngineError(strCat(
        "verbs: ibv_reg_mr of ", n, " bytes failed (", std::strerror(errno), ")",
        errno == ENOMEM || errno == EPERM ? "; raise the locked-memory limit: ulimit -l unlimited" : ""));
  std::lock_guard<std::mutex> lock(mr_mu_);
  mrs_[{reinterpret_cast<uintptr_t>(p), mr->rkey}] = mr;
  return mr->rkey;
}

void VerbsTransport::deregisterMemory(uint64_t rkey) {
  std::lock_guard<std::mutex> lock(mr_mu_);
  for (auto it = mrs_.begin(); it != mrs_.end(); ++it) {
    if (it->first.second == rkey) {
      lib_->dereg_mr(it->second);
      mrs_.erase(it);
      return;
    }
  }
}

uint32_t VerbsTransport::lkey(const void* p, size_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      std::lock_guard<std::mutex> lock(mr_mu_);
      auto it = mrs_.upper_bound({a, UINT32_MAX});
      for (int i = 0; i < 64 && it != mrs_.begin(); ++i) {
        --it;
        const struct ibv_mr* mr = it->second;
        const auto start = reinterpret_cast<uintptr_t>(mr->addr);
        if (a >= start && a + n <= start + mr->length) return mr->lkey;
      }
    }
    register_local_(p, n);  // registers (through registerMemory) and caches the range
  }
  throw EngineError("verbs: local buffer could not be registered");
}

RegionInfo VerbsTransport::remoteRegion(const char* op, int peer, uint64_t key, uint64_t offset,
                                        size_t length, const Deadline& deadline) {
  Peer& p = live(peer);
  auto it = p.regions.find(key);
  if (it == p.regions.end()) {
    const uint64_t slot = key >> 32;
    if (slot == 0 || slot > RegionTable::kCapacity) throwUnknownKey(op, peer, key);
    const uint64_t at = offsetof(RegionTable, entries) + (slot - 1) * sizeof(RegionEntry);
    auto* entry = reinterpret_cast<RegionEntry*>(scratch_.get() + 64);
    post(peer, IBV_WR_RDMA_READ, entry, scratch_mr_->lkey, sizeof(RegionEntry), p.arena_base + at,
         static_cast<uint32_t>(p.header_rkey), deadline);
    if (entry->key != key) throwUnknownKey(op, peer, key);
    it = p.regions
             .emplace(key, RegionInfo{static_cast<RegionKind>(entry->kind), entry->addr, entry->length,
                                      entry->rkey})
             .first;
  }
  checkBounds(op, peer, key, it->second.length, offset, length);
  return it->second;
}

uint64_t VerbsTransport::remoteAddress(int peer, const RegionInfo& info, uint64_t offset) const {
  return (info.kind == RegionKind::kArena ? peers_[peer].arena_base + info.addr : info.addr) + offset;
}

void VerbsTransport::post(int peer, enum ibv_wr_opcode opcode, void* local, uint32_t lkey, size_t length,
                          uint64_t raddr, uint32_t rkey, const Deadline& deadline) {
  struct ibv_sge sge = {reinterpret_cast<uintptr_t>(local), static_cast<uint32_t>(length), lkey};
  struct ibv_send_wr wr = {};
  wr.wr_id = next_wr_++;
  wr.sg_list = &sge;
  wr.num_sge = length ? 1 : 0;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  struct ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(peers_[peer].qp, &wr, &bad); rc != 0)
    throw EngineError(strCat("verbs: posting to rank ", peer, " failed: ", std::strerror(rc)));
  struct ibv_wc wc = {};
  for (uint64_t spins = 0;; ++spins) {
    const int n = ibv_poll_cq(cq_, 1, &wc);
    if (n < 0) throw EngineError("verbs: polling the completion queue failed");
    if (n == 1 && wc.wr_id == wr.wr_id) break;
    if ((spins & 1023) == 1023) {
      if (deadline.expired()) {
        fail(peer, "stopped answering (an RDMA operation timed out; the queue pair is no longer usable)");
        throw TimeoutError(strCat("verbs: timed out after ", deadline.seconds(), " s waiting for rank ", peer,
                                  " to complete an RDMA operation"));
      }
      checkPeer(peer);
    }
    cpuRelax();
  }
  if (wc.status != IBV_WC_SUCCESS) {
    const std::string what = lib_->wc_status_str(wc.status);
    if (wc.status == IBV_WC_REM_ACCESS_ERR)
      fail(peer, "refused a remote access (" + what + "); the queue pair is no longer usable");
    else
      fail(peer, "is unreachable (" + what + ")");
    throw PeerError(strCat("rank ", peer, " ", peers_[peer].why), peer);
  }
}

void VerbsTransport::write(int peer, const void* src, uint64_t key, uint64_t offset, size_t length,
                           const Deadline& deadline) {
  const uint32_t local_key = length ? lkey(src, length) : scratch_mr_->lkey;
  std::lock_guard<std::mutex> lock(op_mu_);
  const RegionInfo info = remoteRegion("write", peer, key, offset, length, deadline);
  if (length) {
    post(peer, IBV_WR_RDMA_WRITE, const_cast<void*>(src), local_key, length,
         remoteAddress(peer, info, offset), static_cast<uint32_t>(info.rkey), deadline);
  }
  countWrite(length);
}

void VerbsTransport::read(int peer, void* dst, uint64_t key, uint64_t offset, size_t length,
                          const Deadline& deadline) {
  const uint32_t local_key = length ? lkey(dst, length) : scratch_mr_->lkey;
  std::lock_guard<std::mutex> lock(op_mu_);
  const RegionInfo info = remoteRegion("read", peer, key, offset, length, deadline);
  if (length) {
    post(peer, IBV_WR_RDMA_READ, dst, local_key, length, remoteAddress(peer, info, offset),
         static_cast<uint32_t>(info.rkey), deadline);
  }
  countRead(length);
}

void VerbsTransport::writeFlag(int peer, uint64_t key, uint64_t offset, uint64_t value,
                               const Deadline& deadline) {
  checkFlagOffset(offset);
  std::lock_guard<std::mutex> lock(op_mu_);
  const RegionInfo info = remoteRegion("writeFlag", peer, key, offset, 8, deadline);
  std::memcpy(scratch_.get(), &value, 8);
  post(peer, IBV_WR_RDMA_WRITE, scratch_.get(), scratch_mr_->lkey, 8, remoteAddress(peer, info, offset),
       static_cast<uint32_t>(info.rkey), deadline);
  countFlag();
}

void VerbsTransport::flush(int peer, const Deadline&) {
  checkPeer(peer);  // every operation above waited for its completion
}

void VerbsTransport::shutdown() {
  for (auto& p : peers_) {
    if (p.qp) {
      lib_->destroy_qp(p.qp);
      p.qp = nullptr;
    }
    closeFd(p.sock);
  }
  closeFd(listen_fd_);
}

}  // namespace rdkeras
