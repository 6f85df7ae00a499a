// ctxcache-bench trace: prefills a text file with a model and writes a
// .ctxtrace (model/trace.h, docs/trace-format.md) with the token ids and the
// post-RoPE Q/K/V of the chosen layers and kv heads.
//
// Usage: ctxcache-bench trace --model DIR --text FILE --out FILE
//        [--layers 0,3,7] [--kv-heads 0,1] [--q-last N] [--max-tokens N]
//        [--dtype bf16|f32] [--chunk 512] [--bos]
// Defaults: all layers and kv heads, all query rows, the whole text, bf16.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_registry.h"
#include "common/dtype.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/prefill.h"
#include "model/tokenizer.h"
#include "model/trace.h"
#include "model/trace_sink.h"

namespace ctxcache::bench {
namespace {

using Json = nlohmann::json;

std::vector<int> ParseIntList(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    if (!tok.empty()) out.push_back(std::stoi(tok));
  }
  return out;
}

int RunTrace(int argc, char** argv) {
  CLI::App app{"trace: write a .ctxtrace of a text file"};
  std::string model_dir, text_file, out_file, layers, kv_heads, dtype_name = "bf16";
  int64_t q_last = 0, max_tokens = 0;
  int chunk = 512;
  bool bos = false;
  app.add_option("--model", model_dir, "HF model directory with tokenizer.model")->required();
  app.add_option("--text", text_file, "input text file")->required();
  app.add_option("--out", out_file, "output .ctxtrace")->required();
  app.add_option("--layers", layers, "comma-separated layers (default all)");
  app.add_option("--kv-heads", kv_heads, "comma-separated kv heads (default all)");
  app.add_option("--q-last", q_last, "keep queries of the last N positions only (0 = all)");
  app.add_option("--max-tokens", max_tokens, "truncate the text to N tokens (0 = all)");
  app.add_option("--dtype", dtype_name, "stored dtype: bf16|f16|f32");
  app.add_option("--chunk", chunk, "prefill chunk size");
  app.add_flag("--bos", bos, "prepend the tokenizer's BOS id");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "trace: %s\n", msg.c_str());
    std::printf("%s\n", Json{{"bench", "trace"}, {"error", msg}}.dump().c_str());
    return 1;
  };
  auto dtype = ParseDType(dtype_name);
  if (!dtype.ok()) return fail(dtype.status().ToString());
  auto m = model::Model::Load(model_dir);
  if (!m.ok()) return fail(m.status().ToString());
  auto tok = model::Tokenizer::Load(model_dir + "/tokenizer.model");
  if (!tok.ok()) return fail(tok.status().ToString());
  std::ifstream in(text_file);
  if (!in) return fail("cannot read " + text_file);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids;
  if (bos && (*tok)->bos_id() >= 0) ids.push_back((*tok)->bos_id());
  std::vector<int32_t> body;
  Status st = (*tok)->Encode(text, &body);
  if (!st.ok()) return fail(st.ToString());
  ids.insert(ids.end(), body.begin(), body.end());
  if (max_tokens > 0 && static_cast<int64_t>(ids.size()) > max_tokens) ids.resize(max_tokens);
  if (ids.empty()) return fail("empty text");

  model::TraceSinkOptions so;
  so.layers = ParseIntList(layers);
  so.kv_heads = ParseIntList(kv_heads);
  so.q_last = q_last;
  model::TraceSink sink(so);
  model::KvCache cache((*m)->spec(), DType::kBF16);
  model::PrefillOptions po;
  po.chunk_size = chunk;
  po.logits = model::PrefillOptions::LogitsMode::kNone;
  model::PrefillResult pr;
  st = model::Prefill(**m, ids, &cache, {&sink}, po, &pr);
  if (!st.ok()) return fail(st.ToString());
  sink.SetTokens(ids);
  st = model::WriteTrace(out_file, sink.trace(), *dtype);
  if (!st.ok()) return fail(st.ToString());
  std::ifstream f(out_file, std::ios::binary | std::ios::ate);
  const model::Trace& t = sink.trace();
  Json out = {{"bench", "trace"},
              {"out", out_file},
              {"bytes", static_cast<int64_t>(f.tellg())},
              {"tokens", t.n_tokens()},
              {"layers", t.layers},
              {"kv_heads", t.kv_heads},
              {"q_rows", t.n_q_rows()},
              {"dtype", dtype_name},
              {"prefill_s", pr.seconds},
              {"model_fingerprint", t.model_fingerprint}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

CTXCACHE_BENCH("trace", "write a .ctxtrace (token ids + Q/K/V) of a text file with a model",
               RunTrace);

}  // namespace ctxcache::bench
