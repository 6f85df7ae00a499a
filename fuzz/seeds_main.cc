// ctxcache_fuzz_seeds OUT_DIR: writes a valid seed corpus for every fuzz
// target, OUT_DIR/<target>/<name>, from the project's own writers (index
// builders over index/synthetic.h data, EncodePage, the manifest proto,
// ServerConfig::ToToml, KeysFile::Serialize, WriteSafetensors, WriteTrace),
// so no binary blobs are committed. Deterministic; the directory's previous
// contents are removed first. Small text seeds live in fuzz/seeds/ too.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "auth/keys_file.h"
#include "auth/tenants.h"
#include "index/csa.h"
#include "index/selector.h"
#include "index/synthetic.h"
#include "model/safetensors.h"
#include "model/trace.h"
#include "service/config.h"
#include "storage/manifest_codec.h"
#include "storage/page_codec.h"
#include "storage/store.h"

namespace fs = std::filesystem;
using namespace ctxcache;

namespace {

fs::path g_out;

void Put(const std::string& target, const std::string& name, std::string_view bytes) {
  fs::create_directories(g_out / target);
  std::ofstream f(g_out / target / name, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) {
    std::fprintf(stderr, "cannot write %s/%s\n", target.c_str(), name.c_str());
    std::exit(1);
  }
}

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void Check(const Status& s, const std::string& what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what.c_str(), s.ToString().c_str());
    std::exit(1);
  }
}

void IndexSeeds() {
  index::SyntheticOptions o;
  o.n_tokens = 96;
  o.head_dim = 16;
  o.group_size = 2;
  o.n_prefill_queries = 32;
  o.n_decode_steps = 1;
  o.n_topics = 8;
  o.latent_dim = 8;
  o.mean_segment = 16;
  StatusOr<index::SyntheticHead> head = index::GenerateSyntheticHead(o);
  Check(head.status(), "synthetic head");
  index::HeadPrefill prefill = head->Prefill();
  struct Config {
    std::string method, name;
    index::MethodParams params;
  };
  const std::vector<Config> configs = {
      {"csa", "compact", {{"m", "4"}, {"C", "8"}, {"L", "12"}, {"format", "compact"}}},
      {"csa", "plain", {{"m", "4"}, {"C", "8"}, {"L", "12"}, {"format", "plain"}}},
      {"csa", "weights_proj", {{"m", "2"}, {"C", "4"}, {"alpha", "0.25"}, {"weights", "proj"},
                               {"missing", "mean"}}},
      {"tactic", "default", {{"cluster", "8"}}},
      {"lfps", "default", {}},
      {"quest", "default", {{"page", "8"}}},
      {"streaming", "default", {}},
      {"full", "default", {}},
      {"oracle", "default", {}},
  };
  for (const Config& c : configs) {
    StatusOr<std::unique_ptr<index::Selector>> sel =
        index::BuildSelector(c.method, prefill, c.params);
    Check(sel.status(), "build " + c.method + " " + c.name);
    std::string bytes;
    Check((*sel)->Serialize(&bytes), "serialize " + c.method);
    Put("fuzz_index_" + c.method, c.name, bytes);
    // One appended token: the streaming-updated tables serialize too.
    if ((*sel)->Append(head->decode_keys.data(), head->decode_values.data(),
                       head->DecodeQueries(0)).ok()) {
      bytes.clear();
      Check((*sel)->Serialize(&bytes), "serialize appended " + c.method);
      Put("fuzz_index_" + c.method, c.name + "_appended", bytes);
    }
  }
}

void PageSeeds() {
  int i = 0;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (storage::PageCodec codec : {storage::PageCodec::kNone, storage::PageCodec::kZstd,
                                     storage::PageCodec::kZstdShuffle}) {
      storage::PageShape shape{dtype, static_cast<uint32_t>(3 + i), 8};
      std::string raw(shape.RawBytes(), '\0');
      for (size_t b = 0; b < raw.size(); ++b) raw[b] = static_cast<char>((b * 31) % 7);
      storage::PageCodecOptions opt;
      opt.codec = codec;
      std::string page;
      Check(storage::EncodePage(opt, shape, raw, &page), "encode page");
      Put("fuzz_page_codec", "page" + std::to_string(i++), page);
    }
  }
}

void ManifestSeeds() {
  v1::ContextManifest m;
  m.set_context_id(std::string(16, '\x11'));
  m.set_format_version(storage::kFormatVersion);
  m.set_state(v1::CONTEXT_STATE_READY);
  m.set_n_tokens(1000);
  m.set_block_tokens(64);
  m.set_zstd_level(1);
  m.set_tenant("acme");
  m.set_name("fuzz seed");
  (*m.mutable_labels())["k"] = "v";
  m.set_stored_bytes(123456);
  m.set_created_at_ms(1700000000000);
  Put("fuzz_manifest", "ready", storage::EncodeManifest(m));
  Put("fuzz_manifest", "ready-unframed", m.SerializeAsString());  // format 1 values
  m.set_parent_id(std::string(16, '\x22'));
  m.set_prefix_tokens(512);
  m.set_shared_blocks(8);
  m.set_id_namespace("B" + std::string(32, '\x33'));
  Put("fuzz_manifest", "child", storage::EncodeManifest(m));
  m.set_state(v1::CONTEXT_STATE_FAILED);
  m.set_error("build failed");
  Put("fuzz_manifest", "failed", storage::EncodeManifest(m));
}

void TextSeeds() {
  Put("fuzz_server_config", "defaults.toml", service::ServerConfig{}.ToToml());
  auth::KeysFile keys;
  auth::KeyEntry k;
  k.id = "5aee8bcad8d9";
  k.tenant = "acme";
  k.role = auth::Role::kBuilder;
  k.salt = std::string(16, '\x01');
  k.sha256 = std::string(32, '\x02');
  k.created_s = 1700000000;
  keys.keys.push_back(k);
  k.id = "0123456789ab";
  k.tenant = "-";
  k.role = auth::Role::kOperator;
  keys.keys.push_back(k);
  keys.subjects.push_back({"worker-a", "acme", auth::Role::kReader});
  Put("fuzz_keys_file", "generated", keys.Serialize());
  Check(auth::KeysFile::Parse(keys.Serialize()).status(), "keys seed parses");
  const std::string tenants = "[default]\nmax_stored_bytes = 1G\n[tenant.acme]\nmax_contexts = 5\n";
  Check(auth::TenantsConfig::Parse(tenants).status(), "tenants seed parses");
  Put("fuzz_tenants", "generated", tenants);
}

void ModelSeeds(const fs::path& source_dir) {
  // config.json of the shipped model(s).
  int i = 0;
  for (const auto& e : fs::directory_iterator(source_dir / "models")) {
    if (fs::exists(e.path() / "config.json")) {
      Put("fuzz_model_config", "config" + std::to_string(i++) + ".json",
          Slurp(e.path() / "config.json"));
    }
  }
  // A small safetensors file: f32, i64 and shapes that exercise the header.
  const fs::path tmp = g_out / "tmp.safetensors";
  std::vector<model::TensorToWrite> tensors;
  {
    model::TensorToWrite t{"w", model::TensorDType::kF32, {2, 3}, std::string(24, '\0')};
    tensors.push_back(t);
    model::TensorToWrite ids{"ids", model::TensorDType::kI64, {4}, std::string(32, '\x01')};
    tensors.push_back(ids);
    model::TensorToWrite scalar{"s", model::TensorDType::kF32, {}, std::string(4, '\x3f')};
    tensors.push_back(scalar);
  }
  Check(model::WriteSafetensors(tmp.string(), tensors), "write safetensors");
  Put("fuzz_safetensors", "small", Slurp(tmp));
  fs::remove(tmp);
  // A small trace, in f32 and bf16.
  model::Trace t;
  t.tokens = {1, 2, 3, 4};
  t.n_layers_total = 2;
  t.n_q_heads = 2;
  t.n_kv_heads = 1;
  t.head_dim = 4;
  t.rope_theta = 10000;
  t.layers = {1};
  t.kv_heads = {0};
  t.q_positions = {2, 3};
  t.q = {std::vector<float>(2 * 2 * 4, 0.25f)};
  t.k = {std::vector<float>(4 * 4, -0.5f)};
  t.v = {std::vector<float>(4 * 4, 1.0f)};
  const fs::path trace = g_out / "tmp.ctxtrace";
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Check(model::WriteTrace(trace.string(), t, dtype), "write trace");
    Put("fuzz_trace", std::string(DTypeName(dtype)), Slurp(trace));
  }
  fs::remove(trace);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s OUT_DIR SOURCE_DIR\n", argv[0]);
    return 2;
  }
  g_out = argv[1];
  fs::remove_all(g_out);
  fs::create_directories(g_out);
  IndexSeeds();
  PageSeeds();
  ManifestSeeds();
  TextSeeds();
  ModelSeeds(argv[2]);
  std::printf("fuzz seeds written to %s\n", g_out.c_str());
  return 0;
}
