#include "engine/channel.h"

#include <algorithm>
#include <cctype>
#include <cstring>

namespace rdkeras {
namespace {

constexpr size_t kFlagStride = 64;  // one cache line per flag

std::shared_ptr<Engine> checkPeerRank(std::shared_ptr<Engine> engine, int peer) {
  if (peer < 0 || peer >= engine->worldSize() || peer == engine->rank())
    throw EngineError(strCat("channel peer ", peer, " is not another rank of this world (size ",
                             engine->worldSize(), ", this rank ", engine->rank(), ")"));
  return engine;
}

}  // namespace

ChannelBase::ChannelBase(std::shared_ptr<Engine> engine, Role role, int peer, size_t control_bytes)
    : engine_(checkPeerRank(std::move(engine), peer)),
      role_(role),
      peer_(peer),
      block_(engine_->tracker(), control_bytes),  // flags start at 0
      local_(block_.data()) {}

std::string ChannelBase::localDescriptor() const {
  return strCat("channel;role=", role_ == Role::kSender ? "send" : "recv", ";rank=", engine_->rank(),
                ";key=", block_.key(), ";bytes=", block_.size());
}

void ChannelBase::connect(const std::string& remote) {
  const std::string want = role_ == Role::kSender ? "recv" : "send";
  if (field(remote, "role") != want || fieldNumber(remote, "rank") != static_cast<uint64_t>(peer_))
    throw EngineError(
        strCat("channel descriptor mismatch: expected the ", want, " end on rank ", peer_, ", got ", remote));
  remote_key_ = fieldNumber(remote, "key");
  if (remote_key_ == 0) throw EngineError("channel descriptor names no region (key 0)");
}

void ChannelBase::requireConnected(Role role, const char* op) const {
  if (role_ != role)
    throw EngineError(strCat(op, "() called on the ", role_ == Role::kSender ? "sending" : "receiving",
                             " end of a channel"));
  if (remote_key_ == 0) throw EngineError(strCat(op, "() before connect()"));
}

StaticChannel::StaticChannel(std::shared_ptr<Engine> engine, Role role, int peer, size_t nbytes)
    : ChannelBase(std::move(engine), role, peer,
                  role == Role::kReceiver ? 2 * roundUp(nbytes, 64) + 2 * kFlagStride : kFlagStride),
      nbytes_(nbytes),
      stride_(roundUp(nbytes, 64)) {}

void StaticChannel::send(const void* data, size_t n) {
  requireConnected(Role::kSender, "send");
  if (n != nbytes_)
    throw EngineError(strCat("static channel carries ", nbytes_, " bytes per message, got ", n,
                             " (use a dynamic channel for changing shapes)"));
  // The slot not holding message n-1 is free once message n-2 was released.
  if (seq_ >= 2) engine_->waitFlag(local_, seq_ - 1, peer_, "ack of a static channel slot");
  uint64_t slot = seq_ == 0 ? 0 : 1 - last_slot_;
  if (seq_ >= 1) {
    // Prefer the slot of message n-1 once it is released too: it is still in
    // this core's cache (docs/evaluation/design-choices.md has the measurement).
    // For large messages, give a receiver that is about to release it a moment.
    auto released = [&] { return loadAcquire(local_) >= seq_; };
    bool reuse = released();
    if (!reuse && n >= kReuseWaitBytes) {
      const auto until = Clock::now() + std::chrono::microseconds(2);
      while (!(reuse = released()) && Clock::now() < until) cpuRelax();
    }
    if (reuse) slot = last_slot_;
  }
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  t.write(peer_, data, remote_key_, slot * stride_, n, deadline);
  t.writeFlag(peer_, remote_key_, 2 * stride_ + slot * kFlagStride, seq_ + 1, deadline);
  last_slot_ = slot;
  ++seq_;
}

const void* StaticChannel::recv() {
  requireConnected(Role::kReceiver, "recv");
  const Deadline deadline = engine_->deadline();
  // Release the previous message: the sender may now reuse its slot.
  if (seq_ > 0) engine_->transport().writeFlag(peer_, remote_key_, 0, seq_, deadline);
  // Message n is in whichever slot's flag reads n+1 (flags only grow).
  const uint8_t* flags = local_ + 2 * stride_;
  uint64_t slot = 0;
  engine_->wait(
      [&] {
        for (slot = 0; slot < 2; ++slot)
          if (loadAcquire(flags + slot * kFlagStride) == seq_ + 1) return true;
        return false;
      },
      peer_, "static channel message");
  ++seq_;
  engine_->countReceived(nbytes());
  return local_ + slot * stride_;
}

// The sender's block: [ack word | the record being sent] -- the record is written
// from registered memory, as RDMA requires of a source.
DynamicChannel::DynamicChannel(std::shared_ptr<Engine> engine, Role role, int peer)
    : ChannelBase(std::move(engine), role, peer,
                  role == Role::kReceiver ? 2 * sizeof(DynamicRecord) : kFlagStride + sizeof(DynamicRecord)) {
}

uint64_t DynamicChannel::send(const void* data, const TensorMeta& meta) {
  requireConnected(Role::kSender, "send");
  if (meta.shape.size() > kMaxDims) throw EngineError(strCat("tensors of rank > ", kMaxDims, " unsupported"));
  if (meta.dtype.size() >= sizeof(DynamicRecord::dtype)) throw EngineError("dtype string too long");
  // Metadata slot n%2 is free once the receiver consumed record n-2.
  if (seq_ >= 2) engine_->waitFlag(local_, seq_ - 1, peer_, "ack of a dynamic channel record");
  DynamicRecord& rec = *reinterpret_cast<DynamicRecord*>(local_ + kFlagStride);
  rec = DynamicRecord{};
  std::memcpy(rec.dtype, meta.dtype.data(), meta.dtype.size());
  rec.ndim = static_cast<uint32_t>(meta.shape.size());
  std::copy(meta.shape.begin(), meta.shape.end(), rec.shape);
  rec.nbytes = meta.nbytes;
  if (meta.nbytes > 0) {
    auto [key, offset] = engine_->tracker().lookupOrRegister(data, meta.nbytes);
    rec.src_key = key;
    rec.src_offset = offset;
  }
  Transport& t = engine_->transport();
  const Deadline deadline = engine_->deadline();
  const uint64_t base = (seq_ % 2) * sizeof(DynamicRecord);
  t.write(peer_, reinterpret_cast<const uint8_t*>(&rec) + 8, remote_key_, base + 8, sizeof(rec) - 8,
          deadline);
  t.writeFlag(peer_, remote_key_, base, seq_ + 1, deadline);
  return seq_++;
}

uint64_t DynamicChannel::acked() const { return loadAcquire(local_); }

StaticChannel::~StaticChannel() {
  // The receiver releases message n-1 when it starts to receive message n: the last release it
  // writes is seq_ - 1, possibly after it has the last message -- and after this side is done.
  if (role_ == Role::kSender && seq_ >= 2) engine_->settleFlag(local_, seq_ - 1, peer_);
}

DynamicChannel::~DynamicChannel() {
  if (role_ == Role::kSender) engine_->settleFlag(local_, seq_, peer_);
}

void DynamicChannel::waitAcked(uint64_t count) {
  engine_->waitFlag(local_, count, peer_, "ack of a dynamic channel tensor");
}

void* DynamicChannel::recv(TensorMeta* meta) {
  requireConnected(Role::kReceiver, "recv");
  auto* rec = reinterpret_cast<DynamicRecord*>(local_ + (seq_ % 2) * sizeof(DynamicRecord));
  engine_->waitFlag(&rec->flag, seq_ + 1, peer_, "dynamic channel metadata");
  std::string why;
  if (!parseRecord(*rec, meta, &why))
    throw EngineError(strCat("rank ", peer_, " sent a malformed dynamic-channel record: ", why));
  TensorTracker& tracker = engine_->tracker();
  void* dst = tracker.allocate(rec->nbytes);
  const Deadline deadline = engine_->deadline();
  try {
    if (rec->nbytes) {
      Transport& t = engine_->transport();
      tracker.registerLocal(dst, rec->nbytes);  // the destination of a read, as verbs requires
      t.read(peer_, dst, rec->src_key, rec->src_offset, rec->nbytes, deadline);
    }
    engine_->transport().writeFlag(peer_, remote_key_, 0, seq_ + 1, deadline);
  } catch (...) {
    tracker.release(dst);
    throw;
  }
  ++seq_;
  engine_->countReceived(rec->nbytes);
  return dst;
}

bool parseRecord(const DynamicRecord& rec, TensorMeta* meta, std::string* why) {
  const size_t len = strnlen(rec.dtype, sizeof(rec.dtype));
  const std::string dtype(rec.dtype, len);
  auto fail = [&](std::string w) {
    *why = std::move(w);
    return false;
  };
  if (len == sizeof(rec.dtype)) return fail("its dtype is not terminated");
  // [<>|=] letter digits [optional "[unit]"]: what numpy's dtype.str looks like.
  size_t i = 0;
  if (len < 3 || std::strchr("<>|=", dtype[0]) == nullptr ||
      !std::isalpha(static_cast<unsigned char>(dtype[1])))
    return fail(strCat("its dtype '", dtype, "' is not a numpy type string"));
  uint64_t itemsize = 0;
  for (i = 2; i < len && std::isdigit(static_cast<unsigned char>(dtype[i])); ++i) {
    itemsize = itemsize * 10 + (dtype[i] - '0');
    if (itemsize > (1 << 20)) return fail(strCat("its dtype '", dtype, "' has an absurd item size"));
  }
  if (i == 2 || itemsize == 0) return fail(strCat("its dtype '", dtype, "' has no item size"));
  if (dtype[1] == 'U') itemsize *= 4;  // numpy counts unicode strings in characters of 4 bytes
  if (i < len) {
    if (dtype[i] != '[' || dtype[len - 1] != ']') return fail(strCat("its dtype '", dtype, "' is malformed"));
    for (size_t j = i + 1; j + 1 < len; ++j)
      if (!std::isalnum(static_cast<unsigned char>(dtype[j])))
        return fail(strCat("its dtype '", dtype, "' is malformed"));
  }
  if (rec.ndim > DynamicChannel::kMaxDims)
    return fail(strCat("its rank is ", rec.ndim, " (at most ", DynamicChannel::kMaxDims, ")"));
  uint64_t elements = 1;
  for (uint32_t d = 0; d < rec.ndim; ++d) {
    if (rec.shape[d] < 0) return fail(strCat("dimension ", d, " is ", rec.shape[d]));
    const auto extent = static_cast<uint64_t>(rec.shape[d]);
    if (extent && elements > UINT64_MAX / extent) return fail("its shape overflows");
    elements *= extent;
  }
  if (elements > UINT64_MAX / itemsize || elements * itemsize != rec.nbytes)
    return fail(strCat("its shape and dtype make ", elements, " x ", itemsize, " bytes, but it announces ",
                       rec.nbytes));
  if (rec.nbytes && rec.src_key == 0) return fail("it names no source region");
  meta->dtype = dtype;
  meta->shape.assign(rec.shape, rec.shape + rec.ndim);
  meta->nbytes = rec.nbytes;
  return true;
}

}  // namespace rdkeras
