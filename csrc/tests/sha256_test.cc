// SHA-256 against FIPS 180-4's examples, HMAC-SHA256 against RFC 4231's test cases.
#include "engine/sha256.h"

#include <doctest/doctest.h>

#include <string>

using namespace rdkeras;

namespace {

std::string hex(const Digest& d, size_t n = 32) {
  static const char* k = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += {k[d[i] >> 4], k[d[i] & 15]};
  return s;
}

std::string repeat(char c, size_t n) { return std::string(n, c); }

}  // namespace

TEST_CASE("sha256 matches the FIPS 180-4 examples") {
  CHECK(hex(sha256("", 0)) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(sha256("abc", 3)) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  CHECK(hex(sha256(two_blocks.data(), two_blocks.size())) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million = repeat('a', 1000000);
  CHECK(hex(sha256(million.data(), million.size())) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("sha256 gives the same digest however the input is split") {
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 7));
  const Digest whole = sha256(data.data(), data.size());
  for (size_t step : {1, 3, 55, 56, 63, 64, 65, 127}) {
    Sha256 h;
    for (size_t at = 0; at < data.size(); at += step)
      h.update(data.data() + at, std::min(step, data.size() - at));
    CHECK(h.finish() == whole);
  }
}

TEST_CASE("hmac-sha256 matches RFC 4231") {
  struct Case {
    std::string key, data, mac;
  };
  const Case cases[] = {
      {repeat('\x0b', 20), "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {repeat('\xaa', 20), repeat('\xdd', 50),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {std::string(
           "\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17"
           "\x18\x19",
           25),
       repeat('\xcd', 50), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {repeat('\xaa', 131), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {repeat('\xaa', 131),
       "This is a test using a larger than block-size key and a larger than block-size data. The key needs "
       "to be "
       "hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases)
    CHECK(hex(hmacSha256(c.key.data(), c.key.size(), c.data.data(), c.data.size())) == c.mac);
}

TEST_CASE("equalConstantTime compares every byte") {
  const char a[] = "0123456789abcdef", b[] = "0123456789abcdeF";
  CHECK(equalConstantTime(a, a, 16));
  CHECK_FALSE(equalConstantTime(a, b, 16));
  CHECK(equalConstantTime(a, b, 15));
}
