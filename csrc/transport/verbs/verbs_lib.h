// libibverbs, opened at run time: the package builds, imports and runs where
// rdma-core is absent, and `transport="verbs"` then says why it is not viable.
// Types come from <infiniband/verbs.h> (build time only); the exported
// functions are resolved with dlsym, and the data-path calls (ibv_post_send,
// ibv_poll_cq) are the header's inline dispatch through the context's ops.
#pragma once

#include <infiniband/verbs.h>

#include <string>

namespace rdkeras {

struct VerbsLib {
  struct ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(struct ibv_device**);
  const char* (*get_device_name)(struct ibv_device*);
  struct ibv_context* (*open_device)(struct ibv_device*);
  int (*close_device)(struct ibv_context*);
  int (*query_port)(struct ibv_context*, uint8_t, struct ibv_port_attr*);
  int (*query_gid)(struct ibv_context*, uint8_t, int, union ibv_gid*);
  struct ibv_pd* (*alloc_pd)(struct ibv_context*);
  int (*dealloc_pd)(struct ibv_pd*);
  struct ibv_mr* (*reg_mr)(struct ibv_pd*, void*, size_t, int);
  int (*dereg_mr)(struct ibv_mr*);
  struct ibv_cq* (*create_cq)(struct ibv_context*, int, void*, struct ibv_comp_channel*, int);
  int (*destroy_cq)(struct ibv_cq*);
  struct ibv_qp* (*create_qp)(struct ibv_pd*, struct ibv_qp_init_attr*);
  int (*destroy_qp)(struct ibv_qp*);
  int (*modify_qp)(struct ibv_qp*, struct ibv_qp_attr*, int);
  const char* (*wc_status_str)(enum ibv_wc_status);

  // The loaded library, or nullptr with `why` set.
  static const VerbsLib* load(std::string* why);
};

}  // namespace rdkeras
