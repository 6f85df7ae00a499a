#include "storage/keys.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/sha256.h"

namespace ctxcache::storage {
namespace {

TEST(ContextIdTest, IsSha256PrefixOfFingerprintAndLittleEndianTokens) {
  std::vector<uint32_t> tokens = {1, 0x01020304, 70000};
  ContextId id = ContextId::Compute("fp", tokens);
  std::string buf = "fp";
  for (uint32_t t : tokens) {
    for (int i = 0; i < 4; ++i) buf.push_back(static_cast<char>(t >> (8 * i)));
  }
  auto d = Sha256Digest(buf.data(), buf.size());
  EXPECT_EQ(0, std::memcmp(id.bytes.data(), d.data(), 16));
  EXPECT_EQ(id.ToHex().size(), 32u);
  auto back = ContextId::FromHex(id.ToHex());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, id);
  // Different model or tokens -> different id.
  EXPECT_NE(ContextId::Compute("fp2", tokens), id);
  tokens[2]++;
  EXPECT_NE(ContextId::Compute("fp", tokens), id);
}

TEST(ContextIdTest, ToHexIsLowercaseHexOfTheBytes) {
  ContextId id;
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = static_cast<uint8_t>(i * 17 + 10);
  EXPECT_EQ(id.ToHex(), "0a1b2c3d4e5f708192a3b4c5d6e7f809");
  EXPECT_EQ(id.ToHex(), ToHex(id.bytes.data(), id.bytes.size()));  // the one converter
  auto back = ContextId::FromHex("0A1B2C3D4E5F708192A3B4C5D6E7F809");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, id);
}

TEST(ContextIdTest, RejectsBadHex) {
  EXPECT_EQ(ContextId::FromHex("abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ContextId::FromHex(std::string(32, 'g')).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ContextId::FromBytes("short").status().code(), StatusCode::kInvalidArgument);
}

TEST(KeysTest, PageKeysSortNumericallyAndRoundTrip) {
  ContextId id = ContextId::Compute("fp", std::vector<uint32_t>{1, 2, 3});
  std::string a = PageKey(id, 1, 2, 255);
  std::string b = PageKey(id, 1, 2, 256);
  std::string c = PageKey(id, 1, 3, 0);
  std::string d = PageKey(id, 2, 0, 0);
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  EXPECT_LT(c, d);
  EXPECT_EQ(a.size(), kPageKeySize);
  PageKeyParts p;
  ASSERT_TRUE(ParsePageKey(b, &p));
  EXPECT_EQ(p.id, id);
  EXPECT_EQ(p.layer, 1);
  EXPECT_EQ(p.kv_head, 2);
  EXPECT_EQ(p.block, 256u);
  EXPECT_EQ(ArtifactKey(id, 0, 0, 7, 1).size(), kArtifactKeySize);
  EXPECT_EQ(TokenKey(id, 1).size(), kTokenKeySize);
}

TEST(KeysTest, ContextRangeCoversExactlyOneContext) {
  ContextId id;
  id.bytes.fill(0);
  id.bytes[15] = 0xFF;
  id.bytes[14] = 0x01;
  ContextId next = id;
  next.bytes[15] = 0;
  next.bytes[14] = 0x02;
  std::string begin = ContextRangeBegin(id), end = ContextRangeEnd(id);
  for (const std::string& k :
       {PageKey(id, 0, 0, 0), PageKey(id, 0xFFFF, 0xFFFF, 0xFFFFFFFF),
        ArtifactKey(id, 0xFFFF, 0xFFFF, 0xFF, 0xFFFFFFFF), TokenKey(id, 9)}) {
    EXPECT_LE(begin, k);
    EXPECT_LT(k, end);
  }
  EXPECT_GE(PageKey(next, 0, 0, 0), end);
  ContextId all_ff;
  all_ff.bytes.fill(0xFF);
  EXPECT_LT(ArtifactKey(all_ff, 0xFFFF, 0xFFFF, 0xFF, 0xFFFFFFFF), ContextRangeEnd(all_ff));
}

}  // namespace
}  // namespace ctxcache::storage
