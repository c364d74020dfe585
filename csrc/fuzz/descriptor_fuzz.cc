// libFuzzer target: descriptor text as it arrives through the rendezvous store.
// field/fieldNumber either return what is there or throw EngineError -- nothing else.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/common.h"
#include "engine/transport.h"

using namespace rdkeras;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const char* key : {"host", "port", "key", "rank", "abort_key", "qpn1", "base", "gid"}) {
    try {
      const std::string value = field(text, key);
      if (value.find(';') != std::string::npos) __builtin_trap();  // a field ends at the next ';'
    } catch (const EngineError&) {
    }
    try {
      const uint64_t v = fieldNumber(text, key, 1u << 24);
      std::string digits = field(text, key);
      digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));  // "007" is 7
      if (v > (1u << 24) || std::to_string(v) != digits) __builtin_trap();
    } catch (const EngineError&) {
    }
  }
  return 0;
}
