#include "engine/op_channels.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "engine/common.h"

namespace rdkeras {
namespace {

std::mutex mu;
uint64_t next_handle = 1;
std::unordered_map<uint64_t, std::weak_ptr<StaticChannel>> by_handle;
std::unordered_map<const StaticChannel*, uint64_t> handle_of;

std::shared_ptr<StaticChannel> lookup(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = by_handle.find(handle);
  if (it == by_handle.end()) throw EngineError(strCat("no static channel has op handle ", handle));
  auto channel = it->second.lock();
  if (!channel) {
    by_handle.erase(it);
    throw EngineError("the static channel of this op was closed (its strategy or engine is gone)");
  }
  return channel;
}

void report(const std::exception& e, char* err, size_t errlen) {
  if (errlen == 0) return;
  const size_t n = std::min(std::strlen(e.what()), errlen - 1);
  std::memcpy(err, e.what(), n);
  err[n] = '\0';
}

// Runs `f` on the channel of `handle`; a failure leaves as its root cause, as the Python binding's does
// (the rank that failed first, told to every other rank).
template <typename F>
int run(uint64_t handle, char* err, size_t errlen, F&& f) {
  try {
    auto channel = lookup(handle);
    Engine& engine = *channel->engine();
    try {
      f(channel);
    } catch (const PeerError& e) {
      throw engine.rootCause(e, channel->peer());
    } catch (const EngineError&) {
      engine.checkPeerFailure();
      throw;
    }
    return 0;
  } catch (const std::exception& e) {
    report(e, err, errlen);
    return -1;
  }
}

int send(uint64_t handle, const void* data, size_t n, char* err, size_t errlen) {
  return run(handle, err, errlen, [&](const std::shared_ptr<StaticChannel>& ch) {
    if (n != ch->nbytes())
      throw EngineError(strCat("static channel carries ", ch->nbytes(), " bytes, the op sent ", n));
    ch->send(data, n);
  });
}

int recv(uint64_t handle, const void** data, size_t* n, void** keep, char* err, size_t errlen) {
  return run(handle, err, errlen, [&](const std::shared_ptr<StaticChannel>& ch) {
    *data = ch->recv();
    *n = ch->nbytes();
    *keep = new std::shared_ptr<StaticChannel>(ch);
  });
}

void release(void* keep) { delete static_cast<std::shared_ptr<StaticChannel>*>(keep); }

const RdkerasOpApi api = {RDKERAS_OP_API_VERSION, send, recv, release};

}  // namespace

uint64_t opHandle(const std::shared_ptr<StaticChannel>& channel) {
  std::lock_guard<std::mutex> lock(mu);
  for (auto known = by_handle.begin(); known != by_handle.end();) {  // forget closed channels
    if (known->second.expired())
      known = by_handle.erase(known);
    else
      ++known;
  }
  auto it = handle_of.find(channel.get());
  if (it != handle_of.end()) {
    auto known = by_handle.find(it->second);
    if (known != by_handle.end() && known->second.lock() == channel) return it->second;
  }
  const uint64_t handle = next_handle++;
  by_handle[handle] = channel;
  handle_of[channel.get()] = handle;
  return handle;
}

const RdkerasOpApi* opApi() { return &api; }

}  // namespace rdkeras
