// ctxcache-bench tasks: the long-context retrieval task suite through a real
// ctxcached (issue 17). The tasks come from the one generator,
// evals/longctx_tasks.py (niah_single, niah_multi, kv_table, var_track,
// section_copy), written as JSONL with its held-out seed.
//
// Workload (one run):
//   1. start build/bin/ctxcached on a temp data dir (bench/bench_server.h)
//      hosting --model (default models/ctxcache-ref);
//   2. per task: build its context from the task's text (BuildContext, <s>
//      prepended, the indexes of every method asked for), and check the
//      server's token count against the generator's;
//   3. per method and page budget (full once; every other method at each
//      --budgets fraction b, session params rho = page_fraction = b): open a
//      decode session (server-side selection), feed the question through the
//      reference worker (client/worker/decode_worker.h: the real model, each
//      token a streaming update) and greedy-decode len(answer) tokens;
//   4. score exact match of the generated tokens against the answer's;
//   5. evict the context.
// Prints a table (accuracy per method and budget: overall, per family, per
// context length, far (depth <= 0.25) and near (depth >= 0.75) needles) and
// then one JSON object (per-task results and the aggregates) as the last line.
//
// --expect-full-min X and --expect-far-gap G turn it into a check (exit 3):
// full's accuracy must be >= X, and streaming's accuracy on far needles must
// be at least G below full's at every budget.
//
// Usage: ctxcache-bench tasks --tasks FILE.jsonl [--model DIR]
//          [--methods full,oracle,csa,tactic,quest,streaming,lfps]
//          [--budgets 0.02,0.05,0.10] [--limit N] [--shard I/N] [--out FILE]
//          [--session-params k=v,...] [--index-params METHOD:k=v,...]...
//          [--expect-full-min X] [--expect-far-gap G]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_registry.h"
#include "bench/bench_server.h"
#include "client/worker/decode_worker.h"
#include "ctxcache/client.h"
#include "index/methods.h"
#include "index/selector.h"
#include "model/model.h"

namespace ctxcache::bench {
namespace {

using Json = nlohmann::json;

// One task as longctx_tasks.py writes it.
struct TaskSpec {
  std::string id, family, kind;
  int64_t length = 0;
  double depth = 0;
  int64_t n_tokens = 0;  // context tokens with <s>
  int64_t needle_token = 0;
  std::string context;
  std::vector<int32_t> question_ids, answer_ids;
};

StatusOr<std::vector<TaskSpec>> ReadTasks(const std::string& path, int limit) {
  std::ifstream f(path);
  if (!f) return NotFoundError("--tasks: cannot open " + path);
  std::vector<TaskSpec> out;
  std::string line;
  int line_no = 0;
  while (std::getline(f, line) && (limit <= 0 || static_cast<int>(out.size()) < limit)) {
    ++line_no;
    if (line.empty()) continue;
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    const std::string where = std::string(path).append(":").append(std::to_string(line_no));
    if (j.is_discarded() || !j.is_object()) {
      return InvalidArgumentError("--tasks: " + where + " is not a JSON object");
    }
    for (const char* field :
         {"id", "family", "length", "depth", "n_tokens", "context", "question_ids", "answer_ids"}) {
      if (!j.contains(field)) {
        return InvalidArgumentError("--tasks: " + where + " has no field '" + field + "'");
      }
    }
    TaskSpec t;
    try {
      t.id = j["id"].get<std::string>();
      t.family = j["family"].get<std::string>();
      t.kind = j.value("kind", "");
      t.length = j["length"].get<int64_t>();
      t.depth = j["depth"].get<double>();
      t.n_tokens = j["n_tokens"].get<int64_t>();
      t.needle_token = j.value("needle_token", int64_t{0});
      t.context = j["context"].get<std::string>();
      t.question_ids = j["question_ids"].get<std::vector<int32_t>>();
      t.answer_ids = j["answer_ids"].get<std::vector<int32_t>>();
    } catch (const Json::exception& e) {
      return InvalidArgumentError("--tasks: " + where + ": " + e.what());
    }
    if (t.question_ids.empty() || t.answer_ids.empty()) {
      return InvalidArgumentError("--tasks: " + where + " has an empty question or answer");
    }
    out.push_back(std::move(t));
  }
  if (out.empty()) return InvalidArgumentError("--tasks: no tasks in " + path);
  return out;
}

// Writes `text` to path.tmp and renames it over `path`.
Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    if (!f.flush()) return InternalError("cannot write " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return InternalError("cannot rename " + tmp + " to " + path + ": " + ec.message());
  return Status::OK();
}

// One (method, budget) configuration; budget 0 = full attention.
struct Config {
  std::string method;
  double budget = 0;
  std::map<std::string, std::string> extra;  // --session-params (sparse methods)
  std::string Label() const {
    if (budget <= 0) return method;
    char b[32];
    std::snprintf(b, sizeof b, "@%g%%", budget * 100);
    return method + b;
  }
};

struct Outcome {
  bool correct = false;
  std::vector<int32_t> generated;
  double seconds = 0;
  // The mean share of the context a q head attended per layer-step.
  double context_fraction = 0;
  // The mean share of the context's pages its selections touch per (layer,
  // kv head) step (what a page-granular fetch reads).
  double page_fraction = 0;
};

// Greedy-decodes the answer of `task` on the context `context_id` under
// `config` through a server-side-selection session.
StatusOr<Outcome> RunTask(const model::Model& model, client::Client* client,
                          const std::string& context_id, int64_t n_pages, const TaskSpec& task,
                          const Config& config) {
  client::GenerateOptions go;
  go.session.context_id = context_id;
  go.session.method = config.method;
  if (config.budget > 0) {
    const std::string b = std::to_string(config.budget);
    go.session.params = {{"rho", b}, {"page_fraction", b}};
    for (const auto& [k, v] : config.extra) go.session.params[k] = v;
  }
  go.session.mode = client::SelectMode::kServer;
  go.max_new_tokens = static_cast<int>(task.answer_ids.size());
  auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(client::GenerateResult r,
                   client::GenerateRemote(model, client, task.question_ids, go));
  Outcome o;
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  o.generated = r.tokens;
  const model::ModelSpec& spec = model.spec();
  const double head_steps = static_cast<double>(r.steps) * spec.n_layers * spec.n_q_heads;
  if (head_steps > 0 && task.n_tokens > 0) {
    o.context_fraction = static_cast<double>(r.context_tokens_attended) / head_steps /
                         static_cast<double>(task.n_tokens);
  }
  const double kv_steps = static_cast<double>(r.steps) * spec.n_layers * spec.n_kv_heads;
  if (kv_steps > 0 && n_pages > 0) {
    o.page_fraction =
        static_cast<double>(r.context_pages_touched) / kv_steps / static_cast<double>(n_pages);
  }
  o.correct = r.tokens.size() >= task.answer_ids.size() &&
              std::equal(task.answer_ids.begin(), task.answer_ids.end(), r.tokens.begin());
  return o;
}

// Correct / total counters under named groups.
struct Tally {
  std::map<std::string, std::pair<int, int>> groups;
  double context_fraction_sum = 0;  // over the tasks scored
  double page_fraction_sum = 0;
  int tasks = 0;
  void Add(const std::string& group, bool correct) {
    auto& g = groups[group];
    g.first += correct ? 1 : 0;
    g.second += 1;
  }
  double Accuracy(const std::string& group) const {
    auto it = groups.find(group);
    return it == groups.end() || it->second.second == 0
               ? -1.0
               : static_cast<double>(it->second.first) / it->second.second;
  }
};

std::vector<std::string> TaskGroups(const TaskSpec& t) {
  std::vector<std::string> g = {"all", "family:" + t.family, "length:" + std::to_string(t.length)};
  if (t.depth <= 0.25) g.push_back("depth:far");
  if (t.depth >= 0.75) g.push_back("depth:near");
  char d[32];
  std::snprintf(d, sizeof d, "depth:%.2f", t.depth);
  g.push_back(d);
  return g;
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) {
    if (!x.empty()) out.push_back(x);
  }
  return out;
}

void PrintTable(const std::vector<Config>& configs, const std::map<std::string, Tally>& tallies,
                const std::vector<std::string>& columns) {
  std::printf("%-16s", "method@budget");
  for (const auto& c : columns) std::printf(" %12s", c.c_str());
  std::printf(" %9s %9s\n", "ctx_frac", "page_frac");
  for (const Config& c : configs) {
    const Tally& t = tallies.at(c.Label());
    std::printf("%-16s", c.Label().c_str());
    for (const auto& col : columns) {
      const double a = t.Accuracy(col);
      if (a < 0) {
        std::printf(" %12s", "-");
      } else {
        std::printf(" %12.3f", a);
      }
    }
    std::printf(" %9.4f %9.4f\n", t.tasks > 0 ? t.context_fraction_sum / t.tasks : 0.0,
                t.tasks > 0 ? t.page_fraction_sum / t.tasks : 0.0);
  }
}

// One task: builds its context, runs every configuration, tallies the
// results under the task's groups, fills *out (per-task JSON) and evicts the
// context. build_s / decode_s accumulate wall seconds.
Status ScoreTask(const model::Model& model, client::Client* client,
                 const v1::BuildContextRequest& build_template, const TaskSpec& task,
                 const std::vector<Config>& configs, std::map<std::string, Tally>* tallies,
                 Json* out, double* build_s, double* decode_s) {
  v1::BuildContextRequest req = build_template;
  req.set_text(task.context);
  req.set_add_bos(true);
  const auto tb = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(v1::BuildProgress built, client->Build(req, nullptr));
  *build_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - tb).count();
  const v1::ContextInfo& info = built.context();
  if (static_cast<int64_t>(info.n_tokens()) != task.n_tokens) {
    return FailedPreconditionError(std::string("the server tokenized ")
                                       .append(std::to_string(info.n_tokens()))
                                       .append(" tokens, the generator ")
                                       .append(std::to_string(task.n_tokens))
                                       .append(" (a different tokenizer?)"));
  }
  Json& tj = *out;
  tj["id"] = task.id;
  tj["family"] = task.family;
  tj["length"] = task.length;
  tj["depth"] = task.depth;
  tj["n_tokens"] = task.n_tokens;
  tj["needle_token"] = task.needle_token;
  tj["answer_ids"] = task.answer_ids;
  for (const Config& c : configs) {
    const int64_t page = std::max<int64_t>(1, info.block_tokens());
    const int64_t n_pages = (static_cast<int64_t>(info.n_tokens()) + page - 1) / page;
    auto o = RunTask(model, client, info.context_id(), n_pages, task, c);
    if (!o.ok()) return o.status().WithContext(c.Label());
    *decode_s += o->seconds;
    Tally& tally = (*tallies)[c.Label()];
    for (const auto& g : TaskGroups(task)) tally.Add(g, o->correct);
    tally.context_fraction_sum += o->context_fraction;
    tally.page_fraction_sum += o->page_fraction;
    tally.tasks++;
    tj["results"][c.Label()] = {{"correct", o->correct},
                                {"generated", o->generated},
                                {"context_fraction", o->context_fraction},
                                {"page_fraction", o->page_fraction}};
  }
  return client->Evict(info.context_id()).status().WithContext("evict");
}

// The (method, budget) configurations of --methods and --budgets (full
// once), and the indexes a build must add for them (methods not always built).
Status ParseConfigs(const std::string& methods_arg, const std::string& budgets_arg,
                    const std::string& session_params_arg,
                    const std::vector<std::string>& index_params_args,
                    std::vector<Config>* configs, std::vector<double>* budgets,
                    v1::BuildContextRequest* build_req) {
  auto extra = index::ParseParams(session_params_arg);
  if (!extra.ok()) return extra.status().WithContext("--session-params");
  std::map<std::string, index::MethodParams> index_params;
  for (const auto& a : index_params_args) {
    const size_t colon = a.find(':');
    if (colon == std::string::npos || colon == 0) {
      return InvalidArgumentError("--index-params: expected METHOD:k=v[,k=v...], got '" + a +
                                  "'");
    }
    auto p = index::ParseParams(std::string_view(a).substr(colon + 1));
    if (!p.ok()) return p.status().WithContext("--index-params");
    index_params[a.substr(0, colon)] = *std::move(p);
  }
  for (const auto& b : SplitList(budgets_arg)) {
    char* end = nullptr;
    const double v = std::strtod(b.c_str(), &end);
    if (end == b.c_str() || *end != '\0' || !(v > 0 && v <= 1)) {
      return InvalidArgumentError(
          std::string("--budgets: '").append(b).append("' is not in (0, 1]"));
    }
    budgets->push_back(v);
  }
  for (const auto& m : SplitList(methods_arg)) {
    auto info = index::FindMethodInfo(m);
    if (!info.ok()) return info.status().WithContext("--methods");
    if (m == "full") {
      configs->push_back({m, 0, {}});
      continue;
    }
    auto ip = index_params.find(m);
    if (!(*info)->always_built || ip != index_params.end()) {
      v1::IndexSpec* spec = build_req->add_indexes();
      spec->set_method(m);
      if (ip != index_params.end()) {
        for (const auto& [k, v] : ip->second) (*spec->mutable_params())[k] = v;
        index_params.erase(ip);
      }
    }
    for (double b : *budgets) configs->push_back({m, b, *extra});
  }
  if (!index_params.empty()) {
    return InvalidArgumentError("--index-params: method '" + index_params.begin()->first +
                                "' is not in --methods");
  }
  if (configs->empty()) return InvalidArgumentError("--methods: no method given");
  return Status::OK();
}

// The quick test's checks: full's accuracy >= expect_full_min, and on far
// needles full - streaming >= expect_far_gap at every budget (negative =
// unchecked). Returns one line per failed check.
std::vector<std::string> CheckExpectations(std::map<std::string, Tally>& tallies,
                                           const std::vector<double>& budgets,
                                           double expect_full_min, double expect_far_gap) {
  std::vector<std::string> failures;
  if (expect_full_min >= 0) {
    const double full = tallies.count("full") ? tallies["full"].Accuracy("all") : -1;
    if (full < expect_full_min) {
      failures.push_back(std::string("full accuracy ")
                             .append(std::to_string(full))
                             .append(" < ")
                             .append(std::to_string(expect_full_min)));
    }
  }
  if (expect_far_gap >= 0) {
    const double full_far = tallies.count("full") ? tallies["full"].Accuracy("depth:far") : -1;
    for (double b : budgets) {
      const std::string label = Config{"streaming", b, {}}.Label();
      const double st = tallies.count(label) ? tallies[label].Accuracy("depth:far") : -1;
      if (full_far < 0 || st < 0 || full_far - st < expect_far_gap) {
        failures.push_back(std::string("far needles: full ")
                               .append(std::to_string(full_far))
                               .append(" - ")
                               .append(label)
                               .append(" ")
                               .append(std::to_string(st))
                               .append(" < ")
                               .append(std::to_string(expect_far_gap)));
      }
    }
  }
  return failures;
}

int RunTasks(int argc, char** argv) {
  CLI::App app{"ctxcache-bench tasks"};
  std::string tasks_path, model_dir, methods_arg = "full,oracle,csa,tactic,quest,streaming,lfps",
                                     budgets_arg = "0.02,0.05,0.10";
  int limit = 0;
  double expect_full_min = -1, expect_far_gap = -1;
  app.add_option("--tasks", tasks_path, "JSONL from evals/longctx_tasks.py")->required();
  app.add_option("--model", model_dir, "HF model directory (default models/ctxcache-ref)");
  app.add_option("--methods", methods_arg, "Comma-separated methods");
  app.add_option("--budgets", budgets_arg, "Comma-separated page budgets, fractions in (0, 1]");
  app.add_option("--limit", limit, "Only the first N tasks (0 = all)");
  std::string shard_arg;
  app.add_option("--shard", shard_arg,
                 "I/N: only tasks I, I+N, I+2N, ... of the file (0-based), to run N processes "
                 "side by side; bench/plot_tasks.py merges their outputs");
  std::string session_params_arg;
  std::vector<std::string> index_params_args;
  app.add_option("--session-params", session_params_arg,
                 "k=v,...: extra session params for every sparse method (docs/api.md), e.g. "
                 "page_fraction=1 or subgroup=1");
  app.add_option("--index-params", index_params_args,
                 "METHOD:k=v,...: build params of one method's index (repeatable), e.g. "
                 "csa:C=200,alpha=0.4,tau=4");
  std::string out_path;
  app.add_option("--out", out_path,
                 "Also write the JSON here, rewritten after every task (a run cut short keeps "
                 "its results)");
  app.add_option("--expect-full-min", expect_full_min, "Fail (exit 3) below this full accuracy");
  app.add_option("--expect-far-gap", expect_far_gap,
                 "Fail (exit 3) unless full - streaming >= this on far needles, every budget");
  CLI11_PARSE(app, argc, argv);
  if (model_dir.empty()) model_dir = "models/ctxcache-ref";
  const std::filesystem::path mp = std::filesystem::absolute(model_dir);
  if (!std::filesystem::exists(mp / "config.json")) {
    std::cerr << "ctxcache-bench tasks: --model: no config.json in " << mp << "\n";
    return 2;
  }
  auto tasks = ReadTasks(tasks_path, limit);
  if (!tasks.ok()) {
    std::cerr << "ctxcache-bench tasks: " << tasks.status().ToString() << "\n";
    return 2;
  }
  if (!shard_arg.empty()) {
    int shard = -1, shards = 0;
    char tail = 0;
    if (std::sscanf(shard_arg.c_str(), "%d/%d%c", &shard, &shards, &tail) != 2 || shards < 1 ||
        shard < 0 || shard >= shards) {
      std::cerr << "ctxcache-bench tasks: --shard: expected I/N with 0 <= I < N, got '"
                << shard_arg << "'\n";
      return 2;
    }
    std::vector<TaskSpec> mine;
    for (size_t i = shard; i < tasks->size(); i += shards) mine.push_back(std::move((*tasks)[i]));
    if (mine.empty()) {
      std::cerr << "ctxcache-bench tasks: --shard " << shard_arg << ": no tasks (the file has "
                << tasks->size() << ")\n";
      return 2;
    }
    *tasks = std::move(mine);
  }
  std::vector<Config> configs;
  std::vector<double> budgets;
  v1::BuildContextRequest proto_req;
  if (Status st = ParseConfigs(methods_arg, budgets_arg, session_params_arg, index_params_args,
                               &configs, &budgets, &proto_req);
      !st.ok()) {
    std::cerr << "ctxcache-bench tasks: " << st.ToString() << "\n";
    return 2;
  }
  auto model = model::Model::Load(mp.string());
  if (!model.ok()) {
    std::cerr << "ctxcache-bench tasks: load model: " << model.status().ToString() << "\n";
    return 1;
  }
  std::string tmpl = (std::filesystem::temp_directory_path() / "ctxcache-tasks-XXXXXX").string();
  const std::string dir = mkdtemp(tmpl.data());
  testing::ServerProcess server(SelfDir());
  StopOnExit stop_on_exit{&server};
  if (!StartBenchServer(dir, mp.parent_path().string(), mp.filename().string(), &server)) {
    std::cerr << "ctxcache-bench tasks: ctxcached did not start; see " << server.log_path() << "\n";
    return 1;
  }
  client::ClientOptions co;
  co.server = server.address();
  co.max_message_bytes = 64 << 20;
  auto client = std::move(client::Client::Connect(co)).value();

  std::map<std::string, Tally> tallies;
  Json results = Json::array();
  double build_s = 0, decode_s = 0;
  // The JSON of the tasks scored so far (the aggregates and per-task results).
  auto summary = [&]() {
    Json out;
    out["bench"] = "tasks";
    out["model"] = mp.filename().string();
    out["tasks_file"] = tasks_path;
    out["shard"] = shard_arg;
    out["session_params"] = session_params_arg;
    out["index_params"] = index_params_args;
    out["n_tasks"] = results.size();
    out["n_tasks_planned"] = tasks->size();
    out["build_s"] = build_s;
    out["decode_s"] = decode_s;
    out["budgets"] = budgets;
    for (const Config& c : configs) {
      Json a = Json::object();
      for (const auto& [g, ct] : tallies[c.Label()].groups) {
        a[g] = {{"correct", ct.first},
                {"total", ct.second},
                {"accuracy", static_cast<double>(ct.first) / ct.second}};
      }
      const Tally& t = tallies[c.Label()];
      // The mean over tasks of the share of its context a q head attended
      // per layer-step (1 for full; a budget's rho plus the recent pages).
      const double frac = t.tasks > 0 ? t.context_fraction_sum / t.tasks : 0.0;
      // ... and of its pages that the selections touched per (layer, kv
      // head) step.
      const double pages = t.tasks > 0 ? t.page_fraction_sum / t.tasks : 0.0;
      out["accuracy"][c.Label()] = {{"method", c.method},
                                    {"budget", c.budget},
                                    {"mean_context_fraction", frac},
                                    {"mean_page_fraction", pages},
                                    {"groups", a}};
    }
    out["tasks"] = results;
    return out;
  };
  for (const TaskSpec& task : *tasks) {
    Json tj;
    if (Status st = ScoreTask(**model, client.get(), proto_req, task, configs, &tallies, &tj,
                              &build_s, &decode_s);
        !st.ok()) {
      std::cerr << "ctxcache-bench tasks: task " << task.id << ": " << st.ToString() << "\n";
      return 1;
    }
    results.push_back(tj);
    if (!out_path.empty()) {  // after every task, so a run cut short keeps what it scored
      if (Status st = WriteFileAtomically(out_path, summary().dump() + "\n"); !st.ok()) {
        std::cerr << "ctxcache-bench tasks: --out: " << st.ToString() << "\n";
        return 1;
      }
    }
    std::cerr << "task " << results.size() << "/" << tasks->size() << " " << task.family << " "
              << task.length << " depth " << task.depth << ": full "
              << (tj["results"].contains("full") ? tj["results"]["full"]["correct"].dump() : "-")
              << "\n";
  }
  // Table columns: every group seen, in a stable order.
  std::vector<std::string> columns = {"all"};
  for (const auto& [g, _] : tallies.begin()->second.groups) {
    if (g != "all" && g.rfind("depth:0", 0) != 0 && g.rfind("depth:1", 0) != 0) {
      columns.push_back(g);
    }
  }
  PrintTable(configs, tallies, columns);
  Json out = summary();
  const std::vector<std::string> failures =
      CheckExpectations(tallies, budgets, expect_full_min, expect_far_gap);
  out["check_failures"] = failures;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::cout << out.dump() << std::endl;
  for (const auto& f : failures) std::cerr << "ctxcache-bench tasks: check failed: " << f << "\n";
  return failures.empty() ? 0 : 3;
}

CTXCACHE_BENCH("tasks", "long-context retrieval tasks through ctxcached, exact match", RunTasks);

}  // namespace
}  // namespace ctxcache::bench
