// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the transport handshake.
//
// Written into the engine rather than taken from OpenSSL so the package builds
// and authenticates everywhere, with nothing optional missing. Checked against
// the FIPS 180-4 and RFC 4231 test vectors (csrc/tests) and against Python's
// hashlib (tests/unit). Not constant-time with respect to the *data* (no need:
// only the key is secret, and it is mixed in through HMAC's pads).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace rdkeras {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  Digest finish();  // the object is spent afterwards

 private:
  void compress(const uint8_t* block);

  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t length_ = 0;  // bytes hashed so far
};

class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t key_len);
  void update(const void* data, size_t n) { inner_.update(data, n); }
  Digest finish();

 private:
  Sha256 inner_, outer_;
};

Digest sha256(const void* data, size_t n);
Digest hmacSha256(const void* key, size_t key_len, const void* data, size_t n);
// Compares without an early exit, so the time taken says nothing about where they differ.
bool equalConstantTime(const void* a, const void* b, size_t n);

}  // namespace rdkeras
