// Loader tests: config parsing, safetensors (single, sharded, bf16/fp16),
// fingerprint, and every error path on small broken fixtures built in a temp
// dir from the committed tiny llama3 golden model.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/prefill.h"
#include "model/safetensors.h"
#include "tests/model/model_test_util.h"

namespace ctxcache::model {
namespace {

namespace fs = std::filesystem;
using testing::GoldenDir;
using testing::MaxAbsDiff;

std::string ReadText(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void WriteText(const std::string& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// All tensors of a safetensors file as writable copies.
std::vector<TensorToWrite> LoadTensors(const std::string& path) {
  std::vector<TensorToWrite> out;
  auto set = SafetensorsSet::OpenFile(path);
  EXPECT_TRUE(set.ok()) << set.status().ToString();
  for (const std::string& name : (*set)->Names()) {
    const TensorView* v = *(*set)->Get(name);
    out.push_back(
        {name, v->dtype, v->shape, std::string(reinterpret_cast<const char*>(v->data), v->nbytes)});
  }
  return out;
}

// Converts F32 tensors to `dtype` (F16 or BF16).
void ConvertTensors(std::vector<TensorToWrite>* ts, TensorDType dtype) {
  for (auto& t : *ts) {
    if (t.dtype != TensorDType::kF32) continue;
    const size_t n = t.bytes.size() / 4;
    std::string out(n * 2, '\0');
    ConvertFromFloat(dtype == TensorDType::kBF16 ? DType::kBF16 : DType::kF16,
                     reinterpret_cast<const float*>(t.bytes.data()), out.data(), n);
    t.bytes = std::move(out);
    t.dtype = dtype;
  }
}

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = GoldenDir() + "/llama3";
    if (!fs::exists(src_ + "/model.safetensors")) GTEST_SKIP() << "golden data absent: " << src_;
    dir_ = testing::MakeTempDir("loader");
    ASSERT_FALSE(dir_.empty());
    fs::copy_file(src_ + "/config.json", dir_ + "/config.json");
    fs::copy_file(src_ + "/model.safetensors", dir_ + "/model.safetensors");
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  Status LoadStatus() { return Model::Load(dir_).status(); }
  void EditConfig(const std::function<void(nlohmann::json&)>& edit) {
    auto j = nlohmann::json::parse(ReadText(dir_ + "/config.json"));
    edit(j);
    WriteText(dir_ + "/config.json", j.dump(2));
  }
  void RewriteWeights(const std::function<void(std::vector<TensorToWrite>&)>& edit) {
    auto ts = LoadTensors(src_ + "/model.safetensors");
    edit(ts);
    ASSERT_TRUE(WriteSafetensors(dir_ + "/model.safetensors", ts).ok());
  }
  // Last-position logits of a short prefill.
  std::vector<float> Logits(const Model& m) {
    KvCache cache(m.spec(), DType::kF32);
    std::vector<int32_t> ids;
    for (int i = 0; i < 20; ++i) ids.push_back((i * 37 + 5) % m.spec().vocab);
    PrefillOptions po;
    po.logits = PrefillOptions::LogitsMode::kAll;
    PrefillResult r;
    EXPECT_TRUE(Prefill(m, ids, &cache, {}, po, &r).ok());
    return r.logits;
  }
  std::string src_, dir_;
};

TEST_F(LoaderTest, LoadsSpec) {
  auto m = Model::Load(dir_);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const ModelSpec& s = (*m)->spec();
  EXPECT_EQ(s.architecture, "LlamaForCausalLM");
  EXPECT_EQ(s.n_layers, 2);
  EXPECT_EQ(s.n_q_heads, 4);
  EXPECT_EQ(s.n_kv_heads, 2);
  EXPECT_EQ(s.head_dim, 32);
  EXPECT_EQ(s.hidden, 128);
  EXPECT_EQ(s.vocab, 512);
  EXPECT_EQ(s.rope.type, "llama3");
  EXPECT_EQ(s.rope.original_max_position_embeddings, 32);
  EXPECT_EQ(s.weight_dtype, DType::kF32);
  EXPECT_EQ(s.fingerprint.size(), 64u);
  EXPECT_FALSE(s.tie_word_embeddings);
}

TEST_F(LoaderTest, FingerprintIsStableAndCoversWeightsAndConfig) {
  auto a = Model::Load(dir_);
  auto b = Model::Load(dir_);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string fp = (*a)->spec().fingerprint;
  EXPECT_EQ(fp, (*b)->spec().fingerprint);
  // One weight value changes -> new fingerprint.
  RewriteWeights([](std::vector<TensorToWrite>& ts) {
    for (auto& t : ts) {
      if (t.name == "model.layers.1.mlp.down_proj.weight") t.bytes[100] ^= 1;
    }
  });
  auto c = Model::Load(dir_);
  ASSERT_TRUE(c.ok());
  EXPECT_NE((*c)->spec().fingerprint, fp);
  // Restore weights, change the config -> new fingerprint.
  fs::copy_file(src_ + "/model.safetensors", dir_ + "/model.safetensors",
                fs::copy_options::overwrite_existing);
  EditConfig([](nlohmann::json& j) { j["rms_norm_eps"] = 1e-6; });
  auto d = Model::Load(dir_);
  ASSERT_TRUE(d.ok());
  EXPECT_NE((*d)->spec().fingerprint, fp);
}

TEST_F(LoaderTest, ShardedEqualsSingleFile) {
  auto single = Model::Load(dir_);
  ASSERT_TRUE(single.ok());
  auto ts = LoadTensors(src_ + "/model.safetensors");
  std::vector<TensorToWrite> s1, s2;
  nlohmann::json index = {{"metadata", {{"total_size", 0}}},
                          {"weight_map", nlohmann::json::object()}};
  for (size_t i = 0; i < ts.size(); ++i) {
    const bool first = ts[i].name.find("layers.1.") == std::string::npos;
    (first ? s1 : s2).push_back(ts[i]);
    index["weight_map"][ts[i].name] =
        first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  ASSERT_FALSE(s1.empty());
  ASSERT_FALSE(s2.empty());
  fs::remove(dir_ + "/model.safetensors");
  ASSERT_TRUE(WriteSafetensors(dir_ + "/model-00001-of-00002.safetensors", s1).ok());
  ASSERT_TRUE(WriteSafetensors(dir_ + "/model-00002-of-00002.safetensors", s2).ok());
  WriteText(dir_ + "/model.safetensors.index.json", index.dump());
  auto sharded = Model::Load(dir_);
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
  EXPECT_EQ((*sharded)->spec().fingerprint, (*single)->spec().fingerprint);
  // Same weights (the fingerprint covers them); logits may differ in the last
  // bit because Eigen's vectorized reductions depend on the heap alignment of
  // the weight buffers (seen: 1.2e-7 under load).
  EXPECT_LE(MaxAbsDiff(Logits(**sharded), Logits(**single)), 1e-5);

  // A shard named in the index but missing on disk.
  fs::remove(dir_ + "/model-00002-of-00002.safetensors");
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("model-00002-of-00002.safetensors"), std::string::npos);
}

TEST_F(LoaderTest, Bf16AndF16Weights) {
  auto ref = Model::Load(dir_);
  ASSERT_TRUE(ref.ok());
  const auto ref_logits = Logits(**ref);
  for (TensorDType dt : {TensorDType::kBF16, TensorDType::kF16}) {
    RewriteWeights([&](std::vector<TensorToWrite>& ts) { ConvertTensors(&ts, dt); });
    auto m = Model::Load(dir_);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*m)->spec().weight_dtype, dt == TensorDType::kBF16 ? DType::kBF16 : DType::kF16);
    EXPECT_NE((*m)->spec().fingerprint, (*ref)->spec().fingerprint);
    const double diff = MaxAbsDiff(Logits(**m), ref_logits);
    EXPECT_GT(diff, 0.0);  // the weights really changed precision
    EXPECT_LT(diff, dt == TensorDType::kBF16 ? 0.5 : 0.05) << TensorDTypeName(dt);
  }
}

TEST_F(LoaderTest, LegacyRopeScalingEqualsRopeParameters) {
  auto a = Model::Load(dir_);
  ASSERT_TRUE(a.ok());
  EditConfig([](nlohmann::json& j) {
    nlohmann::json rp = j["rope_parameters"];
    j.erase("rope_parameters");
    j["rope_theta"] = rp["rope_theta"];
    rp.erase("rope_theta");
    j["rope_scaling"] = rp;
  });
  auto b = Model::Load(dir_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*a)->inv_freq(), (*b)->inv_freq());
  EXPECT_EQ((*b)->spec().rope.type, "llama3");
}

TEST_F(LoaderTest, MissingConfig) {
  fs::remove(dir_ + "/config.json");
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("config.json"), std::string::npos);
}

TEST_F(LoaderTest, MissingWeights) {
  fs::remove(dir_ + "/model.safetensors");
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos);
}

TEST_F(LoaderTest, BadConfigJson) {
  WriteText(dir_ + "/config.json", "{\"architectures\": [\"LlamaForCausalLM\"], ");
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("not valid JSON"), std::string::npos);
}

TEST_F(LoaderTest, UnsupportedArchitecture) {
  EditConfig([](nlohmann::json& j) { j["architectures"] = {"GPT2LMHeadModel"}; });
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("GPT2LMHeadModel"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("architectures"), std::string::npos) << st.ToString();
}

TEST_F(LoaderTest, MissingAndMistypedFields) {
  EditConfig([](nlohmann::json& j) { j.erase("hidden_size"); });
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'hidden_size'"), std::string::npos) << st.ToString();

  fs::copy_file(src_ + "/config.json", dir_ + "/config.json", fs::copy_options::overwrite_existing);
  EditConfig([](nlohmann::json& j) { j["num_key_value_heads"] = 3; });
  st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("num_key_value_heads"), std::string::npos) << st.ToString();

  fs::copy_file(src_ + "/config.json", dir_ + "/config.json", fs::copy_options::overwrite_existing);
  EditConfig([](nlohmann::json& j) { j["rope_parameters"]["rope_type"] = "yarn"; });
  st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("yarn"), std::string::npos) << st.ToString();

  fs::copy_file(src_ + "/config.json", dir_ + "/config.json", fs::copy_options::overwrite_existing);
  EditConfig([](nlohmann::json& j) { j["hidden_act"] = "gelu"; });
  st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("hidden_act"), std::string::npos) << st.ToString();
}

TEST_F(LoaderTest, MissingTensor) {
  RewriteWeights([](std::vector<TensorToWrite>& ts) {
    std::erase_if(
        ts, [](const TensorToWrite& t) { return t.name == "model.layers.1.mlp.up_proj.weight"; });
  });
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.layers.1.mlp.up_proj.weight"), std::string::npos)
      << st.ToString();
}

TEST_F(LoaderTest, MissingLmHeadWhenUntied) {
  RewriteWeights([](std::vector<TensorToWrite>& ts) {
    std::erase_if(ts, [](const TensorToWrite& t) { return t.name == "lm_head.weight"; });
  });
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("lm_head.weight"), std::string::npos) << st.ToString();
  // With tied embeddings the same file loads.
  EditConfig([](nlohmann::json& j) { j["tie_word_embeddings"] = true; });
  EXPECT_TRUE(LoadStatus().ok());
}

TEST_F(LoaderTest, ShapeMismatch) {
  RewriteWeights([](std::vector<TensorToWrite>& ts) {
    for (auto& t : ts) {
      if (t.name == "model.layers.0.self_attn.k_proj.weight") {
        t.shape = {t.shape[1], t.shape[0]};  // transposed: [128, 64] instead of [64, 128]
      }
    }
  });
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.layers.0.self_attn.k_proj.weight"), std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("[64, 128]"), std::string::npos) << st.ToString();
}

TEST_F(LoaderTest, TruncatedFile) {
  const std::string p = dir_ + "/model.safetensors";
  fs::resize_file(p, fs::file_size(p) - 1000);
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("truncated"), std::string::npos);

  fs::resize_file(p, 5);
  st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
}

TEST_F(LoaderTest, CorruptHeader) {
  const std::string p = dir_ + "/model.safetensors";
  std::string bytes = ReadText(p);
  // Header length beyond the file.
  std::string huge = bytes;
  const uint64_t len = uint64_t{1} << 40;
  std::memcpy(huge.data(), &len, 8);
  WriteText(p, huge);
  Status st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  // Garbage in the JSON header.
  std::string garbled = bytes;
  garbled[8] = '[';
  garbled[9] = '!';
  WriteText(p, garbled);
  st = LoadStatus();
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("JSON"), std::string::npos);
}

// A shape whose element count overflows int64 (fuzz/fuzz_safetensors): the
// product wrapped, so [2^62 + 1, 4] f32 "needed" 16 bytes and opened as a
// tensor of 2^64 elements over 16 bytes. It is INVALID_ARGUMENT.
TEST(SafetensorsTest, OverflowingShapeIsInvalidArgument) {
  const std::string dir = testing::MakeTempDir("safetensors");
  const std::string p = dir + "/overflow.safetensors";
  for (const std::string shape : {"[4611686018427387905, 4]", "[4294967296, 4294967296]",
                                  "[3037000500, 3037000500, 0]"}) {
    const bool empty = shape.find(", 0]") != std::string::npos;  // 0 elements: fine
    const std::string end = empty ? "0" : "16";
    const std::string header =
        R"({"t": {"dtype": "F32", "shape": )" + shape + R"(, "data_offsets": [0, )" + end + "]}}";
    std::string file(8, '\0');
    const uint64_t len = header.size();
    std::memcpy(file.data(), &len, 8);
    file += header + std::string(16, '\0');
    WriteText(p, file);
    auto set = SafetensorsSet::OpenFile(p);
    if (empty) {
      EXPECT_TRUE(set.ok()) << shape << ": " << set.status().ToString();
    } else {
      EXPECT_EQ(set.status().code(), StatusCode::kInvalidArgument) << shape;
    }
  }
}

TEST(ModelConfigTest, ParsesQwenAndMistralSpecifics) {
  auto q = ParseModelConfig(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":10,"tie_word_embeddings":true})");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_TRUE(q->qkv_bias);
  EXPECT_FALSE(q->o_bias);
  EXPECT_EQ(q->head_dim, 16);
  EXPECT_TRUE(q->tie_word_embeddings);
  auto m = ParseModelConfig(R"({"architectures":["MistralForCausalLM"],"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,
    "vocab_size":10,"sliding_window":4096,"rope_theta":1e6})");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->sliding_window, 4096);
  EXPECT_EQ(m->n_kv_heads, 4);
  EXPECT_DOUBLE_EQ(m->rope.theta, 1e6);
  EXPECT_FALSE(m->qkv_bias);
  auto bad = ParseModelConfig("[1,2]");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ctxcache::model
