// ctxcache-bench index: CSAttention retrieval (or any registered selector)
// against an exact scan and FAISS IndexIVFFlat, per context length N.
//
// Per N (synthetic head, index/synthetic.h, head_dim 128, GQA group 4):
//   build_ms                 selector build per (layer, kv head)
//   csa_select_us            per query (one q head), uniform weights; also
//                            csa_norm_select_us and csa_group_select_us (G heads)
//   exact_select_us          Eigen GEMV over all keys + nth_element
//   faiss_ivf_select_us      IndexIVFFlat (inner product, nlist = 4 sqrt(N)),
//                            smallest swept nprobe whose recall >= CSA's recall
//   csa_bytes_touched / exact_bytes_touched (fp32 keys as scanned; the bf16
//                            KV equivalent is half)
//   recall_at_5pct, attn_mass, output_error for csa uniform, csa norm, csa
//                            compact (loaded from the compact artifact),
//                            faiss and oracle
//   csa_pages                page-level selection at 5% of the pages: the
//                            session core's token-then-pages ranking, page
//                            bins (the GPU kernels' ranking), pooled page
//                            bins and oracle pages, as attention mass
//   index_bytes_per_token plain / compact, kv_bytes_per_token (K+V bf16)
// With --method M other than csa, M is built through BuildSelector with
// --params and measured with the same fields (method_*), next to exact and
// oracle. --trace FILE runs on one (layer, kv head) of a .ctxtrace: the last
// --queries stored query rows are the evaluation queries over the keys
// before the first of them; the earlier rows are the prefill queries.
//
// Usage: ctxcache-bench index [--quick] [--n 8192,32768,131072] [--method csa]
//        [--params m=8,C=128] [--queries 32] [--seed 1] [--regime default|clustered]
//        [--no-faiss] [--trace FILE
//        --layer-slot 0 --kv-slot 0]
// The last stdout line is one JSON object.
#include <dlfcn.h>
#include <faiss/IndexFlat.h>
#include <faiss/IndexIVFFlat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_registry.h"
#include "bench/workload.h"
#include "index/csa.h"
#include "index/metrics.h"
#include "index/oracle.h"
#include "index/page_table.h"
#include "index/selector.h"
#include "index/synthetic.h"
#include "index/topk.h"

namespace ctxcache::bench {
namespace {

using namespace ctxcache::index;  // NOLINT: bench-local
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// "default": SyntheticOptions defaults (RoPE, latent noise 0.5, 128 topics).
// "clustered": tight query clusters (16 topics, noise 0.1, weak locality, no
// RoPE), the regime of tests/index/csa_fidelity_test.cc.
StatusOr<Workload> Synthetic(int64_t n, int steps, uint64_t seed, const std::string& regime) {
  SyntheticOptions o;
  if (regime == "clustered") {
    o.n_topics = 16;
    o.latent_noise = 0.1;
    o.local_std = 0.1;
    o.rope_theta = 0;
  } else if (regime != "default") {
    return InvalidArgumentError("--regime must be default or clustered");
  }
  o.n_tokens = n;
  o.n_decode_steps = steps;
  o.seed = seed;
  o.n_prefill_queries = std::min<int64_t>(n, 16384);
  ASSIGN_OR_RETURN(SyntheticHead h, GenerateSyntheticHead(o));
  return FromSynthetic(std::move(h));
}

struct Reference {
  std::vector<ExactAttention> exact;
  std::vector<std::vector<int32_t>> topk;
};

Json Fidelity(const FidelitySummary& s) {
  return {{"recall_at_5pct", s.recall}, {"attn_mass", s.mass}, {"output_error", s.output_error}};
}

// Runs `sel` on every evaluation query (one q head per call).
struct MethodRun {
  FidelitySummary fid;
  double select_us = 0;
  double bytes_touched = 0;
  double entries_touched = 0;
};

StatusOr<MethodRun> RunSelector(Selector* sel, const Workload& w, const Reference& ref, int64_t k) {
  MethodRun r;
  ArrayKeySource keys(w.keys.data(), w.n, w.d);
  Selection out;
  WorkStats stats;
  for (int i = 0; i < w.n_eval_queries(); ++i) {
    SelectInput in;
    in.queries = w.Q(i);
    in.n_queries = 1;
    in.budget = k;
    in.keys = &keys;
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(sel->Select(in, &out, &stats));
    r.select_us += Us(t0, Clock::now());
    r.bytes_touched += static_cast<double>(stats.bytes_touched);
    r.entries_touched += static_cast<double>(stats.entries_touched);
    const auto& s = out.per_head[0];
    r.fid.Add(RecallAtK(s, ref.topk[i]), ref.exact[i].Mass(s), ref.exact[i].OutputError(s));
  }
  r.fid.Finish();
  r.select_us /= w.n_eval_queries();
  r.bytes_touched /= w.n_eval_queries();
  r.entries_touched /= w.n_eval_queries();
  return r;
}

// Page-level selection (16-token pages) at a budget of 5% of the pages, per
// q head; each method's score is the true attention mass of every token of
// its pages (ExactAttention::Mass), averaged over the evaluation queries:
//   token_then_pages  csa's token selection at 5% of the tokens, its pages
//                     ranked by the estimated softmax mass of their selected
//                     tokens (the session core's page cap);
//   page_bins         every token's csa estimate summed per page, the top
//                     pages (csa_score_pages over token-level lists, the GPU
//                     decode kernels' ranking);
//   page_bins_pooled  page_bins for the mean query of the GQA group, one page
//                     set per kv head (the GPU kernels' pooling);
//   page_softmax_bins (and _pooled) per page the sum of exp(estimate - max)
//                     over all its tokens: the estimated softmax mass, no
//                     token top-k first;
//   page_max_bins     (and _pooled) per page its best token estimate;
//   oracle_pages      the pages of most true attention mass (the ceiling).
// No sink or recent pages are forced, so all of them rank the same budget.
constexpr int kPage = 16;

std::vector<int32_t> TopPages(const std::vector<double>& score, int64_t budget) {
  std::vector<int32_t> order(score.size());
  std::iota(order.begin(), order.end(), 0);
  budget = std::min<int64_t>(budget, static_cast<int64_t>(order.size()));
  std::partial_sort(order.begin(), order.begin() + budget, order.end(), [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  order.resize(budget);
  return order;
}

// Every token id of the pages, ascending.
std::vector<int32_t> PageTokenIds(std::vector<int32_t> pages, int64_t n) {
  std::sort(pages.begin(), pages.end());
  std::vector<int32_t> ids;
  for (int32_t p : pages) {
    for (int64_t t = int64_t{p} * kPage; t < std::min<int64_t>(n, (int64_t{p} + 1) * kPage); ++t) {
      ids.push_back(static_cast<int32_t>(t));
    }
  }
  return ids;
}

// How a page's token estimates (logits) fold into its score: the sum, the
// sum of exp(logit - max) (the page's estimated softmax mass), or the
// largest (what a page-level list's best-key score stands for).
enum class Fold { kSum, kSoftmax, kMax };

// Per page of a context of n tokens, the fold of the logits of `ids`.
std::vector<double> FoldPages(const std::vector<int32_t>& ids, const std::vector<float>& lg,
                              int64_t n, Fold fold) {
  std::vector<double> bins((n + kPage - 1) / kPage,
                           fold == Fold::kMax ? -std::numeric_limits<double>::infinity() : 0.0);
  const float mx = lg.empty() ? 0.0f : *std::max_element(lg.begin(), lg.end());
  for (size_t i = 0; i < ids.size(); ++i) {
    double& b = bins[ids[i] / kPage];
    switch (fold) {
      case Fold::kSum: b += lg[i]; break;
      case Fold::kSoftmax: b += std::exp(static_cast<double>(lg[i]) - mx); break;
      case Fold::kMax: b = std::max(b, static_cast<double>(lg[i])); break;
    }
  }
  return bins;
}

// csa's selection for one query at a token budget, with its logit estimates.
StatusOr<Selection> SelectOne(CsaSelector* csa, const float* q, int64_t budget) {
  SelectInput in;
  in.queries = q;
  in.n_queries = 1;
  in.budget = budget;
  Selection out;
  RETURN_IF_ERROR(csa->Select(in, &out, nullptr));
  return out;
}

// csa's estimate of every token for one query, folded per page.
StatusOr<std::vector<double>> PageBins(CsaSelector* csa, const float* q, int64_t n, Fold fold) {
  // Budget n: every token selected, so per_head_logits holds every estimate.
  ASSIGN_OR_RETURN(Selection out, SelectOne(csa, q, n));
  return FoldPages(out.per_head[0], out.per_head_logits[0], n, fold);
}

StatusOr<Json> PageLevel(CsaSelector* csa, const Workload& w, const Reference& ref, int64_t k) {
  const int64_t n = w.n, n_pages = (n + kPage - 1) / kPage;
  const int64_t budget = PageBudget(0.05, n, kPage);
  double token_pages = 0, bins = 0, pooled = 0, oracle = 0, soft = 0, soft_pooled = 0;
  double maxb = 0, max_pooled = 0;
  std::vector<float> mean(w.d);
  for (int row = 0; row < w.n_eval_rows(); ++row) {
    const float* group = w.EvalQ(row);
    std::fill(mean.begin(), mean.end(), 0.0f);
    for (int g = 0; g < w.G; ++g) {
      for (int j = 0; j < w.d; ++j) mean[j] += group[g * w.d + j] / w.G;
    }
    auto pooled_pages = [&](Fold f) -> StatusOr<std::vector<int32_t>> {
      ASSIGN_OR_RETURN(std::vector<double> b, PageBins(csa, mean.data(), n, f));
      return PageTokenIds(TopPages(b, budget), n);
    };
    ASSIGN_OR_RETURN(const std::vector<int32_t> pooled_ids, pooled_pages(Fold::kSum));
    ASSIGN_OR_RETURN(const std::vector<int32_t> pooled_soft_ids, pooled_pages(Fold::kSoftmax));
    ASSIGN_OR_RETURN(const std::vector<int32_t> pooled_max_ids, pooled_pages(Fold::kMax));
    for (int g = 0; g < w.G; ++g) {
      const int i = row * w.G + g;
      const ExactAttention& e = ref.exact[i];
      // token_then_pages: the selected tokens' estimated mass per page.
      ASSIGN_OR_RETURN(Selection out, SelectOne(csa, w.Q(i), k));
      token_pages += e.Mass(PageTokenIds(
          TopPages(FoldPages(out.per_head[0], out.per_head_logits[0], n, Fold::kSoftmax), budget),
          n));
      auto own_mass = [&](Fold f) -> StatusOr<double> {
        ASSIGN_OR_RETURN(std::vector<double> b, PageBins(csa, w.Q(i), n, f));
        return e.Mass(PageTokenIds(TopPages(b, budget), n));
      };
      ASSIGN_OR_RETURN(double m_sum, own_mass(Fold::kSum));
      ASSIGN_OR_RETURN(double m_soft, own_mass(Fold::kSoftmax));
      ASSIGN_OR_RETURN(double m_max, own_mass(Fold::kMax));
      bins += m_sum;
      soft += m_soft;
      maxb += m_max;
      pooled += e.Mass(pooled_ids);
      soft_pooled += e.Mass(pooled_soft_ids);
      max_pooled += e.Mass(pooled_max_ids);
      std::vector<double> truth(n_pages, 0.0);
      for (int64_t t = 0; t < n; ++t) truth[t / kPage] += e.probs()[t];
      oracle += e.Mass(PageTokenIds(TopPages(truth, budget), n));
    }
  }
  const double q = w.n_eval_queries();
  return Json{{"page_tokens", kPage},         {"page_budget", budget},
              {"n_pages", n_pages},           {"token_then_pages_mass", token_pages / q},
              {"page_bins_mass", bins / q},   {"page_bins_pooled_mass", pooled / q},
              {"page_softmax_bins_mass", soft / q},
              {"page_softmax_bins_pooled_mass", soft_pooled / q},
              {"page_max_bins_mass", maxb / q},
              {"page_max_bins_pooled_mass", max_pooled / q},
              {"oracle_pages_mass", oracle / q}};
}

// OpenMP threads of libfaiss: 1, so FAISS and CSA both run on one core.
void SetOmpThreads(int n) {
  using Fn = void (*)(int);
  if (auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"))) fn(n);
}

Json RunFaiss(const Workload& w, const Reference& ref, int64_t k, double target_recall) {
  const int nlist = static_cast<int>(std::lround(4.0 * std::sqrt(static_cast<double>(w.n))));
  faiss::IndexFlatIP quantizer(w.d);
  faiss::IndexIVFFlat ivf(&quantizer, w.d, nlist, faiss::METRIC_INNER_PRODUCT);
  ivf.cp.niter = 10;
  ivf.verbose = false;
  const int64_t n_train = std::min<int64_t>(w.n, 32LL * nlist);
  const auto t0 = Clock::now();
  ivf.train(n_train, w.keys.data());  // the first n_train keys (a prefix: no shuffling needed)
  ivf.add(w.n, w.keys.data());
  const double build_ms = Us(t0, Clock::now()) / 1000.0;
  Json sweep = Json::array();
  Json chosen;
  std::vector<float> dist(k);
  std::vector<faiss::Index::idx_t> labels(k);
  for (int nprobe = 1; nprobe <= nlist; nprobe *= 2) {
    ivf.nprobe = nprobe;
    FidelitySummary fid;
    double us = 0;
    for (int i = 0; i < w.n_eval_queries(); ++i) {
      const auto a = Clock::now();
      ivf.search(1, w.Q(i), k, dist.data(), labels.data());
      us += Us(a, Clock::now());
      std::vector<int32_t> ids;
      for (faiss::Index::idx_t l : labels) {
        if (l >= 0) ids.push_back(static_cast<int32_t>(l));
      }
      std::sort(ids.begin(), ids.end());
      fid.Add(RecallAtK(ids, ref.topk[i]), ref.exact[i].Mass(ids), ref.exact[i].OutputError(ids));
    }
    fid.Finish();
    Json row = Fidelity(fid);
    row["nprobe"] = nprobe;
    row["select_us"] = us / w.n_eval_queries();
    // Vectors scanned per query (inverted lists probed) + centroids, fp32.
    const double scanned = static_cast<double>(w.n) * nprobe / nlist;
    row["bytes_touched"] = (scanned + nlist) * w.d * sizeof(float);
    sweep.push_back(row);
    if (chosen.is_null() && fid.recall >= target_recall) chosen = row;
    if (!chosen.is_null() && nprobe >= 4 * chosen["nprobe"].get<int>()) break;
    if (nprobe * 2 > nlist && nprobe != nlist) nprobe = nlist / 2;  // end at nlist
  }
  return {{"nlist", nlist},
          {"n_train", n_train},
          {"build_ms", build_ms},
          {"target_recall", target_recall},
          {"chosen", chosen.is_null() ? Json("none reaches target") : chosen},
          {"sweep", sweep}};
}

StatusOr<Json> RunOne(const Workload& w, const std::string& method, const MethodParams& params,
                      bool with_faiss) {
  Json r;
  r["n"] = w.n;
  r["head_dim"] = w.d;
  r["group_size"] = w.G;
  r["eval_queries"] = w.n_eval_queries();
  const int64_t k = BudgetFor(0, 0.05, w.n);
  r["k"] = k;
  // Exact references.
  Reference ref;
  for (int i = 0; i < w.n_eval_queries(); ++i) {
    ASSIGN_OR_RETURN(ExactAttention e,
                     ExactAttention::Compute(w.Q(i), w.keys.data(), w.values.data(), w.n, w.d));
    ref.topk.push_back(e.TopK(k));
    ref.exact.push_back(std::move(e));
  }
  // Exact scan: GEMV + top-K, timed alone (this is the oracle's work).
  {
    std::vector<float> scores(w.n);
    std::vector<int32_t> ids;
    TopKScratch scratch;
    double us = 0;
    FidelitySummary fid;
    for (int i = 0; i < w.n_eval_queries(); ++i) {
      const auto t0 = Clock::now();
      ScoreKeys(w.Q(i), w.keys.data(), w.n, w.d, scores.data());
      SelectTopK(scores.data(), w.n, k, TopKOrder::kById, &ids, &scratch);
      us += Us(t0, Clock::now());
      fid.Add(RecallAtK(ids, ref.topk[i]), ref.exact[i].Mass(ids), ref.exact[i].OutputError(ids));
    }
    fid.Finish();
    r["exact_select_us"] = us / w.n_eval_queries();
    r["exact_bytes_touched"] = static_cast<double>(w.n) * w.d * sizeof(float);
    r["exact_bytes_touched_bf16"] = static_cast<double>(w.n) * w.d * 2;
    r["oracle"] = Fidelity(fid);
  }
  r["kv_bytes_per_token"] = 2 * w.d * 2;  // K + V in bf16

  if (method != "csa") {
    const auto t0 = Clock::now();
    ASSIGN_OR_RETURN(std::unique_ptr<Selector> sel, BuildSelector(method, w.Prefill(), params));
    r["build_ms"] = Us(t0, Clock::now()) / 1000.0;
    ASSIGN_OR_RETURN(MethodRun run, RunSelector(sel.get(), w, ref, k));
    std::string bytes;
    RETURN_IF_ERROR(sel->Serialize(&bytes));
    r["method"] = method;
    r["method_select_us"] = run.select_us;
    r["method_bytes_touched"] = run.bytes_touched;
    r["method_entries_touched"] = run.entries_touched;
    r["method_fidelity"] = Fidelity(run.fid);
    r["index_bytes_per_token"] = static_cast<double>(bytes.size()) / w.n;
    r["memory_bytes"] = sel->MemoryBytes();
    return r;
  }

  ASSIGN_OR_RETURN(CsaOptions opts, ParseCsaOptions(params));
  const auto t0 = Clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<CsaSelector> csa, CsaSelector::Build(w.Prefill(), opts));
  r["build_ms"] = Us(t0, Clock::now()) / 1000.0;
  r["csa_params"] = {{"m", csa->m()},    {"C", csa->C()},
                     {"L", csa->L()},    {"alpha", opts.alpha},
                     {"R", opts.recent}, {"sinks", opts.sinks},
                     {"tau", opts.tau},  {"backoff_cos", opts.backoff_cos}};
  CsaOptions uniform = opts, norm = opts;
  uniform.norm_weights = false;
  uniform.proj_weights = false;
  norm.norm_weights = true;
  norm.proj_weights = false;
  RETURN_IF_ERROR(csa->SetRetrievalOptions(uniform));
  ASSIGN_OR_RETURN(MethodRun u, RunSelector(csa.get(), w, ref, k));
  RETURN_IF_ERROR(csa->SetRetrievalOptions(norm));
  ASSIGN_OR_RETURN(MethodRun nw, RunSelector(csa.get(), w, ref, k));
  r["csa_select_us"] = u.select_us;
  r["csa_norm_select_us"] = nw.select_us;
  r["csa_bytes_touched"] = u.bytes_touched;
  r["csa_entries_touched"] = u.entries_touched;
  r["csa_uniform"] = Fidelity(u.fid);
  r["csa_norm"] = Fidelity(nw.fid);
  {
    RETURN_IF_ERROR(csa->SetRetrievalOptions(opts));  // the built options (weights=norm)
    ASSIGN_OR_RETURN(r["csa_pages"], PageLevel(csa.get(), w, ref, k));
  }
  // One call for the whole GQA group (union over G heads).
  {
    RETURN_IF_ERROR(csa->SetRetrievalOptions(uniform));
    Selection out;
    double us = 0, merged = 0;
    for (int row = 0; row < w.n_eval_rows(); ++row) {
      SelectInput in;
      in.queries = w.Q(row * w.G);
      in.n_queries = w.G;
      in.budget = k;
      const auto a = Clock::now();
      RETURN_IF_ERROR(csa->Select(in, &out, nullptr));
      us += Us(a, Clock::now());
      merged += static_cast<double>(out.merged.size());
    }
    r["csa_group_select_us"] = us / w.n_eval_rows();
    r["csa_group_union_tokens"] = merged / w.n_eval_rows();
  }
  // Streaming append cost (try-insert into all m*C lists).
  {
    std::unique_ptr<Selector> copy = csa->Clone();
    const int n_append = 64;
    const auto a = Clock::now();
    for (int i = 0; i < n_append; ++i) {
      RETURN_IF_ERROR(copy->Append(w.keys.data() + (i % w.n) * w.d, nullptr, nullptr));
    }
    r["csa_append_us"] = Us(a, Clock::now()) / n_append;
  }
  // Serialized sizes; the compact artifact is reloaded and measured.
  std::string plain, compact;
  csa->SerializePlain(&plain);
  csa->SerializeCompact(&compact);
  r["index_bytes_per_token"] = {{"plain", static_cast<double>(plain.size()) / w.n},
                                {"compact", static_cast<double>(compact.size()) / w.n}};
  r["index_to_kv_ratio"] = {{"plain", static_cast<double>(plain.size()) / w.n / (4.0 * w.d)},
                            {"compact", static_cast<double>(compact.size()) / w.n / (4.0 * w.d)}};
  {
    ASSIGN_OR_RETURN(std::unique_ptr<CsaSelector> loaded, CsaSelector::Load(compact));
    RETURN_IF_ERROR(loaded->SetRetrievalOptions(uniform));
    ASSIGN_OR_RETURN(MethodRun cu, RunSelector(loaded.get(), w, ref, k));
    r["csa_compact_uniform"] = Fidelity(cu.fid);
    r["compact_recall_delta_points"] = 100.0 * (cu.fid.recall - u.fid.recall);
  }
  r["speedup_vs_exact"] = r["exact_select_us"].get<double>() / u.select_us;
  r["bytes_reduction_vs_exact"] = r["exact_bytes_touched"].get<double>() / u.bytes_touched;
  if (with_faiss) {
    r["faiss_ivf"] = RunFaiss(w, ref, k, u.fid.recall);
    const Json& chosen = r["faiss_ivf"]["chosen"];
    if (chosen.is_object()) {
      r["faiss_ivf_select_us"] = chosen["select_us"];
      r["faiss_ivf_nprobe"] = chosen["nprobe"];
      r["faiss"] = Fidelity(FidelitySummary{chosen["recall_at_5pct"].get<double>(),
                                            chosen["attn_mass"].get<double>(),
                                            chosen["output_error"].get<double>(), 1});
    } else {
      r["faiss_ivf_select_us"] = nullptr;
    }
  }
  return r;
}

int RunIndexBench(int argc, char** argv) {
  CLI::App app{"index: CSAttention (or --method) vs exact scan and FAISS IVF"};
  bool quick = false, no_faiss = false;
  std::string n_list, method = "csa", params_text, trace, regime = "default";
  int queries = 0, layer_slot = 0, kv_slot = 0;
  uint64_t seed = 1;
  app.add_flag("--quick", quick, "N = 8K, 32K and fewer queries (< 60 s on 2 cores)");
  app.add_option("--n", n_list, "comma-separated context lengths (default 8192,32768,131072)");
  app.add_option("--method", method, "selector method (default csa)");
  app.add_option("--params", params_text, "method parameters, e.g. m=8,C=128,alpha=0.25");
  app.add_option("--queries", queries,
                 "decode steps evaluated (x G q heads); default 32, 16 quick");
  app.add_option("--seed", seed, "synthetic seed (default 1)");
  app.add_option("--regime", regime, "synthetic regime: default | clustered");
  app.add_option("--trace", trace, "a .ctxtrace file instead of synthetic data");
  app.add_option("--layer-slot", layer_slot, "stored layer slot of the trace (default 0)");
  app.add_option("--kv-slot", kv_slot, "stored kv head slot of the trace (default 0)");
  app.add_flag("--no-faiss", no_faiss, "skip the FAISS IVF comparison");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "index bench: %s\n", s.ToString().c_str());
    return 1;
  };
  auto params = ParseParams(params_text);
  if (!params.ok()) return fail(params.status());
  const auto methods = SelectorMethods();
  if (std::find(methods.begin(), methods.end(), method) == methods.end()) {
    return fail(InvalidArgumentError("unknown --method " + method));
  }
  if (queries <= 0) queries = quick ? 16 : 32;
  std::vector<int64_t> ns;
  if (n_list.empty()) n_list = quick ? "8192,32768" : "8192,32768,131072";
  std::stringstream ss(n_list);
  for (std::string item; std::getline(ss, item, ',');) ns.push_back(std::stoll(item));
  SetOmpThreads(1);

  Json result;
  result["workload"] = "index";
  result["method"] = method;
  result["params"] = params_text;
  result["quick"] = quick;
  result["source"] = trace.empty() ? "synthetic" : trace;
  result["seed"] = seed;
  result["regime"] = regime;
  Json runs = Json::array();
  const auto start = Clock::now();
  if (!trace.empty()) {
    auto w = FromTrace(trace, layer_slot, kv_slot, queries, 256, "--queries");
    if (!w.ok()) return fail(w.status());
    auto r = RunOne(*w, method, *params, !no_faiss);
    if (!r.ok()) return fail(r.status());
    (*r)["layer_slot"] = layer_slot;
    (*r)["kv_slot"] = kv_slot;
    runs.push_back(*r);
  } else {
    for (int64_t n : ns) {
      auto w = Synthetic(n, queries, seed, regime);
      if (!w.ok()) return fail(w.status());
      auto r = RunOne(*w, method, *params, !no_faiss);
      if (!r.ok()) return fail(r.status());
      std::fprintf(stderr, "index bench: N=%lld done\n", static_cast<long long>(n));
      runs.push_back(*r);
    }
  }
  result["runs"] = runs;
  result["wall_s"] = Us(start, Clock::now()) / 1e6;
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

}  // namespace

CTXCACHE_BENCH("index", "CSAttention (or --method) vs exact scan and FAISS IVF", RunIndexBench);

}  // namespace ctxcache::bench
