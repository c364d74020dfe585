// Which RDMA device, port and GID the verbs transport uses: chosen apart from the transport, through a
// VerbsLib, so that the choice is tested with a fake library where no device exists
// (csrc/tests/verbs_device_test.cc).
#pragma once

#include <cstdint>
#include <string>

#include "engine/transport.h"
#include "transport/verbs/verbs_lib.h"

namespace rdkeras {

// Why verbs cannot run on a host without an RDMA device, and how to make one for a test.
extern const char kNoRdmaDevice[];

// An opened device and the port and GID used on it. The caller closes ctx (close_device).
struct VerbsDevice {
  struct ibv_context* ctx = nullptr;
  std::string name;
  uint8_t port = 1;
  struct ibv_port_attr port_attr = {};
  int gid_index = 0;
  union ibv_gid gid = {};
};

// Opens options.ib_device (empty: the first device with an active port) and takes options.ib_port
// (0: the first active one of ports 1 and 2) and GID options.ib_gid_index on it. Throws EngineError
// naming the devices it saw and the variables that choose them, having closed what it opened.
VerbsDevice openVerbsDevice(const VerbsLib& lib, const TransportOptions& options);

}  // namespace rdkeras
