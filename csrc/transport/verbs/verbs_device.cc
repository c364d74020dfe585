#include "transport/verbs/verbs_device.h"

#include "engine/common.h"

namespace rdkeras {

const char kNoRdmaDevice[] =
    "no RDMA device (for SoftRoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <interface>)";

VerbsDevice openVerbsDevice(const VerbsLib& lib, const TransportOptions& options) {
  int n = 0;
  struct ibv_device** list = lib.get_device_list(&n);
  if (!list || n <= 0) {
    if (list) lib.free_device_list(list);
    throw EngineError(strCat("transport 'verbs' is not viable: ", kNoRdmaDevice));
  }
  const std::string& want = options.ib_device;
  const int first_port = options.ib_port > 0 ? options.ib_port : 1;
  const int last_port = options.ib_port > 0 ? options.ib_port : 2;
  VerbsDevice chosen;
  std::string seen;
  for (int i = 0; i < n && !chosen.ctx; ++i) {
    const std::string name = lib.get_device_name(list[i]);
    seen += (seen.empty() ? "" : ", ") + name;
    if (!want.empty() && name != want) continue;
    struct ibv_context* ctx = lib.open_device(list[i]);
    if (!ctx) continue;
    for (int port = first_port; port <= last_port; ++port) {
      struct ibv_port_attr attr = {};
      if (lib.query_port(ctx, static_cast<uint8_t>(port), &attr) == 0 && attr.state == IBV_PORT_ACTIVE) {
        chosen.ctx = ctx;
        chosen.name = name;
        chosen.port = static_cast<uint8_t>(port);
        chosen.port_attr = attr;
        break;
      }
    }
    if (!chosen.ctx) lib.close_device(ctx);
  }
  lib.free_device_list(list);
  if (!chosen.ctx)
    throw EngineError(strCat("verbs: no active port", options.ib_port > 0 ? strCat(" ", options.ib_port) : "",
                             " on ", want.empty() ? "any device" : want, " (devices: ", seen,
                             "); set RDKERAS_IB_DEVICE / RDKERAS_IB_PORT"));
  chosen.gid_index = options.ib_gid_index;
  if (lib.query_gid(chosen.ctx, chosen.port, chosen.gid_index, &chosen.gid) != 0) {
    lib.close_device(chosen.ctx);
    throw EngineError(strCat("verbs: cannot read GID index ", chosen.gid_index, " of ", chosen.name, " port ",
                             int(chosen.port)));
  }
  return chosen;
}

}  // namespace rdkeras
