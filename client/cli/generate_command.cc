#include "client/cli/generate_command.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iomanip>
#include <map>

#include "client/cli/cli_util.h"
#include "client/worker/decode_worker.h"
#include "common/percentile.h"
#include "common/sha256.h"
#include "index/methods.h"
#include "model/tokenizer.h"

namespace ctxcache::cli {

namespace {

std::string Decode(const model::Tokenizer* tok, const std::vector<int32_t>& ids) {
  if (!tok) {
    std::string s;
    for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
    return s;
  }
  std::string text;
  if (!tok->Decode(ids, &text).ok()) return "<undecodable>";
  return text;
}

}  // namespace

void GenerateCommand::Configure(CLI::App* sub) {
  sub->add_option("--context", context_, "Context id")->required();
  sub->add_option("--prompt", prompt_, "Question or continuation prompt")->required();
  sub->add_option("--method", method_, "Index method: " + index::MethodNamesForMessages())
      ->capture_default_str();
  sub->add_option("--max-tokens", max_tokens_, "Tokens to generate")->capture_default_str();
  sub->add_option("--rho", rho_, "Token budget as a fraction of the context")
      ->capture_default_str();
  sub->add_option(
      "--page-fraction", page_fraction_,
      "Cap on the pages fetched per step, as a fraction of the pages (default: --rho; 1 = no cap)");
  sub->add_option("--param", session_params_,
                  "KEY=VALUE session param (repeatable), e.g. whole_pages=0 (docs/api.md)");
  sub->add_option("--mode", mode_, "server (server-side selection) or client")
      ->check(CLI::IsMember({"server", "client"}))
      ->capture_default_str();
  sub->add_option("--compare", compare_, "Also decode densely and compare (value: full)")
      ->check(CLI::IsMember({"full"}));
  sub->add_option("--model-dir", model_dir_, "Local directory of HF model directories")
      ->capture_default_str();
  sub->add_option("--model", model_, "Local model name (default: the context's model)");
}

int GenerateCommand::Run(const GlobalOptions& global, std::ostream& out, std::ostream& err) {
  client::GenerateOptions go;
  if (int rc = SessionOptionsFromFlags(&go, err); rc != 0) return rc;
  int code = kExitOk;
  auto client = ConnectOrExplain(global, err, &code);
  if (!client) return code;
  auto info = client->GetContext(context_);
  if (!info.ok()) return Fail(info.status(), global, err);
  Worker worker;
  if (int rc = LoadWorker(*info, global, &worker, err); rc != 0) return rc;

  auto t0 = std::chrono::steady_clock::now();
  auto sparse = client::GenerateRemote(*worker.model, client.get(), worker.prompt, go);
  if (!sparse.ok()) return Fail(sparse.status(), global, err);
  const double sparse_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bytes_per_step =
      static_cast<double>(sparse->bytes_received) / std::max<int64_t>(1, sparse->steps);
  nlohmann::json j;
  j["context_id"] = context_;
  j["method"] = method_;
  j["mode"] = mode_;
  j["rho"] = rho_;
  j["prompt_tokens"] = worker.prompt.size();
  j["tokens"] = sparse->tokens;
  j["text"] = Decode(worker.tokenizer.get(), sparse->tokens);
  j["step_p50_ms"] = Percentile(sparse->step_seconds, 0.5) * 1e3;
  j["step_p99_ms"] = Percentile(sparse->step_seconds, 0.99) * 1e3;
  j["bytes_per_step"] = bytes_per_step;
  j["wall_s"] = sparse_s;
  if (!compare_.empty()) {
    if (int rc = CompareWithDense(client.get(), worker, go, &j, global, err); rc != 0) return rc;
  }
  if (global.json) {
    out << j.dump() << "\n";
    return 0;
  }
  PrintText(j, out);
  return 0;
}

int GenerateCommand::SessionOptionsFromFlags(client::GenerateOptions* go, std::ostream& err) const {
  if (max_tokens_ < 1) {
    err << "ctxcache: --max-tokens must be >= 1\n";
    return kExitUsage;
  }
  if (!(rho_ > 0 && rho_ <= 1)) {
    err << "ctxcache: --rho must be in (0, 1]\n";
    return kExitUsage;
  }
  go->session.context_id = context_;
  go->session.method = method_;
  go->session.params["rho"] = std::to_string(rho_);
  if (page_fraction_ > 0) go->session.params["page_fraction"] = std::to_string(page_fraction_);
  for (const std::string& kv : session_params_) {  // --param overrides the flags above
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      err << "ctxcache: --param expects KEY=VALUE, got '" << kv << "'\n";
      return kExitUsage;
    }
    go->session.params[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  go->session.mode = mode_ == "client" ? client::SelectMode::kClient : client::SelectMode::kServer;
  go->max_new_tokens = max_tokens_;
  return 0;
}

int GenerateCommand::LoadWorker(const v1::ContextInfo& info, const GlobalOptions& global, Worker* w,
                                std::ostream& err) const {
  const std::string name = model_.empty() ? info.model_name() : model_;
  const std::filesystem::path dir = std::filesystem::path(model_dir_) / name;
  auto model = model::Model::Load(dir.string());
  if (!model.ok()) {
    err << "ctxcache: cannot load the worker's model from " << dir.string() << ": "
        << model.status().message() << "; pass --model-dir\n";
    return kExitUsage;
  }
  w->model = std::move(model).value();
  const std::string& fp = info.model().fingerprint();
  if (!w->model->spec().fingerprint.empty() && fp.size() == 32 &&
      ToHex(reinterpret_cast<const uint8_t*>(fp.data()), fp.size()) !=
          w->model->spec().fingerprint) {
    err << "ctxcache: the local model " << dir.string() << " differs from the one context "
        << context_ << " was built with (fingerprint mismatch)\n";
    return kExitUsage;
  }
  if (std::filesystem::exists(dir / "tokenizer.model")) {
    auto t = model::Tokenizer::Load((dir / "tokenizer.model").string());
    if (!t.ok()) {
      err << "ctxcache: " << t.status().message() << "\n";
      return kExitUsage;
    }
    w->tokenizer = std::move(t).value();
  }
  if (w->tokenizer) {
    if (Status s = w->tokenizer->Encode(prompt_, &w->prompt); !s.ok()) return Fail(s, global, err);
  }
  if (w->prompt.empty()) {
    err << "ctxcache: the prompt tokenizes to 0 tokens\n";
    return kExitUsage;
  }
  return 0;
}

int GenerateCommand::CompareWithDense(client::Client* client, const Worker& w,
                                      const client::GenerateOptions& go, nlohmann::json* j,
                                      const GlobalOptions& global, std::ostream& err) const {
  client::GenerateOptions dense_opts = go;
  dense_opts.keep_logits = true;
  uint64_t dense_bytes = 0;
  auto t1 = std::chrono::steady_clock::now();
  auto dense =
      client::GenerateDense(*w.model, client, context_, w.prompt, dense_opts, &dense_bytes);
  if (!dense.ok()) return Fail(dense.status(), global, err);
  const double dense_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  // Teacher-forced sparse run on the dense tokens: per-position agreement and KL.
  client::GenerateOptions tf = go;
  tf.forced_tokens = dense->tokens;
  tf.keep_logits = true;
  auto forced = client::GenerateRemote(*w.model, client, w.prompt, tf);
  if (!forced.ok()) return Fail(forced.status(), global, err);
  size_t agree = 0;
  for (size_t i = 0; i < dense->tokens.size() && i < forced->argmax.size(); ++i) {
    agree += forced->argmax[i] == dense->tokens[i];
  }
  const double bytes_per_step = (*j)["bytes_per_step"].get<double>();
  (*j)["dense_text"] = Decode(w.tokenizer.get(), dense->tokens);
  (*j)["dense_tokens"] = dense->tokens;
  (*j)["agreement"] = static_cast<double>(agree) / std::max<size_t>(1, dense->tokens.size());
  (*j)["mean_kl"] = client::MeanKl(dense->logits, forced->logits);
  (*j)["dense_bytes_per_step"] = dense_bytes;
  (*j)["bytes_ratio_vs_dense"] =
      bytes_per_step > 0 ? static_cast<double>(dense_bytes) / bytes_per_step : 0.0;
  (*j)["dense_step_p50_ms"] = Percentile(dense->step_seconds, 0.5) * 1e3;
  (*j)["dense_wall_s"] = dense_s;
  return 0;
}

void GenerateCommand::PrintText(const nlohmann::json& j, std::ostream& out) const {
  out << "--- " << method_ << " (rho " << rho_ << ", " << mode_ << "-side selection) ---\n"
      << j["text"].get<std::string>() << "\n";
  if (!compare_.empty()) {
    out << "--- full attention (dense) ---\n" << j["dense_text"].get<std::string>() << "\n";
    out << std::fixed << std::setprecision(3) << "--- comparison over " << max_tokens_
        << " tokens ---\n"
        << "greedy agreement     " << j["agreement"].get<double>() * 100 << " %\n"
        << std::left << std::setw(21) << ("mean KL(full||" + method_ + ")")
        << j["mean_kl"].get<double>() << "\n"
        << "bytes fetched/step   "
        << HumanBytes(static_cast<uint64_t>(j["bytes_per_step"].get<double>())) << " vs dense "
        << HumanBytes(j["dense_bytes_per_step"].get<uint64_t>()) << " (" << std::setprecision(1)
        << j["bytes_ratio_vs_dense"].get<double>() << "x less)\n";
  }
  out << std::fixed << std::setprecision(2) << "step latency         p50 "
      << j["step_p50_ms"].get<double>() << " ms, p99 " << j["step_p99_ms"].get<double>()
      << " ms (all layers, loopback)\n"
      << "wall time            " << j["wall_s"].get<double>() << " s\n";
}

}  // namespace ctxcache::cli
