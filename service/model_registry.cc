#include "service/model_registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>

namespace ctxcache::service {

namespace {
std::string HexToBytes(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}
}  // namespace

v1::ModelSpec ToProtoSpec(const std::string& name, const model::ModelSpec& s) {
  v1::ModelSpec p;
  p.set_name(name);
  p.set_n_layers(static_cast<uint32_t>(s.n_layers));
  p.set_n_q_heads(static_cast<uint32_t>(s.n_q_heads));
  p.set_n_kv_heads(static_cast<uint32_t>(s.n_kv_heads));
  p.set_head_dim(static_cast<uint32_t>(s.head_dim));
  p.mutable_rope()->set_theta(s.rope.theta);
  p.mutable_rope()->set_scaling_type(s.rope.type == "default" ? "" : s.rope.type);
  p.mutable_rope()->set_scaling_factor(s.rope.factor);
  p.mutable_rope()->set_low_freq_factor(s.rope.low_freq_factor);
  p.mutable_rope()->set_high_freq_factor(s.rope.high_freq_factor);
  p.mutable_rope()->set_original_max_position_embeddings(
      static_cast<uint32_t>(s.rope.original_max_position_embeddings));
  p.set_kv_dtype(v1::DTYPE_BF16);
  p.set_fingerprint(HexToBytes(s.fingerprint));
  return p;
}

std::vector<std::string> ModelRegistry::Available() const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(model_dir_, ec)) {
    if (e.is_directory() && std::filesystem::exists(e.path() / "config.json")) {
      out.push_back(e.path().filename().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

StatusOr<std::shared_ptr<const LoadedModel>> ModelRegistry::Get(const std::string& requested) {
  const std::string name = requested.empty() ? default_model_ : requested;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loaded_.find(name);
  if (it != loaded_.end()) return it->second;
  if (name.find('/') != std::string::npos || name.find("..") != std::string::npos) {
    return InvalidArgumentError("model: '" + name.substr(0, 64) +
                                "' must be the name of a model directory, without '/' or '..'");
  }
  auto dir = std::filesystem::path(model_dir_) / name;
  if (!std::filesystem::exists(dir / "config.json")) {
    std::string avail;
    for (const auto& m : Available()) avail += (avail.empty() ? "" : ", ") + m;
    return NotFoundError("unknown model '" + name.substr(0, 64) + "'; available: " +
                         (avail.empty() ? "none" : avail));
  }
  auto start = std::chrono::steady_clock::now();
  auto m = model::Model::Load(dir.string());
  if (!m.ok()) return m.status().WithContext("loading model '" + name + "'");
  auto loaded = std::make_shared<LoadedModel>();
  loaded->name = name;
  loaded->model = std::move(m).value();
  if (std::filesystem::exists(dir / "tokenizer.model")) {
    auto tok = model::Tokenizer::Load((dir / "tokenizer.model").string());
    if (!tok.ok()) return tok.status().WithContext("loading tokenizer of model '" + name + "'");
    loaded->tokenizer = std::move(tok).value();
  }
  loaded->spec = ToProtoSpec(name, loaded->model->spec());
  spdlog::info("loaded model '{}' ({} layers, {} q / {} kv heads, head_dim {}) in {:.2f} s", name,
               loaded->model->spec().n_layers, loaded->model->spec().n_q_heads,
               loaded->model->spec().n_kv_heads, loaded->model->spec().head_dim,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  loaded_[name] = loaded;
  return std::shared_ptr<const LoadedModel>(loaded);
}

bool ModelRegistry::IsHosted(const std::string& name) const {
  if (name.empty()) return false;
  for (const auto& n : Available()) {
    if (n == name) return true;
  }
  return false;
}

}  // namespace ctxcache::service
