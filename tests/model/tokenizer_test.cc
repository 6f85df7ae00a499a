// Tokenizer tests on a tiny committed sentencepiece model (tests/model/data)
// and, when present, the reference model's tokenizer.
#include "model/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/model/model_test_util.h"

namespace ctxcache::model {
namespace {

namespace fs = std::filesystem;

std::string TinyModelPath() {
  return testing::SourceDir() + "/tests/model/data/tiny_tokenizer.model";
}

void ExpectRoundTrip(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids;
  ASSERT_TRUE(tok.Encode(text, &ids).ok());
  EXPECT_FALSE(ids.empty());
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, tok.vocab_size());
  }
  std::string back;
  ASSERT_TRUE(tok.Decode(ids, &back).ok());
  EXPECT_EQ(back, text);
}

TEST(TokenizerTest, TinyModelRoundTrip) {
  auto tok = Tokenizer::Load(TinyModelPath());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->vocab_size(), 600);
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  ExpectRoundTrip(**tok, "The prefill engine writes KV pages to RocksDB.");
  ExpectRoundTrip(**tok, "Sparse attention selects about 5% of the context each step.");
  // Characters outside the training text go through byte fallback.
  ExpectRoundTrip(**tok, "Grüße, 東京! zstd: 1.2 GB/s");
  // Frequent words compress into multi-character pieces.
  std::vector<int32_t> ids;
  const std::string text = "the context the context the context";
  ASSERT_TRUE((*tok)->Encode(text, &ids).ok());
  EXPECT_LT(ids.size(), text.size() / 2);
}

TEST(TokenizerTest, Errors) {
  EXPECT_EQ(Tokenizer::Load("/nonexistent/tokenizer.model").status().code(), StatusCode::kNotFound);
  const std::string dir = testing::MakeTempDir("tok");
  ASSERT_FALSE(dir.empty());
  {
    std::ofstream out(dir + "/tokenizer.model", std::ios::binary);
    out << "this is not a protobuf";
  }
  EXPECT_EQ(Tokenizer::Load(dir + "/tokenizer.model").status().code(),
            StatusCode::kInvalidArgument);
  fs::remove_all(dir);
  auto tok = Tokenizer::Load(TinyModelPath());
  ASSERT_TRUE(tok.ok());
  std::string text;
  Status st = (*tok)->Decode({5, 600}, &text);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("600"), std::string::npos);
}

TEST(TokenizerTest, ReferenceModelRoundTrip) {
  const std::string path = testing::RefModelDir() + "/tokenizer.model";
  if (!fs::exists(path)) GTEST_SKIP() << "reference model absent: " << path;
  auto tok = Tokenizer::Load(path);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  ExpectRoundTrip(**tok, "PostgreSQL stores each table in a separate file.");
  ExpectRoundTrip(**tok, "git rebase --onto main feature");
}

}  // namespace
}  // namespace ctxcache::model
