#include "bench/bench_loops.h"

#include <algorithm>

#include "engine/tensor_tracker.h"

namespace rdkeras::bench {

double pingPong(StaticChannel& tx, StaticChannel& rx, int iterations, bool initiator) {
  // The message lives in registered memory, as an RDMA source must.
  RegisteredBlock block(tx.engine()->tracker(), std::max<size_t>(tx.nbytes(), 1));
  struct Span {
    uint8_t* p;
    size_t n;
    const uint8_t* data() const { return p; }
    size_t size() const { return n; }
  } msg{block.data(), tx.nbytes()};
  const auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    if (initiator) {
      tx.send(msg.data(), msg.size());
      rx.recv();
    } else {
      rx.recv();
      tx.send(msg.data(), msg.size());
    }
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double sendMany(StaticChannel& tx, const void* data, int iterations) {
  const auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) tx.send(data, tx.nbytes());
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double recvMany(StaticChannel& rx, int iterations) {
  const auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) rx.recv();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace rdkeras::bench
