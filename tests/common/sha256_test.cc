#include "common/sha256.h"

#include <gtest/gtest.h>

#include <string>

namespace ctxcache {
namespace {

std::string HexOf(const Sha256::Digest& d) {
  EXPECT_EQ(ToHex(d.data(), d.size()).size(), 64u);
  static const char* k = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s += k[b >> 4];
    s += k[b & 15];
  }
  return s;
}

// FIPS 180-4 / NIST example vectors.
TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(HexOf(Sha256Digest("", 0)),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(HexOf(Sha256Digest("abc", 3)),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  std::string m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(HexOf(Sha256Digest(m.data(), m.size())),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256Test, MillionAInPiecesMatchesOneShot) {
  std::string a(1000000, 'a');
  Sha256 h;
  // Odd-sized pieces exercise the buffering across block boundaries.
  size_t pos = 0, step = 1;
  while (pos < a.size()) {
    size_t n = std::min(step, a.size() - pos);
    h.Update(a.data() + pos, n);
    pos += n;
    step = step * 3 % 1000 + 1;
  }
  EXPECT_EQ(HexOf(h.Finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

}  // namespace
}  // namespace ctxcache
