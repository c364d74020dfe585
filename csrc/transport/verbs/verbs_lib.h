// libibverbs, opened at run time: the package builds, imports and runs where
// rdma-core is absent, and `transport="verbs"` then says why it is not viable.
// Types come from <infiniband/verbs.h> (build time only); the exported
// functions are resolved with dlsym, and the data-path calls (ibv_post_send,
// ibv_poll_cq) are the header's inline dispatch through the context's ops.
#pragma once

#include <infiniband/verbs.h>

#include <string>

namespace rdkeras {

// Every libibverbs function the transport calls, written once: X(name, return type, arguments).
// It declares VerbsLib's members and drives dlsym("ibv_" name) in load().
#define RDKERAS_IBV_FUNCTIONS(X)                                                               \
  X(get_device_list, struct ibv_device**, int*)                                                \
  X(free_device_list, void, struct ibv_device**)                                               \
  X(get_device_name, const char*, struct ibv_device*)                                          \
  X(open_device, struct ibv_context*, struct ibv_device*)                                      \
  X(close_device, int, struct ibv_context*)                                                    \
  X(query_port, int, struct ibv_context*, uint8_t, struct ibv_port_attr*)                      \
  X(query_gid, int, struct ibv_context*, uint8_t, int, union ibv_gid*)                         \
  X(alloc_pd, struct ibv_pd*, struct ibv_context*)                                             \
  X(dealloc_pd, int, struct ibv_pd*)                                                           \
  X(reg_mr, struct ibv_mr*, struct ibv_pd*, void*, size_t, int)                                \
  X(dereg_mr, int, struct ibv_mr*)                                                             \
  X(create_cq, struct ibv_cq*, struct ibv_context*, int, void*, struct ibv_comp_channel*, int) \
  X(destroy_cq, int, struct ibv_cq*)                                                           \
  X(create_qp, struct ibv_qp*, struct ibv_pd*, struct ibv_qp_init_attr*)                       \
  X(destroy_qp, int, struct ibv_qp*)                                                           \
  X(modify_qp, int, struct ibv_qp*, struct ibv_qp_attr*, int)                                  \
  X(wc_status_str, const char*, enum ibv_wc_status)

struct VerbsLib {
#define RDKERAS_IBV_MEMBER(name, ret, ...) ret (*name)(__VA_ARGS__);
  RDKERAS_IBV_FUNCTIONS(RDKERAS_IBV_MEMBER)
#undef RDKERAS_IBV_MEMBER

  // The loaded library, or nullptr with `why` set.
  static const VerbsLib* load(std::string* why);
};

}  // namespace rdkeras
