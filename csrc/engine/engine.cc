#include "engine/engine.h"

#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"
#ifdef RDKERAS_WITH_VERBS
#include "transport/verbs/verbs_transport.h"
#endif

namespace rdkeras {

std::vector<std::string> nativeTransports() {
#ifdef RDKERAS_WITH_VERBS
  return {"shm", "tcp", "verbs"};
#else
  return {"shm", "tcp"};
#endif
}

std::string verbsWhyNotViable() {
#ifdef RDKERAS_WITH_VERBS
  return VerbsTransport::whyNotViable();
#else
  return "this build of rdkeras has no verbs transport (it was built without rdma-core's headers: "
         "apt install libibverbs-dev, then reinstall rdkeras)";
#endif
}

Engine::Engine(int rank, int world_size, const EngineOptions& options)
    : rank_(rank), world_size_(world_size), options_(options) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw EngineError(strCat("invalid rank ", rank, " for world size ", world_size));
  if (!(options.timeout_s > 0)) throw EngineError("timeout must be positive");
  arena_ = std::make_unique<Arena>(options.arena_bytes);
  tracker_ = std::make_unique<TensorTracker>(*arena_);
  if (options.transport == "shm")
    transport_ = std::make_unique<ShmTransport>(rank, world_size, *arena_, options.transport_options);
  else if (options.transport == "tcp")
    transport_ = std::make_unique<TcpTransport>(rank, world_size, *arena_, options.transport_options);
#ifdef RDKERAS_WITH_VERBS
  else if (options.transport == "verbs") {
    auto verbs =
        std::make_unique<VerbsTransport>(rank, world_size, *arena_, *tracker_, options.transport_options);
    tracker_->setRegistrar(verbs.get());  // every registration becomes an ibv_reg_mr
    transport_ = std::move(verbs);
  }
#endif
  else
    throw EngineError(strCat("unknown or unavailable native transport '", options.transport, "'"));
}

Engine::~Engine() { close(); }

void Engine::connect(const std::vector<std::string>& descriptors, const std::string& key) {
  if (connected_) throw EngineError("engine already connected");
  transport_->connect(descriptors, key, deadline());
  connected_ = true;
}

void Engine::close() {
  if (closed_) return;
  closed_ = true;
  if (transport_) transport_->shutdown();
}

Transport& Engine::transport() {
  if (!connected_ || closed_) throw EngineError(closed_ ? "engine is closed" : "engine is not connected");
  return *transport_;
}

void Engine::waitFlag(const void* flag, uint64_t value, int peer, const char* what) {
  wait([&] { return loadAcquire(flag) >= value; }, peer, what);
}

void Engine::wait(const std::function<bool()>& ready, int peer, const char* what) {
  Transport& t = transport();
  if (ready()) return;
  const Deadline deadline = this->deadline();
  const auto start = Clock::now();
  const bool ok = pollUntil(ready, deadline, [&] { t.checkPeer(peer); });
  wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count(),
                     std::memory_order_relaxed);
  if (!ok)
    throw TimeoutError(
        strCat("timed out after ", deadline.seconds(), " s waiting for rank ", peer, " (", what, ")"));
}

}  // namespace rdkeras
