#include "transport/verbs/verbs_lib.h"

#include <dlfcn.h>

#include <mutex>

#include "engine/common.h"

namespace rdkeras {

const VerbsLib* VerbsLib::load(std::string* why) {
  static VerbsLib lib;
  static std::string error;
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      error = strCat("libibverbs.so.1 cannot be loaded (", dlerror(),
                     "); install rdma-core: apt install libibverbs1 ibverbs-providers");
      return;
    }
    bool all = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) {
        all = false;
        error = strCat("libibverbs.so.1 has no ", name);
      }
    };
    sym(lib.get_device_list, "ibv_get_device_list");
    sym(lib.free_device_list, "ibv_free_device_list");
    sym(lib.get_device_name, "ibv_get_device_name");
    sym(lib.open_device, "ibv_open_device");
    sym(lib.close_device, "ibv_close_device");
    sym(lib.query_port, "ibv_query_port");
    sym(lib.query_gid, "ibv_query_gid");
    sym(lib.alloc_pd, "ibv_alloc_pd");
    sym(lib.dealloc_pd, "ibv_dealloc_pd");
    sym(lib.reg_mr, "ibv_reg_mr");
    sym(lib.dereg_mr, "ibv_dereg_mr");
    sym(lib.create_cq, "ibv_create_cq");
    sym(lib.destroy_cq, "ibv_destroy_cq");
    sym(lib.create_qp, "ibv_create_qp");
    sym(lib.destroy_qp, "ibv_destroy_qp");
    sym(lib.modify_qp, "ibv_modify_qp");
    sym(lib.wc_status_str, "ibv_wc_status_str");
    ok = all;
  });
  if (!ok && why) *why = error;
  return ok ? &lib : nullptr;
}

}  // namespace rdkeras
