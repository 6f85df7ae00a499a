// .ctxtrace tests: round trip (f32 exact, bf16 rounded), subsets collected by
// TraceSink, and corrupt / truncated / missing files.
#include "model/trace.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "common/crc32c.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/prefill.h"
#include "model/trace_sink.h"
#include "tests/model/model_test_util.h"

namespace ctxcache::model {
namespace {

namespace fs = std::filesystem;
using testing::MaxAbsDiff;

Trace MakeTrace() {
  Trace t;
  t.n_layers_total = 4;
  t.n_q_heads = 4;
  t.n_kv_heads = 2;
  t.head_dim = 8;
  t.rope_theta = 1e5;
  t.model_fingerprint = "abc";
  t.tokens = {5, 6, 7, 8, 9};
  t.layers = {1, 3};
  t.kv_heads = {1};
  t.q_positions = {3, 4};
  float x = 0.1f;
  for (int s = 0; s < 2; ++s) {
    std::vector<float> q(2 * 2 * 8), k(5 * 8), v(5 * 8);
    for (auto& f : q) f = (x += 0.37f) - 3.0f;
    for (auto& f : k) f = (x += 0.11f) * 0.5f;
    for (auto& f : v) f = -(x += 0.07f);
    t.q.push_back(q);
    t.k.push_back(k);
    t.v.push_back(v);
  }
  return t;
}

class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("trace");
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(TraceTest, RoundTripF32AndBf16) {
  const Trace t = MakeTrace();
  ASSERT_TRUE(t.Validate().ok());
  const std::string p = dir_ + "/t.ctxtrace";
  ASSERT_TRUE(WriteTrace(p, t, DType::kF32).ok());
  auto r = ReadTrace(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->tokens, t.tokens);
  EXPECT_EQ(r->layers, t.layers);
  EXPECT_EQ(r->kv_heads, t.kv_heads);
  EXPECT_EQ(r->q_positions, t.q_positions);
  EXPECT_EQ(r->model_fingerprint, "abc");
  EXPECT_EQ(r->n_stored_q_heads(), 2);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(r->q[s], t.q[s]);
    EXPECT_EQ(r->k[s], t.k[s]);
    EXPECT_EQ(r->v[s], t.v[s]);
  }
  ASSERT_TRUE(WriteTrace(p, t, DType::kBF16).ok());
  const auto f32_size = fs::file_size(p);
  auto b = ReadTrace(p);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  for (int s = 0; s < 2; ++s) {
    for (size_t i = 0; i < t.q[s].size(); ++i) {
      EXPECT_NEAR(b->q[s][i], t.q[s][i], std::fabs(t.q[s][i]) / 128);
    }
    EXPECT_GT(MaxAbsDiff(b->k[s], t.k[s]), 0.0);  // really rounded
    for (size_t i = 0; i < t.k[s].size(); ++i) {
      EXPECT_NEAR(b->k[s][i], t.k[s][i], std::fabs(t.k[s][i]) / 128);
      EXPECT_NEAR(b->v[s][i], t.v[s][i], std::fabs(t.v[s][i]) / 128);
    }
  }
  EXPECT_EQ(b->LayerSlot(3), 1);
  EXPECT_EQ(b->LayerSlot(2), -1);
  EXPECT_EQ(b->KvHeadSlot(1), 0);
  (void)f32_size;
}

TEST_F(TraceTest, CorruptTruncatedMissing) {
  const std::string p = dir_ + "/t.ctxtrace";
  EXPECT_EQ(ReadTrace(p).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(WriteTrace(p, MakeTrace(), DType::kBF16).ok());
  std::string bytes;
  {
    std::ifstream in(p, std::ios::binary);
    bytes.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& b) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << b;
  };
  std::string flipped = bytes;
  flipped[bytes.size() - 20] ^= 0x40;  // payload byte
  write(flipped);
  Status st = ReadTrace(p).status();
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("checksum"), std::string::npos) << st.ToString();
  write(bytes.substr(0, bytes.size() - 7));
  st = ReadTrace(p).status();
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("truncated"), std::string::npos) << st.ToString();
  std::string magic = bytes;
  magic[0] = 'X';
  write(magic);
  EXPECT_EQ(ReadTrace(p).status().code(), StatusCode::kDataLoss);
  std::string version = bytes;
  version[8] = 9;
  write(version);
  EXPECT_EQ(ReadTrace(p).status().code(), StatusCode::kInvalidArgument);
}

// Reading a hostile header (fuzz/fuzz_trace): counts whose byte sizes wrap
// size_t (n_tokens = 2^62 makes n_tokens * 4 wrap to 0, so the file "matched"
// the size and ReadTrace then resized to 2^62 tokens), and a negative q-head
// count (a negative GQA group), are rejected with a Status. The checksum is
// valid: only the header lies.
TEST_F(TraceTest, HostileHeaderCountsAreRejected) {
  const std::string p = dir_ + "/hostile.ctxtrace";
  auto file = [](const std::string& header) {
    std::string b = "CTXTRACE";
    const uint32_t version = kTraceFormatVersion, hlen = static_cast<uint32_t>(header.size());
    b.append(reinterpret_cast<const char*>(&version), 4);
    b.append(reinterpret_cast<const char*>(&hlen), 4);
    b += header;
    const uint32_t crc = crc32c::Value(b.data() + 16, b.size() - 16);
    b.append(reinterpret_cast<const char*>(&crc), 4);
    return b;
  };
  const std::string common =
      R"("n_layers_total": 1, "n_kv_heads": 1, "head_dim": 1, "dtype": "f32", "kv_heads": [0])";
  const std::vector<std::string> headers = {
      // n_tokens * 4 wraps to 0 (no layers: nothing else in the size).
      R"({"n_tokens": 4611686018427387904, "n_q_rows": 0, "n_q_heads": 1, "layers": [], )" +
          common + "}",
      // the K/V bytes of one layer wrap: 2 * 2^62 * 1 * 4.
      R"({"n_tokens": 4611686018427387904, "n_q_rows": 0, "n_q_heads": 1, "layers": [0], )" +
          common + "}",
      // n_q_heads = -2: a negative group size.
      R"({"n_tokens": 1, "n_q_rows": 1, "n_q_heads": -2, "layers": [0], )" + common + "}",
  };
  for (const std::string& h : headers) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << file(h);
    Status st = ReadTrace(p).status();
    EXPECT_FALSE(st.ok()) << h;
    EXPECT_TRUE(st.code() == StatusCode::kDataLoss || st.code() == StatusCode::kInvalidArgument)
        << h << ": " << st.ToString();
  }
}

TEST_F(TraceTest, ValidateRejectsInconsistentTraces) {
  Trace t = MakeTrace();
  t.k[0].pop_back();
  EXPECT_EQ(WriteTrace(dir_ + "/x", t).code(), StatusCode::kInvalidArgument);
  t = MakeTrace();
  t.layers = {3, 1};
  EXPECT_EQ(t.Validate().code(), StatusCode::kInvalidArgument);
  t = MakeTrace();
  t.q_positions = {4, 5};
  EXPECT_EQ(t.Validate().code(), StatusCode::kInvalidArgument);
}

// A TraceSink subset (one layer, one kv head, last 10 queries) equals the
// matching slices of a full trace.
TEST_F(TraceTest, SinkSubsetMatchesFullTrace) {
  const std::string dir = testing::GoldenDir() + "/smollm";
  if (!fs::exists(dir + "/model.safetensors")) GTEST_SKIP() << "golden data absent";
  auto m = Model::Load(dir);
  ASSERT_TRUE(m.ok());
  const ModelSpec& s = (*m)->spec();
  std::vector<int32_t> ids(37);
  for (int i = 0; i < 37; ++i) ids[i] = (i * 11 + 3) % s.vocab;
  TraceSink all({});
  TraceSinkOptions so;
  so.layers = {2};
  so.kv_heads = {1};
  so.q_last = 10;
  TraceSink part(so);
  KvCache cache(s);
  PrefillOptions po;
  po.chunk_size = 8;
  PrefillResult r;
  ASSERT_TRUE(Prefill(**m, ids, &cache, {&all, &part}, po, &r).ok());
  all.SetTokens(ids);
  part.SetTokens(ids);
  const Trace& a = all.trace();
  const Trace& b = part.trace();
  ASSERT_TRUE(a.Validate().ok());
  ASSERT_TRUE(b.Validate().ok());
  EXPECT_EQ(b.model_fingerprint, s.fingerprint);
  ASSERT_EQ(b.n_q_rows(), 10);
  EXPECT_EQ(b.q_positions.front(), 27);
  const int G = s.group_size();
  const int d = s.head_dim;
  for (int i = 0; i < G; ++i) {
    const float* full_q = a.Q(a.LayerSlot(2), 1 * G + i) + 27 * d;
    EXPECT_EQ(MaxAbsDiff(b.Q(0, i), full_q, 10 * d), 0.0);
  }
  EXPECT_EQ(MaxAbsDiff(b.K(0, 0), a.K(2, 1), 37 * d), 0.0);
  EXPECT_EQ(MaxAbsDiff(b.V(0, 0), a.V(2, 1), 37 * d), 0.0);
  const std::string p = dir_ + "/part.ctxtrace";
  ASSERT_TRUE(WriteTrace(p, b, DType::kF32).ok());
  auto back = ReadTrace(p);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->q[0], b.q[0]);
  EXPECT_EQ(back->tokens, ids);
}

}  // namespace
}  // namespace ctxcache::model

namespace ctxcache::model {
namespace {

// The reference trace written by `ctxcache-bench trace` (scripts/make-ref-trace.sh,
// a ctest fixture) reads back, belongs to the reference model and its K/V
// prefix equals a fresh prefill of the same tokens (causality: K/V at
// positions < 64 depend only on tokens 0..63).
TEST(RefTraceTest, BenchTraceMatchesFreshPrefill) {
  const char* env = std::getenv("CTXCACHE_REF_TRACE");
  if (env == nullptr) GTEST_SKIP() << "CTXCACHE_REF_TRACE unset (built without ctxcache-bench)";
  const std::string path = env;
  ASSERT_TRUE(fs::exists(path)) << path << " missing: the ref_trace_generate fixture failed";
  ASSERT_TRUE(fs::exists(testing::RefModelDir() + "/config.json"));
  auto t = ReadTrace(path);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_GE(t->n_tokens(), 8192);
  auto m = Model::Load(testing::RefModelDir());
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(t->model_fingerprint, (*m)->spec().fingerprint);
  const int64_t n = 64;
  std::vector<int32_t> ids(t->tokens.begin(), t->tokens.begin() + n);
  TraceSinkOptions so;
  so.layers = t->layers;
  so.kv_heads = t->kv_heads;
  TraceSink sink(so);
  KvCache cache((*m)->spec());
  PrefillResult r;
  ASSERT_TRUE(Prefill(**m, ids, &cache, {&sink}, PrefillOptions{}, &r).ok());
  const int d = t->head_dim;
  for (size_t s = 0; s < t->layers.size(); ++s) {
    for (int h = 0; h < t->n_stored_kv_heads(); ++h) {
      const float* fresh_k = sink.trace().k[s].data() + h * n * d;
      const float* fresh_v = sink.trace().v[s].data() + h * n * d;
      for (int64_t i = 0; i < n * d; ++i) {
        ASSERT_NEAR(t->K(static_cast<int>(s), h)[i], fresh_k[i], 0.02 + std::fabs(fresh_k[i]) / 64)
            << "layer slot " << s << " head " << h << " elem " << i;
        ASSERT_NEAR(t->V(static_cast<int>(s), h)[i], fresh_v[i], 0.02 + std::fabs(fresh_v[i]) / 64);
      }
    }
  }
}

}  // namespace
}  // namespace ctxcache::model
