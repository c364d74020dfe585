// Channels: one cut edge of the training graph, one direction, one peer.
//
// StaticChannel -- shape and dtype known in advance. The receiver owns a
// registered, double-buffered destination: [slot 0 | slot 1 | flag 0 | flag 1].
// The sender writes message n into a free slot s, then flag s := n+1 (ordered
// after the data). The receiver polls both flags for n+1 and hands out the slot
// in place; on its next recv() it acks (one-sided write into the sender's ack
// word: "n messages released"). The sender writes into the slot of message n-1
// when that one is already released (still warm in its cache), otherwise into
// the other, which the ack of message n-2 freed. So the sender never
// overwrites unread data and is at most one message ahead.
//
// DynamicChannel -- shape known only at run time. The sender writes a
// metadata record (dtype, shape, bytes, source key/offset) into the receiver's
// slot n%2 and sets its flag; the receiver allocates from the tracker, does a
// one-sided read of the source and acks, after which the source may be reused.
//
// Both ends exchange descriptor text once (localDescriptor -> connect).
// A channel is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace rdkeras {

enum class Role { kSender, kReceiver };

class ChannelBase {
 public:
  ChannelBase(std::shared_ptr<Engine> engine, Role role, int peer, size_t control_bytes);
  virtual ~ChannelBase() = default;
  ChannelBase(const ChannelBase&) = delete;
  ChannelBase& operator=(const ChannelBase&) = delete;

  std::string localDescriptor() const;
  void connect(const std::string& remote_descriptor);
  Role role() const { return role_; }
  int peer() const { return peer_; }
  uint64_t sequence() const { return seq_; }  // messages sent or received so far
  const std::shared_ptr<Engine>& engine() const { return engine_; }

 protected:
  void requireConnected(Role role, const char* op) const;

  std::shared_ptr<Engine> engine_;
  Role role_;
  int peer_;
  RegisteredBlock block_;  // receiver slots+flags, or sender ack word
  uint8_t* local_;         // block_.data()
  uint64_t remote_key_ = 0;
  uint64_t seq_ = 0;
};

class StaticChannel : public ChannelBase {
 public:
  // From this size on, send() waits up to 2 us for the warm slot to be released.
  static constexpr size_t kReuseWaitBytes = 2 << 20;

  StaticChannel(std::shared_ptr<Engine> engine, Role role, int peer, size_t nbytes);
  // A sender waits (a few seconds at most) for the receiver's release of the last-but-one message.
  ~StaticChannel() override;

  size_t nbytes() const { return nbytes_; }
  // Sender: copies `nbytes` bytes into the receiver's slot (one remote write).
  void send(const void* data, size_t n);
  // Receiver: waits for the next message; the memory stays valid and
  // unchanged until the next recv() on this channel.
  const void* recv();

 private:
  size_t nbytes_;
  size_t stride_;
  uint64_t last_slot_ = 0;
};

struct TensorMeta {
  std::string dtype;  // numpy dtype string, e.g. "<f4"
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
};

class DynamicChannel : public ChannelBase {
 public:
  static constexpr int kMaxDims = 16;

  DynamicChannel(std::shared_ptr<Engine> engine, Role role, int peer);
  // A sender waits (a few seconds at most) for the receiver's last acks: they are one-sided
  // writes into this channel's block, which must stay registered until they landed.
  ~DynamicChannel() override;

  // Sender: publishes the tensor; returns its sequence number. `data` must
  // stay valid and unchanged until acked() > that number.
  uint64_t send(const void* data, const TensorMeta& meta);
  // Messages whose source the receiver has finished reading.
  uint64_t acked() const;
  void waitAcked(uint64_t count);
  // Receiver: the next tensor, in a tracker block the caller must release().
  void* recv(TensorMeta* meta);
};

// The receiver-side copy of a metadata slot (written by the peer: checked before use).
struct alignas(64) DynamicRecord {
  uint64_t flag;  // n+1 once record n is complete; written last
  char dtype[16];
  uint32_t ndim;
  uint32_t reserved;
  int64_t shape[DynamicChannel::kMaxDims];
  uint64_t nbytes;
  uint64_t src_key;
  uint64_t src_offset;
};

// Reads a record a peer wrote: false (with *why) unless the dtype is a numpy type string
// ("<f4", "|b1", "<M8[ns]"...), the rank is at most kMaxDims, no dimension is negative and
// the shape times the item size is exactly nbytes.
bool parseRecord(const DynamicRecord& rec, TensorMeta* meta, std::string* why);

}  // namespace rdkeras
