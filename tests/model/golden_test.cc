// Golden tests: the engine's logits and per-layer post-RoPE Q/K/V against HF
// transformers on the tiny random-init models in tests/data/golden (fp32
// weights; tolerance 1e-3 absolute as the issue requires).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "model/kv_cache.h"
#include "model/model.h"
#include "model/prefill.h"
#include "model/safetensors.h"
#include "model/trace_sink.h"
#include "tests/model/model_test_util.h"

namespace ctxcache::model {
namespace {

using testing::GoldenDir;
using testing::MaxAbsDiff;

constexpr double kTol = 1e-3;

struct Golden {
  std::vector<int32_t> ids;
  std::vector<int64_t> positions;
  std::vector<float> logits;
  // layer -> tensors
  std::map<int, std::vector<float>> q, k, v;
};

Golden ReadGolden(const std::string& dir, const ModelSpec& s) {
  Golden g;
  auto set = SafetensorsSet::OpenFile(dir + "/golden.safetensors");
  EXPECT_TRUE(set.ok()) << set.status().ToString();
  if (!set.ok()) return g;
  std::vector<int64_t> ids;
  EXPECT_TRUE((*set)->ReadI64("input_ids", &ids).ok());
  g.ids.assign(ids.begin(), ids.end());
  EXPECT_TRUE((*set)->ReadI64("logit_positions", &g.positions).ok());
  const int64_t T = static_cast<int64_t>(g.ids.size());
  const int64_t P = static_cast<int64_t>(g.positions.size());
  Status st = (*set)->ReadF32("logits", {P, s.vocab}, &g.logits);
  EXPECT_TRUE(st.ok()) << st.ToString();
  for (int l : {0, s.n_layers - 1}) {
    const std::string p = "layer" + std::to_string(l) + ".";
    EXPECT_TRUE((*set)->ReadF32(p + "q", {s.n_q_heads, T, s.head_dim}, &g.q[l]).ok());
    EXPECT_TRUE((*set)->ReadF32(p + "k", {s.n_kv_heads, T, s.head_dim}, &g.k[l]).ok());
    EXPECT_TRUE((*set)->ReadF32(p + "v", {s.n_kv_heads, T, s.head_dim}, &g.v[l]).ok());
  }
  return g;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = GoldenDir() + "/" + GetParam();
    if (!std::filesystem::exists(dir_ + "/golden.safetensors")) {
      GTEST_SKIP() << "golden data absent: " << dir_;
    }
    auto m = Model::Load(dir_);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(m).value();
    golden_ = ReadGolden(dir_, model_->spec());
  }

  // Prefills the golden ids with `chunk` and checks logits and Q/K/V.
  // tol applies to logits; qkv_tol to Q/K/V of the checked layers.
  void CheckPrefill(int chunk, DType kv_dtype, double tol, double qkv_tol) {
    const ModelSpec& s = model_->spec();
    KvCache cache(s, kv_dtype);
    TraceSinkOptions to;
    to.layers = {0, s.n_layers - 1};
    TraceSink sink(to);
    PrefillOptions po;
    po.chunk_size = chunk;
    po.logits = PrefillOptions::LogitsMode::kPositions;
    po.logit_positions = golden_.positions;
    PrefillResult res;
    Status st = Prefill(*model_, golden_.ids, &cache, {&sink}, po, &res);
    ASSERT_TRUE(st.ok()) << st.ToString();
    const double logit_diff = MaxAbsDiff(res.logits, golden_.logits);
    EXPECT_LE(logit_diff, tol) << GetParam() << " chunk " << chunk;
    RecordProperty("max_abs_logit_diff", std::to_string(logit_diff));
    std::printf("%s chunk=%d kv=%s max|dlogit|=%.3g\n", GetParam().c_str(), chunk,
                std::string(DTypeName(kv_dtype)).c_str(), logit_diff);
    const Trace& t = sink.trace();
    for (int l : {0, s.n_layers - 1}) {
      const int slot = t.LayerSlot(l);
      ASSERT_GE(slot, 0);
      EXPECT_LE(MaxAbsDiff(t.q[slot], golden_.q[l]), qkv_tol) << "layer " << l << " q";
      EXPECT_LE(MaxAbsDiff(t.k[slot], golden_.k[l]), qkv_tol) << "layer " << l << " k";
      EXPECT_LE(MaxAbsDiff(t.v[slot], golden_.v[l]), qkv_tol) << "layer " << l << " v";
    }
  }

  std::string dir_;
  std::unique_ptr<Model> model_;
  Golden golden_;
};

TEST_P(GoldenTest, SingleChunkMatchesHf) { CheckPrefill(512, DType::kF32, kTol, kTol); }

TEST_P(GoldenTest, ChunkedMatchesHf) { CheckPrefill(7, DType::kF32, kTol, kTol); }

// The default bf16 KV cache rounds K/V before attention; logits stay close.
TEST_P(GoldenTest, Bf16CacheCloseToHf) { CheckPrefill(16, DType::kBF16, 0.25, 0.05); }

INSTANTIATE_TEST_SUITE_P(Tiny, GoldenTest,
                         ::testing::Values("llama3", "qwen2", "mistral", "smollm"));

// The README of the golden data lists HF's llama3 inverse frequencies.
TEST(RopeTest, Llama3InvFreqMatchesHf) {
  const std::string dir = GoldenDir() + "/llama3";
  if (!std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "golden data absent: " << dir;
  auto m = Model::Load(dir);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const auto& inv = (*m)->inv_freq();
  ASSERT_EQ(inv.size(), 16u);
  EXPECT_FLOAT_EQ(inv[0], 1.0f);  // high frequency: unchanged
  EXPECT_NEAR(inv[1], 0.37602, 1e-5);
  EXPECT_NEAR(inv[2], 0.09584, 1e-5);
  EXPECT_NEAR(inv[3], 0.022228, 1e-6);
  // Low frequencies are divided by the factor (8).
  const float plain = 1.0f / std::pow(10000.0f, 30.0f / 32.0f);
  EXPECT_NEAR(inv[15], plain / 8.0f, 1e-9);
}

}  // namespace
}  // namespace ctxcache::model
