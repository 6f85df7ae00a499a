// ModelRegistry: the models ctxcached hosts for prefill, one HF model
// directory per model under --model-dir (models/<name>/config.json ...).
// Models load lazily on first use and stay resident.
//
// Thread-safety: safe for concurrent use.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "ctxcache/v1/storage.pb.h"
#include "model/model.h"
#include "model/tokenizer.h"

namespace ctxcache::service {

struct LoadedModel {
  std::string name;
  std::unique_ptr<model::Model> model;
  // Null when the directory has no tokenizer.model (token-id input only).
  std::unique_ptr<model::Tokenizer> tokenizer;
  // The spec stored with every context built from this model.
  v1::ModelSpec spec;
};

// The storage-level spec of a loaded model (KV in bf16).
v1::ModelSpec ToProtoSpec(const std::string& name, const model::ModelSpec& spec);

class ModelRegistry {
 public:
  ModelRegistry(std::string model_dir, std::string default_model)
      : model_dir_(std::move(model_dir)), default_model_(std::move(default_model)) {}

  // "" = the default model. NOT_FOUND (listing the available models) if
  // there is no such directory; the loader's error if it fails to load.
  StatusOr<std::shared_ptr<const LoadedModel>> Get(const std::string& name);

  // Names of the model directories under model_dir (those with config.json).
  std::vector<std::string> Available() const;
  // Whether `name` (non-empty) is one of Available().
  bool IsHosted(const std::string& name) const;
  const std::string& default_model() const { return default_model_; }

 private:
  std::string model_dir_;
  std::string default_model_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<const LoadedModel>> loaded_;  // guarded by mu_
};

}  // namespace ctxcache::service
