#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ctxcache {
namespace {

// Test vectors from RFC 3720 (iSCSI) appendix B.4 and the usual check value.
TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(crc32c::Value("123456789"), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(crc32c::Value(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c::Value(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c::Value(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c::Value(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(crc32c::Value("", 0), 0u);
}

TEST(Crc32cTest, ExtendEqualsWhole) {
  std::string s = "the quick brown fox jumps over the lazy dog, twice over";
  for (size_t split = 0; split <= s.size(); ++split) {
    uint32_t a = crc32c::Extend(0, s.data(), split);
    EXPECT_EQ(crc32c::Extend(a, s.data() + split, s.size() - split), crc32c::Value(s));
  }
}

TEST(Crc32cTest, DetectsSingleBitFlip) {
  std::string s(4096, 'x');
  uint32_t base = crc32c::Value(s);
  for (size_t byte : {0ul, 7ul, 2048ul, 4095ul}) {
    std::string t = s;
    t[byte] ^= 0x10;
    EXPECT_NE(crc32c::Value(t), base);
  }
}

}  // namespace
}  // namespace ctxcache
