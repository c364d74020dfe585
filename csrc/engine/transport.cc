#include "engine/transport.h"

namespace rdkeras {

void checkFlagOffset(uint64_t offset) {
  if (offset % 8 != 0) throw RemoteAccessError(strCat("flag offset ", offset, " is not 8-byte aligned"));
}

void checkBounds(const char* op, int peer, uint64_t key, uint64_t region_length, uint64_t offset,
                 uint64_t length) {
  if (offset > region_length || length > region_length - offset) {
    throw RemoteAccessError(strCat(op, " of ", length, " bytes at offset ", offset,
                                   " is out of bounds of rank ", peer, "'s region 0x", std::hex, key,
                                   std::dec, " (", region_length, " bytes)"));
  }
}

void throwUnknownKey(const char* op, int peer, uint64_t key) {
  throw RemoteAccessError(strCat(op, ": rank ", peer, " has no region with key 0x", std::hex, key, std::dec,
                                 " (stale: deregistered, or never registered)"));
}

uint64_t fieldNumber(const std::string& descriptor, const std::string& key, uint64_t max) {
  const std::string text = field(descriptor, key);
  uint64_t v = 0;
  bool ok = !text.empty() && text.size() <= 20;
  for (char c : text) {
    if (c < '0' || c > '9' || v > (UINT64_MAX - (c - '0')) / 10) {
      ok = false;
      break;
    }
    v = v * 10 + (c - '0');
  }
  if (!ok || v > max)
    throw EngineError(
        strCat("malformed descriptor: '", key, "' is '", text.substr(0, 40), "', not a number up to ", max));
  return v;
}

std::string field(const std::string& descriptor, const std::string& key) {
  const std::string needle = ";" + key + "=";
  const size_t at = descriptor.find(needle);
  if (at == std::string::npos)
    throw EngineError(strCat("malformed transport descriptor (no '", key, "'): ", descriptor));
  const size_t begin = at + needle.size();
  const size_t end = descriptor.find(';', begin);
  return descriptor.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

}  // namespace rdkeras
