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
#define RDKERAS_IBV_LOAD(name, ...) sym(lib.name, "ibv_" #name);
    RDKERAS_IBV_FUNCTIONS(RDKERAS_IBV_LOAD)
#undef RDKERAS_IBV_LOAD
    ok = all;
  });
  if (!ok && why) *why = error;
  return ok ? &lib : nullptr;
}

}  // namespace rdkeras
