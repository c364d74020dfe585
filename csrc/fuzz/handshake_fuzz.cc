// libFuzzer target: the handshake's four messages as a hostile peer may send them.
// Decoding must never read past the input, and a decoded message must encode back to the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "engine/handshake.h"

using namespace rdkeras;
using namespace rdkeras::handshake;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Hello h;
  if (decode(data, size, &h)) {
    const auto again = encode(h);
    if (std::memcmp(again.data(), data, kHelloBytes) != 0) __builtin_trap();
    // What a server computes for any hello it accepts: must not crash for any field values.
    const std::string key(kKeyBytes, 'k');
    if (serverMac(key, again.data(), h.nonce) == clientMac(key, again.data(), h.nonce)) __builtin_trap();
  }
  Challenge c;
  if (decode(data, size, &c)) {
    const auto again = encode(c);
    if (std::memcmp(again.data(), data, kChallengeBytes) != 0) __builtin_trap();
  }
  Digest mac;
  if (decodeProof(data, size, &mac) && std::memcmp(encodeProof(mac).data(), data, kProofBytes) != 0)
    __builtin_trap();
  uint32_t status;
  if (decodeWelcome(data, size, &status) &&
      std::memcmp(encodeWelcome(status).data(), data, kWelcomeBytes) != 0)
    __builtin_trap();
  return 0;
}
