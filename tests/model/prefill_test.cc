// Prefill engine tests on the committed tiny models: chunking invariance,
// extend, sinks, progress, cancellation, sliding window, bad input.
#include "model/prefill.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "model/decode.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/trace_sink.h"
#include "tests/model/model_test_util.h"

namespace ctxcache::model {
namespace {

namespace fs = std::filesystem;
using testing::GoldenDir;
using testing::MaxAbsDiff;

std::vector<int32_t> Ids(int n, int vocab, int seed = 1) {
  std::vector<int32_t> ids(n);
  uint32_t x = 2463534242u + seed;
  for (int i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    ids[i] = static_cast<int32_t>(x % vocab);
  }
  return ids;
}

class PrefillTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string dir = GoldenDir() + "/" + GetParam();
    if (!fs::exists(dir + "/model.safetensors")) GTEST_SKIP() << "golden data absent: " << dir;
    auto m = Model::Load(dir);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(m).value();
  }
  struct Run {
    std::vector<float> logits;
    Trace trace;
  };
  Run DoPrefill(const std::vector<int32_t>& ids, int chunk, DType dt) {
    KvCache cache(model_->spec(), dt);
    TraceSink sink({});
    PrefillOptions po;
    po.chunk_size = chunk;
    po.logits = PrefillOptions::LogitsMode::kAll;
    PrefillResult r;
    Status st = Prefill(*model_, ids, &cache, {&sink}, po, &r);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return {r.logits, sink.trace()};
  }
  std::unique_ptr<Model> model_;
};

TEST_P(PrefillTest, ChunkedEqualsSingleChunk) {
  const auto ids = Ids(100, model_->spec().vocab);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const Run single = DoPrefill(ids, 512, dt);
    for (int chunk : {1, 13, 64}) {
      const Run chunked = DoPrefill(ids, chunk, dt);
      const double tol = dt == DType::kF32 ? 1e-4 : 5e-3;
      EXPECT_LE(MaxAbsDiff(chunked.logits, single.logits), tol)
          << "chunk " << chunk << " " << DTypeName(dt);
      for (size_t s = 0; s < single.trace.layers.size(); ++s) {
        EXPECT_LE(MaxAbsDiff(chunked.trace.k[s], single.trace.k[s]), tol) << "k layer " << s;
        EXPECT_LE(MaxAbsDiff(chunked.trace.v[s], single.trace.v[s]), tol) << "v layer " << s;
        EXPECT_LE(MaxAbsDiff(chunked.trace.q[s], single.trace.q[s]), tol) << "q layer " << s;
      }
    }
  }
}

TEST_P(PrefillTest, ExtendEqualsOneShot) {
  const ModelSpec& s = model_->spec();
  const auto ids = Ids(80, s.vocab, 7);
  const Run whole = DoPrefill(ids, 32, DType::kF32);
  KvCache cache(s, DType::kF32);
  PrefillOptions po;
  po.chunk_size = 32;
  po.logits = PrefillOptions::LogitsMode::kAll;
  PrefillResult a, b;
  std::vector<int32_t> first(ids.begin(), ids.begin() + 50), second(ids.begin() + 50, ids.end());
  ASSERT_TRUE(Prefill(*model_, first, &cache, {}, po, &a).ok());
  ASSERT_TRUE(Prefill(*model_, second, &cache, {}, po, &b).ok());
  EXPECT_EQ(cache.n_tokens(), 80);
  ASSERT_EQ(b.logit_positions.front(), 50);
  std::vector<float> tail(whole.logits.begin() + 50 * s.vocab, whole.logits.end());
  EXPECT_LE(MaxAbsDiff(b.logits, tail), 1e-4);
}

TEST_P(PrefillTest, KvCacheHoldsExactlyTheContextKv) {
  const ModelSpec& s = model_->spec();
  const auto ids = Ids(77, s.vocab);
  KvCache cache(s, DType::kBF16);
  PrefillOptions po;
  PrefillResult r;
  ASSERT_TRUE(Prefill(*model_, ids, &cache, {}, po, &r).ok());
  EXPECT_EQ(cache.MemoryBytes(), static_cast<uint64_t>(77 * s.KvBytesPerToken(DType::kBF16)));
  ASSERT_EQ(r.logits.size(), static_cast<size_t>(s.vocab));  // kLast
  EXPECT_EQ(r.logit_positions, std::vector<int64_t>{76});
}

// Contexts longer than one attention tile (1024 keys): the tiled online
// softmax of the prefill equals the plain softmax of the decode step.
TEST_P(PrefillTest, LongContextAcrossTilesMatchesDecode) {
  const ModelSpec& s = model_->spec();
  const int64_t T = 2600, T0 = 2592;
  const auto ids = Ids(static_cast<int>(T), s.vocab, 11);
  KvCache ref_cache(s, DType::kF32);
  PrefillOptions po;
  po.chunk_size = 512;
  po.logits = PrefillOptions::LogitsMode::kPositions;
  for (int64_t p = T0; p < T; ++p) po.logit_positions.push_back(p);
  PrefillResult ref;
  ASSERT_TRUE(Prefill(*model_, ids, &ref_cache, {}, po, &ref).ok());
  KvCache cache(s, DType::kF32);
  std::vector<int32_t> prompt(ids.begin(), ids.begin() + T0);
  PrefillResult pr;
  PrefillOptions po2;
  po2.chunk_size = 700;
  ASSERT_TRUE(Prefill(*model_, prompt, &cache, {}, po2, &pr).ok());
  FullAttention full(s, &cache);
  std::vector<float> logits;
  for (int64_t p = T0; p < T; ++p) {
    ASSERT_TRUE(DecodeStep(*model_, ids[p], p, {&full}, &logits).ok());
    EXPECT_LE(MaxAbsDiff(logits.data(), ref.logits.data() + (p - T0) * s.vocab, s.vocab), 1e-3)
        << "pos " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, PrefillTest, ::testing::Values("llama3", "qwen2", "smollm"));

// Records calls to check order and contents.
class RecordingSink : public PrefillSink {
 public:
  Status OnBegin(const ModelSpec&, int64_t pos0, int64_t n) override {
    begin_pos0 = pos0;
    begin_n = n;
    return Status::OK();
  }
  Status OnChunk(int layer, int64_t pos0, int64_t n, const float*, const float*,
                 const float*) override {
    chunks.push_back({layer, pos0, n});
    if (fail_at_chunk >= 0 && static_cast<int>(chunks.size()) == fail_at_chunk + 1) {
      return DataLossError("sink failed");
    }
    return Status::OK();
  }
  Status OnLayerDone(int layer) override {
    done.push_back(layer);
    return Status::OK();
  }
  Status OnEnd() override {
    ended = true;
    return Status::OK();
  }
  struct Chunk {
    int layer;
    int64_t pos0, n;
  };
  int64_t begin_pos0 = -1, begin_n = -1;
  std::vector<Chunk> chunks;
  std::vector<int> done;
  bool ended = false;
  int fail_at_chunk = -1;
};

class PrefillControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = GoldenDir() + "/smollm";
    if (!fs::exists(dir + "/model.safetensors")) GTEST_SKIP() << "golden data absent: " << dir;
    auto m = Model::Load(dir);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(m).value();
  }
  std::unique_ptr<Model> model_;
};

TEST_F(PrefillControlTest, SinksSeeChunkMajorOrder) {
  const int L = model_->spec().n_layers;
  RecordingSink sink;
  KvCache cache(model_->spec());
  PrefillOptions po;
  po.chunk_size = 20;
  PrefillResult r;
  ASSERT_TRUE(Prefill(*model_, Ids(50, model_->spec().vocab), &cache, {&sink}, po, &r).ok());
  EXPECT_EQ(sink.begin_pos0, 0);
  EXPECT_EQ(sink.begin_n, 50);
  ASSERT_EQ(sink.chunks.size(), static_cast<size_t>(3 * L));
  for (int c = 0; c < 3; ++c) {
    for (int l = 0; l < L; ++l) {
      const auto& ch = sink.chunks[c * L + l];
      EXPECT_EQ(ch.layer, l);
      EXPECT_EQ(ch.pos0, 20 * c);
      EXPECT_EQ(ch.n, c < 2 ? 20 : 10);
    }
  }
  std::vector<int> want(L);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(sink.done, want);
  EXPECT_TRUE(sink.ended);
}

TEST_F(PrefillControlTest, SinkErrorStopsPrefill) {
  RecordingSink sink;
  sink.fail_at_chunk = 2;
  KvCache cache(model_->spec());
  PrefillOptions po;
  po.chunk_size = 8;
  PrefillResult r;
  Status st = Prefill(*model_, Ids(40, model_->spec().vocab), &cache, {&sink}, po, &r);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(sink.chunks.size(), 3u);
  EXPECT_FALSE(sink.ended);
}

TEST_F(PrefillControlTest, ProgressAndCancellation) {
  const int L = model_->spec().n_layers;
  std::vector<PrefillProgress> seen;
  KvCache cache(model_->spec());
  PrefillOptions po;
  po.chunk_size = 10;
  po.progress = [&](const PrefillProgress& p) { seen.push_back(p); };
  PrefillResult r;
  ASSERT_TRUE(Prefill(*model_, Ids(30, model_->spec().vocab), &cache, {}, po, &r).ok());
  ASSERT_EQ(seen.size(), static_cast<size_t>(3 * L));
  EXPECT_EQ(seen.back().tokens_done, 30);
  EXPECT_EQ(seen.back().tokens_total, 30);
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_GE(seen[i].tokens_done, seen[i - 1].tokens_done);

  std::atomic<bool> cancel{false};
  KvCache cache2(model_->spec());
  int calls = 0;
  po.cancel = &cancel;
  po.progress = [&](const PrefillProgress&) {
    if (++calls == 2) cancel = true;
  };
  Status st = Prefill(*model_, Ids(30, model_->spec().vocab), &cache2, {}, po, &r);
  EXPECT_EQ(st.code(), StatusCode::kCancelled) << st.ToString();
  EXPECT_EQ(calls, 2);
  cache2.Truncate(0);
  EXPECT_EQ(cache2.n_tokens(), 0);
}

TEST_F(PrefillControlTest, BadInput) {
  KvCache cache(model_->spec());
  PrefillOptions po;
  PrefillResult r;
  std::vector<int32_t> ids = Ids(10, model_->spec().vocab);
  ids[7] = model_->spec().vocab;  // out of range
  Status st = Prefill(*model_, ids, &cache, {}, po, &r);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("position 7"), std::string::npos) << st.ToString();
  EXPECT_EQ(Prefill(*model_, {}, &cache, {}, po, &r).code(), StatusCode::kInvalidArgument);
  po.chunk_size = 0;
  EXPECT_EQ(Prefill(*model_, Ids(4, 10), &cache, {}, po, &r).code(), StatusCode::kInvalidArgument);
  po.chunk_size = 512;
  po.logits = PrefillOptions::LogitsMode::kPositions;
  po.logit_positions = {99};
  EXPECT_EQ(Prefill(*model_, Ids(4, 10), &cache, {}, po, &r).code(), StatusCode::kInvalidArgument);
  KvCache wrong(1, 1, 8);
  po.logits = PrefillOptions::LogitsMode::kLast;
  EXPECT_EQ(Prefill(*model_, Ids(4, 10), &wrong, {}, po, &r).code(), StatusCode::kInvalidArgument);
}

// Mistral's sliding window: with one layer, the last token's logits depend
// only on the last `w` tokens (RoPE scores depend on relative positions).
class SlidingWindowTest : public ::testing::TestWithParam<int> {
 protected:
  int GetWindow() const { return GetParam(); }
};

TEST_P(SlidingWindowTest, OneLayerSeesOnlyTheWindow) {
  const std::string src = GoldenDir() + "/mistral";
  if (!fs::exists(src + "/model.safetensors")) GTEST_SKIP() << "golden data absent: " << src;
  const std::string dir = testing::MakeTempDir("sliding");
  ASSERT_FALSE(dir.empty());
  fs::copy_file(src + "/model.safetensors", dir + "/model.safetensors");
  auto write_config = [&](int window) {
    std::ifstream in(src + "/config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j["num_hidden_layers"] = 1;
    j["sliding_window"] = window;
    std::ofstream(dir + "/config.json", std::ios::trunc) << j.dump();
  };
  auto last_logits = [&](const Model& m, const std::vector<int32_t>& ids, int chunk) {
    KvCache cache(m.spec(), DType::kF32);
    PrefillOptions po;
    po.chunk_size = chunk;
    PrefillResult r;
    EXPECT_TRUE(Prefill(m, ids, &cache, {}, po, &r).ok());
    return r.logits;
  };
  const int w = GetWindow();
  const auto ids = Ids(w + 1500, 256, 3);
  const std::vector<int32_t> window(ids.end() - w, ids.end());
  write_config(w);
  auto m = Model::Load(dir);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->spec().sliding_window, w);
  const auto windowed = last_logits(**m, ids, 512);
  EXPECT_LE(MaxAbsDiff(windowed, last_logits(**m, window, 16)), 1e-3);
  EXPECT_LE(MaxAbsDiff(windowed, last_logits(**m, ids, 37)), 1e-4);  // chunking invariant
  write_config(0);  // no window: the earlier tokens matter
  auto full = Model::Load(dir);
  ASSERT_TRUE(full.ok());
  EXPECT_GT(MaxAbsDiff(last_logits(**full, ids, 16), windowed), 1e-2);
  fs::remove_all(dir);
}

// Windows inside one attention tile and across tiles (1024 keys).
INSTANTIATE_TEST_SUITE_P(Windows, SlidingWindowTest, ::testing::Values(8, 1100));

// The same text prefilled twice must store the same KV bit for bit, whatever
// addresses its buffers got: the buffers Eigen's elementwise expressions
// write (SiLU's exp) must be aligned for its packets (model.h, AlignedFloats).
TEST(ForwardDeterminismTest, WorkspaceBuffersAreAlignedForEigenPackets) {
  ModelSpec s;
  s.n_q_heads = 6;
  s.n_kv_heads = 2;
  s.head_dim = 20;
  s.hidden = 123;
  s.intermediate = 333;
  internal::Workspace ws;
  for (int64_t n : {1, 3, 17, 200}) {
    ws.Resize(s, n);
    for (const auto* b : {&ws.norm, &ws.q, &ws.k, &ws.v, &ws.attn, &ws.proj, &ws.gate, &ws.up}) {
      EXPECT_EQ(0u, reinterpret_cast<uintptr_t>(b->data()) % EIGEN_MAX_ALIGN_BYTES) << n;
    }
  }
}

}  // namespace
}  // namespace ctxcache::model
