// The table of C functions through which rdkeras's TensorFlow ops (rdma_ops.cc) reach the engine's
// channels. Plain C on purpose: the ops library is compiled against TensorFlow's headers and ABI, the
// engine module against pybind11's; neither links the other, so they share nothing but this table, whose
// address the engine module hands to Python (rdkeras._engine.op_api()) and Python to each op (an attr).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RDKERAS_OP_API_VERSION 1

typedef struct RdkerasOpApi {
  uint32_t version;  // RDKERAS_OP_API_VERSION
  // Every function returns 0, or -1 with a NUL-terminated message (root cause named) in `err`.
  // Sends `n` bytes from `data` over static channel `channel` (a handle from StaticChannel.op_handle):
  // one remote write into the receiver's slot, then its flag.
  int (*send)(uint64_t channel, const void* data, size_t n, char* err, size_t errlen);
  // Waits for the channel's next message: `*data` points into its slot (valid and unchanged until the next
  // recv on the channel), `*n` is its size, and `*keep` holds the channel alive until release(*keep).
  int (*recv)(uint64_t channel, const void** data, size_t* n, void** keep, char* err, size_t errlen);
  void (*release)(void* keep);
} RdkerasOpApi;

#ifdef __cplusplus
}
#endif
