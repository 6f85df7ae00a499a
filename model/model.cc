#include "model/model.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/safetensors.h"
#include "common/sha256.h"

namespace ctxcache::model {

namespace {

using nlohmann::json;

// Reads a required integer field.
Status GetInt(const json& j, const char* field, int64_t* out) {
  if (!j.contains(field))
    return InvalidArgumentError(std::string("config.json: missing field '") + field + "'");
  const json& v = j[field];
  if (!v.is_number_integer()) {
    return InvalidArgumentError(std::string("config.json: field '") + field +
                                "' must be an integer, got " + v.dump());
  }
  *out = v.get<int64_t>();
  return Status::OK();
}

Status GetOptInt(const json& j, const char* field, int64_t def, int64_t* out) {
  if (!j.contains(field) || j[field].is_null()) {
    *out = def;
    return Status::OK();
  }
  return GetInt(j, field, out);
}

Status GetOptDouble(const json& j, const char* field, double def, double* out) {
  if (!j.contains(field) || j[field].is_null()) {
    *out = def;
    return Status::OK();
  }
  if (!j[field].is_number()) {
    return InvalidArgumentError(std::string("config.json: field '") + field +
                                "' must be a number, got " + j[field].dump());
  }
  *out = j[field].get<double>();
  return Status::OK();
}

Status GetOptBool(const json& j, const char* field, bool def, bool* out) {
  if (!j.contains(field) || j[field].is_null()) {
    *out = def;
    return Status::OK();
  }
  if (!j[field].is_boolean()) {
    return InvalidArgumentError(std::string("config.json: field '") + field +
                                "' must be a boolean, got " + j[field].dump());
  }
  *out = j[field].get<bool>();
  return Status::OK();
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return NotFoundError("file not found: " + path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return UnavailableError("cannot open " + path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

DType ToDType(TensorDType t) {
  switch (t) {
    case TensorDType::kF16:
      return DType::kF16;
    case TensorDType::kBF16:
      return DType::kBF16;
    default:
      return DType::kF32;
  }
}

}  // namespace

namespace {

// Layer counts, head counts and sizes, with their invariants.
Status ParseShape(const json& j, ModelSpec* s) {
  int64_t v = 0;
  RETURN_IF_ERROR(GetInt(j, "num_hidden_layers", &v));
  s->n_layers = static_cast<int>(v);
  RETURN_IF_ERROR(GetInt(j, "num_attention_heads", &v));
  s->n_q_heads = static_cast<int>(v);
  RETURN_IF_ERROR(GetOptInt(j, "num_key_value_heads", s->n_q_heads, &v));
  s->n_kv_heads = static_cast<int>(v);
  RETURN_IF_ERROR(GetInt(j, "hidden_size", &v));
  s->hidden = static_cast<int>(v);
  RETURN_IF_ERROR(GetInt(j, "intermediate_size", &v));
  s->intermediate = static_cast<int>(v);
  RETURN_IF_ERROR(GetInt(j, "vocab_size", &v));
  s->vocab = static_cast<int>(v);
  if (s->n_layers <= 0) return InvalidArgumentError("config.json: 'num_hidden_layers' must be > 0");
  if (s->n_q_heads <= 0) {
    return InvalidArgumentError("config.json: 'num_attention_heads' must be > 0");
  }
  if (s->n_kv_heads <= 0 || s->n_q_heads % s->n_kv_heads != 0) {
    return InvalidArgumentError(
        "config.json: 'num_key_value_heads' (" + std::to_string(s->n_kv_heads) +
        ") must be > 0 and divide num_attention_heads (" + std::to_string(s->n_q_heads) + ")");
  }
  if (s->hidden <= 0 || s->intermediate <= 0 || s->vocab <= 0) {
    return InvalidArgumentError(
        "config.json: hidden_size, intermediate_size and vocab_size must be > 0");
  }
  const int64_t default_head_dim = s->hidden / s->n_q_heads;
  RETURN_IF_ERROR(GetOptInt(j, "head_dim", default_head_dim, &v));
  s->head_dim = static_cast<int>(v);
  if (s->head_dim <= 0 || s->head_dim % 2 != 0) {
    return InvalidArgumentError("config.json: 'head_dim' must be a positive even number, got " +
                                std::to_string(s->head_dim));
  }
  return Status::OK();
}

// What differs between LlamaForCausalLM, MistralForCausalLM and
// Qwen2ForCausalLM: biases and sliding windows.
Status ParseArchitectureFields(const json& j, ModelSpec* s) {
  if (s->architecture == "Qwen2ForCausalLM") {
    s->qkv_bias = true;
    bool use_sw = false;
    RETURN_IF_ERROR(GetOptBool(j, "use_sliding_window", false, &use_sw));
    if (use_sw) {
      return InvalidArgumentError(
          "config.json: 'use_sliding_window': true is not supported for Qwen2");
    }
  } else if (s->architecture == "LlamaForCausalLM") {
    bool bias = false;
    RETURN_IF_ERROR(GetOptBool(j, "attention_bias", false, &bias));
    s->qkv_bias = s->o_bias = bias;
    if (j.contains("mlp_bias") && j["mlp_bias"].is_boolean() && j["mlp_bias"].get<bool>()) {
      return InvalidArgumentError("config.json: 'mlp_bias': true is not supported");
    }
  } else if (s->architecture == "MistralForCausalLM") {
    RETURN_IF_ERROR(GetOptInt(j, "sliding_window", 0, &s->sliding_window));
    if (s->sliding_window < 0) {
      return InvalidArgumentError("config.json: 'sliding_window' must be >= 0");
    }
  }
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    for (const auto& t : j["layer_types"]) {
      if (!(t.is_string() && t == "full_attention")) {
        if (s->sliding_window > 0 && t.is_string() && t == "sliding_attention") continue;
        return InvalidArgumentError("config.json: unsupported entry " + t.dump() +
                                    " in 'layer_types' (only full_attention, or "
                                    "sliding_attention with a uniform sliding_window)");
      }
    }
  }
  return Status::OK();
}

// RoPE: transformers >= 5 writes "rope_parameters" {rope_theta, rope_type,
// llama3 fields}; older checkpoints use top-level rope_theta + rope_scaling.
Status ParseRope(const json& j, RopeParams* rope) {
  RETURN_IF_ERROR(GetOptDouble(j, "rope_theta", 10000.0, &rope->theta));
  const json* rope_obj = nullptr;
  const char* rope_field = nullptr;
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    rope_obj = &j["rope_parameters"];
    rope_field = "rope_parameters";
    if (!rope_obj->is_object()) {
      return InvalidArgumentError("config.json: 'rope_parameters' must be an object or null");
    }
    RETURN_IF_ERROR(GetOptDouble(*rope_obj, "rope_theta", rope->theta, &rope->theta)
                        .WithContext("rope_parameters"));
  } else if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    rope_obj = &j["rope_scaling"];
    rope_field = "rope_scaling";
    if (!rope_obj->is_object()) {
      return InvalidArgumentError("config.json: 'rope_scaling' must be an object or null");
    }
  }
  if (rope->theta <= 0) return InvalidArgumentError("config.json: 'rope_theta' must be > 0");
  if (rope_obj == nullptr) return Status::OK();
  const json& rs = *rope_obj;
  const std::string where = std::string("config.json: ") + rope_field;
  std::string type = "default";
  if (rs.contains("rope_type") && rs["rope_type"].is_string()) {
    type = rs["rope_type"].get<std::string>();
  } else if (rs.contains("type") && rs["type"].is_string()) {
    type = rs["type"].get<std::string>();
  }
  if (type == "default") {
    rope->type = "default";
    return Status::OK();
  }
  if (type != "llama3") {
    return InvalidArgumentError(where + ": unsupported rope_type '" + type +
                                "' (expected default or llama3)");
  }
  rope->type = "llama3";
  auto need = [&](const char* f, double* out) -> Status {
    if (!rs.contains(f) || !rs[f].is_number()) {
      return InvalidArgumentError(where + " field '" + f +
                                  "' must be a number for rope_type llama3");
    }
    *out = rs[f].get<double>();
    return Status::OK();
  };
  RETURN_IF_ERROR(need("factor", &rope->factor));
  RETURN_IF_ERROR(need("low_freq_factor", &rope->low_freq_factor));
  RETURN_IF_ERROR(need("high_freq_factor", &rope->high_freq_factor));
  double omp = 0;
  RETURN_IF_ERROR(need("original_max_position_embeddings", &omp));
  rope->original_max_position_embeddings = static_cast<int64_t>(omp);
  if (rope->high_freq_factor == rope->low_freq_factor) {
    return InvalidArgumentError(where + ": high_freq_factor must differ from low_freq_factor");
  }
  return Status::OK();
}

}  // namespace

StatusOr<ModelSpec> ParseModelConfig(const std::string& json_text) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("config.json: not valid JSON");
  if (!j.is_object()) return InvalidArgumentError("config.json: top level must be an object");
  ModelSpec s;
  if (!j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return InvalidArgumentError(
        "config.json: field 'architectures' must be a non-empty array of strings");
  }
  s.architecture = j["architectures"][0].get<std::string>();
  if (s.architecture != "LlamaForCausalLM" && s.architecture != "MistralForCausalLM" &&
      s.architecture != "Qwen2ForCausalLM") {
    return InvalidArgumentError("config.json: unsupported architecture '" + s.architecture +
                                "' in field 'architectures' (expected LlamaForCausalLM, "
                                "MistralForCausalLM or Qwen2ForCausalLM)");
  }
  RETURN_IF_ERROR(ParseShape(j, &s));
  RETURN_IF_ERROR(GetOptDouble(j, "rms_norm_eps", 1e-6, &s.rms_norm_eps));
  RETURN_IF_ERROR(GetOptBool(j, "tie_word_embeddings", false, &s.tie_word_embeddings));
  RETURN_IF_ERROR(GetOptInt(j, "max_position_embeddings", 0, &s.max_position_embeddings));
  if (j.contains("hidden_act") && !(j["hidden_act"].is_string() && j["hidden_act"] == "silu")) {
    return InvalidArgumentError("config.json: unsupported 'hidden_act' " + j["hidden_act"].dump() +
                                " (expected \"silu\")");
  }
  if (j.contains("partial_rotary_factor") && j["partial_rotary_factor"].is_number() &&
      j["partial_rotary_factor"].get<double>() != 1.0) {
    return InvalidArgumentError("config.json: 'partial_rotary_factor' != 1 is not supported");
  }
  RETURN_IF_ERROR(ParseArchitectureFields(j, &s));
  RETURN_IF_ERROR(ParseRope(j, &s.rope));
  return s;
}

std::vector<float> ComputeInvFreq(const RopeParams& rope, int head_dim) {
  // HF: inv_freq = 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all fp32.
  const int half = head_dim / 2;
  std::vector<float> inv(half);
  const float base = static_cast<float>(rope.theta);
  for (int i = 0; i < half; ++i) {
    float e = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(base, e);
  }
  if (rope.type == "llama3") {
    // transformers modeling_rope_utils._compute_llama3_parameters.
    const float factor = static_cast<float>(rope.factor);
    const float low = static_cast<float>(rope.low_freq_factor);
    const float high_minus_low = static_cast<float>(rope.high_freq_factor - rope.low_freq_factor);
    const float old_len = static_cast<float>(rope.original_max_position_embeddings);
    // Python scalars meet fp32 tensors: torch casts them to fp32.
    const float low_freq_wavelen =
        static_cast<float>(static_cast<double>(old_len) / rope.low_freq_factor);
    const float high_freq_wavelen =
        static_cast<float>(static_cast<double>(old_len) / rope.high_freq_factor);
    for (int i = 0; i < half; ++i) {
      const float wavelen = static_cast<float>(2 * M_PI) / inv[i];
      float llama = wavelen > low_freq_wavelen ? inv[i] / factor : inv[i];
      const float smooth = (old_len / wavelen - low) / high_minus_low;
      const float smoothed = (1 - smooth) * llama / factor + smooth * llama;
      const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      inv[i] = medium ? smoothed : llama;
    }
  }
  return inv;
}

uint64_t Model::WeightBytes() const {
  uint64_t n = embed_.size() + final_norm_.size() + lm_head_.size();
  for (const auto& l : layers_) {
    n += l.attn_norm.size() + l.wq.size() + l.wk.size() + l.wv.size() + l.wo.size() + l.bq.size() +
         l.bk.size() + l.bv.size() + l.bo.size() + l.mlp_norm.size() + l.w_gate.size() +
         l.w_up.size() + l.w_down.size();
  }
  return n * sizeof(float);
}

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir, const LoadOptions& options) {
  ASSIGN_OR_RETURN(std::string config_text, ReadFile(dir + "/config.json"));
  auto spec_or = ParseModelConfig(config_text);
  if (!spec_or.ok()) return spec_or.status().WithContext(dir);
  std::unique_ptr<Model> m(new Model());
  m->spec_ = std::move(spec_or).value();
  m->pool_ = options.pool ? options.pool : ThreadPool::Default();
  ModelSpec& s = m->spec_;
  ASSIGN_OR_RETURN(auto set, SafetensorsSet::OpenDir(dir));

  const int64_t H = s.hidden, I = s.intermediate, V = s.vocab;
  const int64_t QD = int64_t{s.n_q_heads} * s.head_dim, KD = int64_t{s.n_kv_heads} * s.head_dim;
  auto read = [&](const std::string& name, std::vector<int64_t> shape,
                  std::vector<float>* out) -> Status {
    if (!set->Has(name)) {
      return InvalidArgumentError(dir + ": missing tensor '" + name + "' (expected shape " + [&] {
        std::string r = "[";
        for (size_t i = 0; i < shape.size(); ++i) r += (i ? ", " : "") + std::to_string(shape[i]);
        return r + "]";
      }() + ")");
    }
    Status st = set->ReadF32(name, shape, out);
    if (!st.ok()) return st.WithContext(dir);
    return Status::OK();
  };
  RETURN_IF_ERROR(read("model.embed_tokens.weight", {V, H}, &m->embed_));
  ASSIGN_OR_RETURN(const TensorView* ev, set->Get("model.embed_tokens.weight"));
  s.weight_dtype = ToDType(ev->dtype);
  RETURN_IF_ERROR(read("model.norm.weight", {H}, &m->final_norm_));
  if (!s.tie_word_embeddings) {
    RETURN_IF_ERROR(read("lm_head.weight", {V, H}, &m->lm_head_));
  }
  m->layers_.resize(s.n_layers);
  for (int i = 0; i < s.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& l = m->layers_[i];
    RETURN_IF_ERROR(read(p + "input_layernorm.weight", {H}, &l.attn_norm));
    RETURN_IF_ERROR(read(p + "self_attn.q_proj.weight", {QD, H}, &l.wq));
    RETURN_IF_ERROR(read(p + "self_attn.k_proj.weight", {KD, H}, &l.wk));
    RETURN_IF_ERROR(read(p + "self_attn.v_proj.weight", {KD, H}, &l.wv));
    RETURN_IF_ERROR(read(p + "self_attn.o_proj.weight", {H, QD}, &l.wo));
    if (s.qkv_bias) {
      RETURN_IF_ERROR(read(p + "self_attn.q_proj.bias", {QD}, &l.bq));
      RETURN_IF_ERROR(read(p + "self_attn.k_proj.bias", {KD}, &l.bk));
      RETURN_IF_ERROR(read(p + "self_attn.v_proj.bias", {KD}, &l.bv));
    }
    if (s.o_bias) RETURN_IF_ERROR(read(p + "self_attn.o_proj.bias", {H}, &l.bo));
    RETURN_IF_ERROR(read(p + "post_attention_layernorm.weight", {H}, &l.mlp_norm));
    RETURN_IF_ERROR(read(p + "mlp.gate_proj.weight", {I, H}, &l.w_gate));
    RETURN_IF_ERROR(read(p + "mlp.up_proj.weight", {I, H}, &l.w_up));
    RETURN_IF_ERROR(read(p + "mlp.down_proj.weight", {H, I}, &l.w_down));
  }
  m->inv_freq_ = ComputeInvFreq(s.rope, s.head_dim);

  if (options.compute_fingerprint) {
    Sha256 h;
    static constexpr char kTag[] = "ctxcache-model-fingerprint-v1";
    h.Update(kTag, sizeof(kTag));
    json cfg = json::parse(config_text, nullptr, false);
    const std::string canon = cfg.dump();  // object keys are sorted by nlohmann::json
    const uint64_t clen = canon.size();
    h.Update(&clen, 8);
    h.Update(canon);
    for (const std::string& name : set->Names()) {
      ASSIGN_OR_RETURN(const TensorView* t, set->Get(name));
      const uint64_t nlen = name.size();
      h.Update(&nlen, 8);
      h.Update(name);
      const std::string_view dt = TensorDTypeName(t->dtype);
      h.Update(dt);
      for (int64_t d : t->shape) h.Update(&d, 8);
      const uint64_t nb = t->nbytes;
      h.Update(&nb, 8);
      h.Update(t->data, t->nbytes);
    }
    auto digest = h.Finish();
    s.fingerprint = ToHex(digest.data(), digest.size());
  }
  return m;
}

}  // namespace ctxcache::model
