#include "index/tactic.h"

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>

#include "common/thread_pool.h"
#include "index/byte_io.h"
#include "index/eigen_blocking.h"
#include "index/kmeans.h"
#include "index/params.h"

namespace ctxcache::index {
namespace {

Status CheckOptions(const TacticOptions& o) {
  if (o.avg_cluster_size < 1) return InvalidArgumentError("tactic: avg_cluster_size must be >= 1");
  if (o.max_iters < 1) return InvalidArgumentError("tactic: max_iters must be >= 1");
  if (!(o.target > 0 && o.target <= 1)) return InvalidArgumentError("tactic: P must be in (0, 1]");
  if (!(o.n0_frac >= 0 && o.n0_frac < 1))
    return InvalidArgumentError("tactic: n0 must be in [0, 1)");
  if (!(o.p1 > 0 && o.p1 < o.p2 && o.p2 < 1)) {
    return InvalidArgumentError("tactic: expected 0 < p1 < p2 < 1");
  }
  if (o.window < 1) return InvalidArgumentError("tactic: w must be >= 1");
  if (o.recluster_every < o.avg_cluster_size) {
    return InvalidArgumentError("tactic: recluster must be >= the average cluster size");
  }
  if (o.n_sink < 0) return InvalidArgumentError("tactic: sinks must be >= 0");
  if (o.n_recent < 0) return InvalidArgumentError("tactic: recent must be >= 0");
  return Status::OK();
}

}  // namespace

InverseFit FitInverse(double x1, double mu1, double x2, double mu2) {
  InverseFit f;
  const double d = 1.0 / x1 - 1.0 / x2;
  f.a = d != 0 ? (mu1 - mu2) / d : 0.0;
  f.b = mu1 - f.a / x1;
  return f;
}

int64_t CumulativeBudget(const std::vector<double>& s, double target) {
  double total = 0;
  for (double v : s) total += v;
  if (!(total > 0)) return static_cast<int64_t>(s.size());
  const double goal = target * total;
  double acc = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    acc += s[i];
    if (acc >= goal) return static_cast<int64_t>(i) + 1;
  }
  return static_cast<int64_t>(s.size());
}

StatusOr<TacticOptions> ParseTacticParams(const MethodParams& params) {
  ParamReader r("tactic", params);
  TacticOptions o;
  ASSIGN_OR_RETURN(int64_t cluster, r.Int("cluster", o.avg_cluster_size, 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t iters, r.Int("iters", o.max_iters, 1, 1000));
  ASSIGN_OR_RETURN(int64_t seed, r.Int("seed", static_cast<int64_t>(o.seed), 0, INT64_MAX));
  ASSIGN_OR_RETURN(o.target, r.Double("P", o.target, 1e-6, 1.0));
  ASSIGN_OR_RETURN(o.n0_frac, r.Double("n0", o.n0_frac, 0.0, 0.5));
  ASSIGN_OR_RETURN(o.p1, r.Double("p1", o.p1, 1e-6, 0.999));
  ASSIGN_OR_RETURN(o.p2, r.Double("p2", o.p2, 1e-6, 0.999));
  ASSIGN_OR_RETURN(int64_t w, r.Int("w", o.window, 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t re, r.Int("recluster", o.recluster_every, 1, 1 << 24));
  ASSIGN_OR_RETURN(int64_t sinks, r.Int("sinks", o.n_sink, 0, 1 << 20));
  ASSIGN_OR_RETURN(int64_t recent, r.Int("recent", o.n_recent, 0, 1 << 20));
  RETURN_IF_ERROR(r.Finish());
  o.avg_cluster_size = static_cast<int>(cluster);
  o.max_iters = static_cast<int>(iters);
  o.seed = static_cast<uint64_t>(seed);
  o.window = static_cast<int>(w);
  o.recluster_every = static_cast<int>(re);
  o.n_sink = static_cast<int>(sinks);
  o.n_recent = static_cast<int>(recent);
  RETURN_IF_ERROR(CheckOptions(o));
  return o;
}

namespace {

// Flat k-means up to this many clusters; above it, two levels.
constexpr int64_t kFlatMaxClusters = 64;

// L2 k-means of n keys into about k clusters: flat for k <= kFlatMaxClusters;
// above, ceil(sqrt(k)) coarse clusters, then each coarse cluster of n_c keys
// split into about n_c * k / n clusters (k in total; both levels random-seeded
// Lloyd, `iters` iterations), then one flat Lloyd step from those centroids
// (assign every key to its nearest centroid, then move each centroid to its
// members' mean). The levels cost O(n sqrt(k) d) per iteration instead of
// O(n k d); the flat step is one n x k x d GEMM. Empty clusters may remain
// (AddClusters drops them).
StatusOr<KMeansResult> ClusterKeys(const float* keys, int64_t n, int d, int64_t k, int iters,
                                   uint64_t seed) {
  KMeansOptions ko;
  ko.metric = KMeansMetric::kL2;
  ko.init = KMeansInit::kRandom;  // Tactic §3.2: random seeds from the data
  ko.max_iters = iters;
  ko.seed = seed;
  if (k <= kFlatMaxClusters) {
    ko.k = static_cast<int>(k);
    return KMeans(keys, n, d, d, ko);
  }
  ko.k = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(k))));
  ASSIGN_OR_RETURN(KMeansResult coarse, KMeans(keys, n, d, d, ko));
  std::vector<std::vector<int64_t>> members(ko.k);
  for (int64_t i = 0; i < n; ++i) members[coarse.assign[i]].push_back(i);
  // Split k over the coarse clusters in proportion to their sizes (largest
  // remainder, each in [1, n_c] when non-empty), so the total stays k.
  std::vector<int64_t> kc(ko.k, 0);
  {
    std::vector<std::pair<double, int>> rem;
    int64_t given = 0;
    for (int c = 0; c < ko.k; ++c) {
      const int64_t nc = static_cast<int64_t>(members[c].size());
      if (nc == 0) continue;
      const double share =
          static_cast<double>(nc) * static_cast<double>(k) / static_cast<double>(n);
      kc[c] = std::clamp<int64_t>(static_cast<int64_t>(share), 1, nc);
      given += kc[c];
      rem.emplace_back(share - static_cast<double>(kc[c]), c);
    }
    std::sort(rem.begin(), rem.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (size_t r = 0; given < k && r < rem.size(); ++r) {
      const int c = rem[r].second;
      if (kc[c] < static_cast<int64_t>(members[c].size())) {
        ++kc[c];
        ++given;
      }
    }
  }
  // Coarse clusters are split in parallel, taken one at a time by the pool's
  // threads (each fine KMeans single-threaded).
  std::vector<RowMatrixXf> fine(ko.k);
  std::vector<Status> errs(ko.k);
  std::atomic<int> next_cluster{0};
  ThreadPool* pool = ThreadPool::Default();
  pool->ParallelFor(std::min<size_t>(ko.k, pool->size() + 1), [&](size_t, size_t) {
    RowMatrixXf sub;
    for (int c = next_cluster++; c < ko.k; c = next_cluster++) {
      const auto& mem = members[c];
      const int64_t nc = static_cast<int64_t>(mem.size());
      if (nc == 0) continue;
      sub.resize(nc, d);
      for (int64_t i = 0; i < nc; ++i) std::copy_n(keys + mem[i] * d, d, sub.row(i).data());
      KMeansOptions fo = ko;
      fo.k = static_cast<int>(kc[c]);
      fo.seed = seed + 1 + static_cast<uint64_t>(c);
      fo.parallel = false;
      auto km = KMeans(sub.data(), nc, d, d, fo);
      if (!km.ok()) {
        errs[c] = km.status();
        continue;
      }
      fine[c] = std::move(km->centroids);
    }
  });
  std::vector<float> centroids;
  int32_t next = 0;
  for (int c = 0; c < ko.k; ++c) {
    RETURN_IF_ERROR(errs[c]);
    centroids.insert(centroids.end(), fine[c].data(), fine[c].data() + fine[c].size());
    next += static_cast<int32_t>(fine[c].rows());
  }
  // One flat Lloyd step over all keys and centroids: every key joins its
  // nearest centroid of any coarse cluster (keys near a coarse boundary
  // move), then each centroid becomes the mean of its members.
  KMeansResult out;
  out.centroids = Eigen::Map<const RowMatrixXf>(centroids.data(), next, d);
  out.assign.resize(n);
  AssignNearest(keys, n, d, d, out.centroids, KMeansMetric::kL2, out.assign.data(), nullptr);
  RowMatrixXf sums = RowMatrixXf::Zero(next, d);
  std::vector<int64_t> count(next, 0);
  for (int64_t i = 0; i < n; ++i) {
    sums.row(out.assign[i]) += Eigen::Map<const Eigen::RowVectorXf>(keys + i * d, d);
    ++count[out.assign[i]];
  }
  for (int32_t c = 0; c < next; ++c) {
    if (count[c] > 0) out.centroids.row(c) = sums.row(c) / static_cast<float>(count[c]);
  }
  out.iterations = coarse.iterations;
  return out;
}

}  // namespace

Status TacticSelector::AddClusters(const float* keys, int64_t n, int32_t first_id, uint64_t seed) {
  const int d = head_dim_;
  ASSIGN_OR_RETURN(KMeansResult km,
                   ClusterKeys(keys, n, d, std::max<int64_t>(1, n / options_.avg_cluster_size),
                               options_.max_iters, seed));
  const int64_t k = km.centroids.rows();
  std::vector<int64_t> count(k + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++count[km.assign[i] + 1];
  // Drop empty clusters; keep CSR order = centroid order.
  Clusters& cl = MutableClusters();
  const int64_t base = static_cast<int64_t>(cl.members.size());
  std::vector<int64_t> start(k, 0);
  int64_t acc = base;
  for (int64_t c = 0; c < k; ++c) {
    start[c] = acc;
    acc += count[c + 1];
  }
  cl.members.resize(base + n);
  std::vector<int64_t> fill = start;
  for (int64_t i = 0; i < n; ++i)
    cl.members[fill[km.assign[i]]++] = first_id + static_cast<int32_t>(i);
  for (int64_t c = 0; c < k; ++c) {
    if (count[c + 1] == 0) continue;
    cl.centroids.insert(cl.centroids.end(), km.centroids.row(c).data(),
                        km.centroids.row(c).data() + d);
    cl.offsets.push_back(start[c] + count[c + 1]);
  }
  n_ranked_ += n;
  return Status::OK();
}

StatusOr<std::unique_ptr<TacticSelector>> TacticSelector::Build(const float* keys, int64_t n_tokens,
                                                                int head_dim,
                                                                const TacticOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  HeadPrefill p;
  p.n_tokens = n_tokens;
  p.head_dim = head_dim;
  p.keys = keys;
  RETURN_IF_ERROR(ValidatePrefill("tactic", p, /*need_queries=*/false, /*need_values=*/false));
  std::unique_ptr<TacticSelector> sel(new TacticSelector());
  sel->head_dim_ = head_dim;
  sel->options_ = options;
  sel->n_tokens_ = n_tokens;
  sel->n_sink_ = std::min<int64_t>(options.n_sink, n_tokens - 1);  // >= 1 token to cluster
  // The last `recent` tokens start as the tail: always selected until re-clustered.
  const int64_t recent =
      std::min<int64_t>({static_cast<int64_t>(options.n_recent), n_tokens - sel->n_sink_ - 1,
                         static_cast<int64_t>(options.recluster_every) - 1});
  const int64_t clustered = n_tokens - sel->n_sink_ - recent;
  RETURN_IF_ERROR(sel->AddClusters(keys + sel->n_sink_ * head_dim, clustered,
                                   static_cast<int32_t>(sel->n_sink_), options.seed));
  sel->tail_keys_.assign(keys + (n_tokens - recent) * head_dim, keys + n_tokens * head_dim);
  return sel;
}

Status TacticSelector::SetTarget(double target) {
  if (!(target > 0 && target <= 1)) {
    return InvalidArgumentError("tactic: target P=" + std::to_string(target) +
                                ", expected in (0, 1]");
  }
  options_.target = target;
  return Status::OK();
}

Status TacticSelector::ApplySessionOverrides(const MethodParams& overrides) {
  for (const auto& [k, v] : overrides) {
    if (k != "P") {
      return InvalidArgumentError("tactic: per-session param '" + k + "'; expected P");
    }
    char* end = nullptr;
    const double p = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0') return InvalidArgumentError("tactic: P='" + v + "'");
    RETURN_IF_ERROR(SetTarget(p));
  }
  return Status::OK();
}

void TacticSelector::RankTokens(const float* q, std::vector<int32_t>* order,
                                std::vector<int64_t>* cluster_end) const {
  const int64_t C = n_clusters();
  const int d = head_dim_;
  Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> cent(
      cl_->centroids.data(), C, d);
  Eigen::Map<const Eigen::VectorXf> qv(q, d);
  Eigen::VectorXf score = cent * qv;
  std::vector<int32_t> rank(C);
  std::iota(rank.begin(), rank.end(), 0);
  std::sort(rank.begin(), rank.end(), [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  order->clear();
  order->reserve(n_ranked_);
  cluster_end->clear();
  cluster_end->reserve(C);
  for (int32_t c : rank) {
    order->insert(order->end(), cl_->members.begin() + cl_->offsets[c],
                  cl_->members.begin() + cl_->offsets[c + 1]);
    cluster_end->push_back(static_cast<int64_t>(order->size()));
  }
}

Status TacticSelector::SelectHead(const float* q, int64_t budget, const KeySource& keys,
                                  std::vector<int32_t>* ids, TacticHeadEstimate* est,
                                  WorkStats* stats) const {
  const int d = head_dim_;
  const int64_t n = n_ranked_;
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<int32_t> order;
  std::vector<int64_t> cend;
  RankTokens(q, &order, &cend);
  *est = TacticHeadEstimate{};
  est->n_ranked = n;
  est->sinks = n_sink_;
  est->tail = n_tokens_ - n_sink_ - n_ranked_;
  uint64_t scored = 0;

  int64_t k_sel = 0;
  if (budget > 0) {
    // Fixed budget: whole clusters in rank order while they fit (at least one).
    const int64_t room = std::max<int64_t>(0, budget - est->tail - n_sink_);
    int64_t prev = 0;
    for (int64_t end : cend) {
      if (end > room && prev > 0) break;
      prev = end;
      if (end >= room) break;
    }
    k_sel = std::min(prev, n);
    est->k_fit = k_sel;
    est->estimated_mass = -1;
  } else {
    // Which ranks get exact scores: [0, N0) and the two windows (0-based ranks).
    const int64_t w = std::min<int64_t>(options_.window, n);
    int64_t n0 = std::min<int64_t>(n, static_cast<int64_t>(std::ceil(options_.n0_frac * n)));
    const bool exact_all = n0 + 2 * w >= n / 2;  // sampling would cost as much as scoring all
    if (exact_all) n0 = n;
    auto window_begin = [&](double p) {
      const int64_t centre = static_cast<int64_t>(std::llround(p * n));
      return std::clamp<int64_t>(centre - w / 2, 0, n - w);
    };
    const int64_t b1 = exact_all ? 0 : window_begin(options_.p1);
    const int64_t b2 = exact_all ? 0 : window_begin(options_.p2);
    std::vector<int32_t> fetch(order.begin(), order.begin() + n0);
    if (!exact_all) {
      fetch.insert(fetch.end(), order.begin() + b1, order.begin() + b1 + w);
      fetch.insert(fetch.end(), order.begin() + b2, order.begin() + b2 + w);
    }
    const int64_t sink_at = static_cast<int64_t>(fetch.size());
    for (int64_t i = 0; i < n_sink_; ++i) fetch.push_back(static_cast<int32_t>(i));
    std::vector<float> kbuf(fetch.size() * d);
    RETURN_IF_ERROR(keys.GatherKeys(fetch.data(), static_cast<int64_t>(fetch.size()), kbuf.data()));
    scored += fetch.size();
    Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> km(
        kbuf.data(), static_cast<int64_t>(fetch.size()), d);
    Eigen::Map<const Eigen::VectorXf> qv(q, d);
    Eigen::VectorXf logits = km * qv;
    // Tail logits (exact; the tail is attended in full anyway).
    const int64_t tail = est->tail;
    Eigen::VectorXf tail_logits;
    if (tail > 0) {
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> tm(
          tail_keys_.data(), tail, d);
      tail_logits = tm * qv;
      scored += tail;
    }
    // exp() relative to the largest logit seen: the fit is scale-invariant.
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < logits.size(); ++i) mx = std::max<double>(mx, logits[i]);
    for (int64_t i = 0; i < tail; ++i) mx = std::max<double>(mx, tail_logits[i]);
    auto e = [&](double l) { return std::exp((l - mx) * inv_sqrt_d); };

    std::vector<double> s(n);
    for (int64_t i = 0; i < n0; ++i) s[i] = e(logits[i]);
    if (!exact_all) {
      double mu1 = 0, mu2 = 0;
      for (int64_t i = 0; i < w; ++i) {
        mu1 += e(logits[n0 + i]);
        mu2 += e(logits[n0 + w + i]);
      }
      mu1 /= w;
      mu2 /= w;
      // 1-based positions of the window centres (Tactic Alg. 1).
      const double x1 = b1 + (w + 1) / 2.0;
      const double x2 = b2 + (w + 1) / 2.0;
      est->fit = FitInverse(x1, mu1, x2, mu2);
      for (int64_t i = n0; i < n; ++i) s[i] = std::max(0.0, est->fit(static_cast<double>(i + 1)));
    }
    double tail_sum = 0;
    for (int64_t i = 0; i < tail; ++i) tail_sum += e(tail_logits[i]);
    for (int64_t i = 0; i < n_sink_; ++i) tail_sum += e(logits[sink_at + i]);  // sinks: exact
    double total = tail_sum;
    for (double v : s) total += v;
    // Smallest K whose prefix plus the (always selected) tail reaches P.
    const double goal = options_.target * total - tail_sum;
    int64_t k = 0;
    double acc = 0;
    if (goal > 0) {
      while (k < n && acc < goal) acc += s[k++];
    }
    est->n0 = n0;
    est->k_fit = k;
    // Whole-cluster granularity: extend to the end of the cluster holding rank k-1.
    k_sel = k == 0 ? 0 : *std::lower_bound(cend.begin(), cend.end(), k);
    for (int64_t i = k; i < k_sel; ++i) acc += s[i];
    est->estimated_mass = total > 0 ? (acc + tail_sum) / total : 1.0;
  }
  est->k_selected = k_sel;
  ids->assign(order.begin(), order.begin() + k_sel);
  for (int64_t i = 0; i < n_sink_; ++i) ids->push_back(static_cast<int32_t>(i));
  for (int64_t i = n_sink_ + n_ranked_; i < n_tokens_; ++i) ids->push_back(static_cast<int32_t>(i));
  std::sort(ids->begin(), ids->end());
  if (stats != nullptr) {
    const int64_t C = n_clusters();
    stats->entries_touched += static_cast<uint64_t>(C + k_sel);
    stats->keys_scored += scored;
    stats->bytes_touched += static_cast<uint64_t>(C) * d * sizeof(float) +
                            static_cast<uint64_t>(k_sel) * sizeof(int32_t) +
                            scored * d * sizeof(float);
  }
  return Status::OK();
}

Status TacticSelector::Select(const SelectInput& in, Selection* out, WorkStats* stats) {
  if (out == nullptr) return InvalidArgumentError("tactic: out must not be null");
  RETURN_IF_ERROR(
      ValidateSelectInput("tactic", in, head_dim_, n_tokens_, /*need_keys=*/in.budget == 0));
  if (stats != nullptr) *stats = WorkStats{};
  out->per_head.assign(in.n_queries, {});
  last_.assign(in.n_queries, {});
  ArrayKeySource none(nullptr, 0, head_dim_);
  const KeySource& keys = in.keys != nullptr ? *in.keys : none;
  double mass = 0;
  for (int h = 0; h < in.n_queries; ++h) {
    RETURN_IF_ERROR(SelectHead(in.queries + static_cast<size_t>(h) * head_dim_, in.budget, keys,
                               &out->per_head[h], &last_[h], stats));
    mass += last_[h].estimated_mass;
  }
  out->estimated_mass = in.budget > 0 ? -1.0 : mass / in.n_queries;
  out->merged.clear();
  for (const auto& ids : out->per_head)
    out->merged.insert(out->merged.end(), ids.begin(), ids.end());
  std::sort(out->merged.begin(), out->merged.end());
  out->merged.erase(std::unique(out->merged.begin(), out->merged.end()), out->merged.end());
  return Status::OK();
}

Status TacticSelector::Append(const float* key, const float*, const float*) {
  if (key == nullptr) return InvalidArgumentError("tactic: key must not be null");
  for (int j = 0; j < head_dim_; ++j) {
    if (!std::isfinite(key[j])) return InvalidArgumentError("tactic: appended key has NaN/Inf");
  }
  if (n_tokens_ >= INT32_MAX - 1) return OutOfRangeError("tactic: too many tokens");
  tail_keys_.insert(tail_keys_.end(), key, key + head_dim_);
  ++n_tokens_;
  const int64_t tail = n_tokens_ - n_sink_ - n_ranked_;
  if (tail >= options_.recluster_every) {
    RETURN_IF_ERROR(AddClusters(tail_keys_.data(), tail, static_cast<int32_t>(n_sink_ + n_ranked_),
                                options_.seed + static_cast<uint64_t>(n_ranked_)));
    tail_keys_.clear();
  }
  return Status::OK();
}

Status TacticSelector::Serialize(std::string* out) const {
  out->clear();
  ByteWriter w(out);
  w.PutHeader("TAC1", kFormatVersion);
  w.Put<int64_t>(n_tokens_);
  w.Put<int32_t>(head_dim_);
  w.Put<int32_t>(options_.avg_cluster_size);
  w.Put<int32_t>(options_.max_iters);
  w.Put<uint64_t>(options_.seed);
  w.Put<double>(options_.target);
  w.Put<double>(options_.n0_frac);
  w.Put<double>(options_.p1);
  w.Put<double>(options_.p2);
  w.Put<int32_t>(options_.window);
  w.Put<int32_t>(options_.recluster_every);
  w.Put<int32_t>(options_.n_sink);
  w.Put<int32_t>(options_.n_recent);
  w.Put<int64_t>(n_sink_);
  w.Put<int64_t>(n_ranked_);
  w.Put<int64_t>(n_clusters());
  PutVector(&w, cl_->centroids);
  PutVector(&w, cl_->offsets);
  PutVector(&w, cl_->members);
  PutVector(&w, tail_keys_);
  return Status::OK();
}

StatusOr<std::unique_ptr<TacticSelector>> TacticSelector::Load(std::string_view bytes) {
  ByteReader r(bytes);
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader("TAC1", kFormatVersion, &version, "tactic"));
  std::unique_ptr<TacticSelector> sel(new TacticSelector());
  TacticOptions& o = sel->options_;
  int32_t d = 0;
  int64_t n_clusters = 0;
  if (!r.Get(&sel->n_tokens_) || !r.Get(&d) || !r.Get(&o.avg_cluster_size) ||
      !r.Get(&o.max_iters) || !r.Get(&o.seed) || !r.Get(&o.target) || !r.Get(&o.n0_frac) ||
      !r.Get(&o.p1) || !r.Get(&o.p2) || !r.Get(&o.window) || !r.Get(&o.recluster_every) ||
      !r.Get(&o.n_sink) || !r.Get(&o.n_recent) || !r.Get(&sel->n_sink_) ||
      !r.Get(&sel->n_ranked_) || !r.Get(&n_clusters)) {
    return DataLossError("tactic: truncated artifact header");
  }
  RETURN_IF_ERROR(CheckOptions(o));
  const int64_t n = sel->n_tokens_;
  // Each count within [0, n] before they are added: no signed overflow.
  if (d <= 0 || d > 4096 || n < 1 || n >= INT32_MAX || sel->n_sink_ < 0 ||
      sel->n_sink_ > o.n_sink || sel->n_sink_ > n || sel->n_ranked_ < 1 || sel->n_ranked_ > n) {
    return DataLossError("tactic: corrupt artifact header");
  }
  const int64_t clustered_end = sel->n_sink_ + sel->n_ranked_;
  if (clustered_end > n || n - clustered_end >= o.recluster_every || n_clusters < 1 ||
      n_clusters > sel->n_ranked_) {
    return DataLossError("tactic: corrupt artifact header");
  }
  sel->head_dim_ = d;
  const size_t nc = static_cast<size_t>(n_clusters);
  const size_t tail = static_cast<size_t>(n - clustered_end) * d;
  const size_t need = nc * d * sizeof(float) + (nc + 1) * sizeof(int64_t) +
                      static_cast<size_t>(sel->n_ranked_) * sizeof(int32_t) + tail * sizeof(float);
  if (r.remaining() != need) return DataLossError("tactic: artifact size does not match header");
  auto cl = std::make_shared<Clusters>();
  cl->centroids.resize(nc * d);
  cl->offsets.resize(nc + 1);
  cl->members.resize(sel->n_ranked_);
  sel->tail_keys_.resize(tail);
  if (!GetVector(&r, &cl->centroids) || !GetVector(&r, &cl->offsets) ||
      !GetVector(&r, &cl->members) || !GetVector(&r, &sel->tail_keys_)) {
    return DataLossError("tactic: truncated artifact");
  }
  if (cl->offsets.front() != 0 || cl->offsets.back() != sel->n_ranked_ ||
      !std::is_sorted(cl->offsets.begin(), cl->offsets.end())) {
    return DataLossError("tactic: corrupt cluster offsets");
  }
  for (int32_t id : cl->members) {
    if (id < sel->n_sink_ || id >= clustered_end) {
      return DataLossError("tactic: corrupt member id");
    }
  }
  sel->cl_ = std::move(cl);
  return sel;
}

TacticSelector::Clusters& TacticSelector::MutableClusters() {
  // A clone shares the clusters until it adds its own.
  if (cl_.use_count() != 1) cl_ = std::make_shared<Clusters>(*cl_);
  return *cl_;
}

std::unique_ptr<Selector> TacticSelector::Clone() const {
  return std::unique_ptr<Selector>(new TacticSelector(*this));
}

uint64_t TacticSelector::SessionBytes() const {
  uint64_t own = sizeof(*this) + tail_keys_.capacity() * sizeof(float);
  for (const auto& e : last_) own += sizeof(e);
  if (cl_.use_count() == 1) {
    own += cl_->centroids.capacity() * sizeof(float) + cl_->offsets.capacity() * sizeof(int64_t) +
           cl_->members.capacity() * sizeof(int32_t);
  }
  return own;
}

uint64_t TacticSelector::MemoryBytes() const {
  return sizeof(*this) + cl_->centroids.capacity() * sizeof(float) +
         cl_->offsets.capacity() * sizeof(int64_t) + cl_->members.capacity() * sizeof(int32_t) +
         tail_keys_.capacity() * sizeof(float);
}

StatusOr<std::unique_ptr<Selector>> BuildTacticSelector(const HeadPrefill& prefill,
                                                        const MethodParams& params) {
  ASSIGN_OR_RETURN(TacticOptions o, ParseTacticParams(params));
  ASSIGN_OR_RETURN(auto sel,
                   TacticSelector::Build(prefill.keys, prefill.n_tokens, prefill.head_dim, o));
  return std::unique_ptr<Selector>(std::move(sel));
}

StatusOr<std::unique_ptr<Selector>> LoadTacticSelector(std::string_view bytes) {
  ASSIGN_OR_RETURN(auto sel, TacticSelector::Load(bytes));
  return std::unique_ptr<Selector>(std::move(sel));
}

}  // namespace ctxcache::index
