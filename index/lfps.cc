#include "index/lfps.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "index/byte_io.h"
#include "index/params.h"

namespace ctxcache::index {
namespace {

// Upper bound of s, sink and local (params and loaded artifacts alike).
constexpr int kMaxWindow = 1 << 20;

Status CheckOptions(const LfpsOptions& o) {
  if (o.history <= 0) return InvalidArgumentError("lfps: history (s) must be > 0");
  if (!(o.decay >= 0 && o.decay < 1))
    return InvalidArgumentError("lfps: decay (r) must be in [0, 1)");
  if (!(o.epsilon > 0 && o.epsilon <= 1)) {
    return InvalidArgumentError("lfps: epsilon (eps) must be in (0, 1]");
  }
  if (!(o.a > 0 && std::isfinite(o.a))) return InvalidArgumentError("lfps: a must be > 0");
  if (o.history > kMaxWindow) return InvalidArgumentError("lfps: history (s) must be <= 2^20");
  if (o.n_sink < 0 || o.n_sink > kMaxWindow) {
    return InvalidArgumentError("lfps: n_sink (sink) must be in [0, 2^20]");
  }
  if (o.local_window < 0 || o.local_window > kMaxWindow) {
    return InvalidArgumentError("lfps: local_window (local) must be in [0, 2^20]");
  }
  if (!(o.rho > 0 && o.rho <= 1)) return InvalidArgumentError("lfps: rho must be in (0, 1]");
  if (!(o.candidate_floor >= 0 && o.candidate_floor <= 1000)) {
    return InvalidArgumentError("lfps: floor must be in [0, 1000]");
  }
  return Status::OK();
}

float Dot(const float* a, const float* b, int d) {
  float s = 0;
  for (int j = 0; j < d; ++j) s += a[j] * b[j];
  return s;
}

double LogSumExp(const std::vector<double>& x) {
  double m = -std::numeric_limits<double>::infinity();
  for (double v : x) m = std::max(m, v);
  if (!std::isfinite(m)) return m;
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

double Mean(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return n > 0 ? s / n : 0.0;
}

}  // namespace

double LfpsKurtosis(const float* x, int64_t n) {
  if (n <= 0) return 0;
  const double mean = Mean(x, n);
  double m2 = 0, m4 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double c = x[i] - mean;
    const double c2 = c * c;
    m2 += c2;
    m4 += c2 * c2;
  }
  if (m2 <= 0) return 0;
  return m4 / (m2 * m2);
}

double LfpsThreshold(const float* x, int64_t n, double a) {
  const double k = LfpsKurtosis(x, n);
  if (k <= 0) return std::numeric_limits<double>::infinity();
  return a * Mean(x, n) / k;
}

void LfpsInitialTables(const std::vector<std::vector<float>>& weights,
                       const std::vector<int64_t>& positions, int64_t n, double r,
                       std::vector<float>* ver, std::vector<float>* sla) {
  std::vector<double> v(n, 0.0), s(n, 0.0);
  for (size_t j = 0; j < weights.size(); ++j) {
    const std::vector<float>& w = weights[j];
    const int64_t shift = n - 1 - positions[j];  // j-1 for the query at n-j (Eq. 4)
    for (int64_t i = 0; i < n; ++i) {
      v[i] += w[i];
      if (i - shift >= 0) s[i] += w[i - shift];
    }
  }
  const double c = weights.empty() ? 0.0 : 1.0 / (2.0 * weights.size() * (1.0 - r));
  ver->resize(n);
  sla->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    (*ver)[i] = static_cast<float>(c * v[i]);
    (*sla)[i] = static_cast<float>(c * s[i]);
  }
}

std::vector<int32_t> LfpsExpand(const std::vector<float>& ver, const std::vector<float>& sla,
                                const std::vector<int32_t>& c0, int64_t lo) {
  const int64_t n = static_cast<int64_t>(ver.size());
  const double mv = Mean(ver.data() + lo, n - lo);
  const double ms = Mean(sla.data() + lo, n - lo);
  std::vector<int32_t> c1;
  c1.reserve(c0.size() * 4);
  for (int32_t i : c0) {
    for (int delta = -1; delta <= 2; ++delta) {
      const int64_t j = static_cast<int64_t>(i) + delta;
      if (j < lo || j >= n) continue;
      if (ver[j] > mv || sla[j] > ms) c1.push_back(static_cast<int32_t>(j));
    }
  }
  std::sort(c1.begin(), c1.end());
  c1.erase(std::unique(c1.begin(), c1.end()), c1.end());
  return c1;
}

std::vector<int32_t> LfpsTopUp(const std::vector<float>& ver, const std::vector<float>& sla,
                               std::vector<int32_t> c1, int64_t lo, int64_t end, int64_t want) {
  if (static_cast<int64_t>(c1.size()) >= want || end <= lo) return c1;
  std::vector<char> in(end - lo, 0);
  for (int32_t i : c1) {
    if (i >= lo && i < end) in[i - lo] = 1;
  }
  std::vector<int32_t> rest;
  for (int64_t i = lo; i < end; ++i) {
    if (!in[i - lo]) rest.push_back(static_cast<int32_t>(i));
  }
  auto score = [&](int32_t i) { return std::max(std::fabs(ver[i]), std::fabs(sla[i])); };
  const size_t take = std::min<size_t>(rest.size(), static_cast<size_t>(want) - c1.size());
  std::partial_sort(rest.begin(), rest.begin() + take, rest.end(), [&](int32_t a, int32_t b) {
    const float sa = score(a), sb = score(b);
    return sa > sb || (sa == sb && a < b);
  });
  c1.insert(c1.end(), rest.begin(), rest.begin() + take);
  std::sort(c1.begin(), c1.end());
  return c1;
}

void LfpsUpdateTables(double r, const std::vector<int32_t>& c2, const std::vector<float>& w,
                      std::vector<float>* ver, std::vector<float>* sla) {
  const int64_t n = static_cast<int64_t>(ver->size());
  const float rf = static_cast<float>(r);
  // Off C2 the increment is w_i - 1/(2|C2|) = 0: decay (and shift) only.
  for (int64_t i = n - 1; i >= 1; --i) (*sla)[i] = rf * (*sla)[i - 1];
  if (n > 0) (*sla)[0] = 0.0f;
  for (int64_t i = 0; i < n; ++i) (*ver)[i] *= rf;
  if (c2.empty()) return;
  const float half = 1.0f / (2.0f * static_cast<float>(c2.size()));
  for (size_t k = 0; k < c2.size(); ++k) {
    const float inc = w[k] - half;
    (*ver)[c2[k]] += inc;
    (*sla)[c2[k]] += inc;
  }
}

StatusOr<LfpsOptions> ParseLfpsParams(const MethodParams& params) {
  ParamReader rd("lfps", params);
  LfpsOptions o;
  ASSIGN_OR_RETURN(int64_t s, rd.Int("s", o.history, 1, kMaxWindow));
  ASSIGN_OR_RETURN(o.decay, rd.Double("r", o.decay, 0, 0.999999));
  ASSIGN_OR_RETURN(o.epsilon, rd.Double("eps", o.epsilon, 1e-9, 1));
  ASSIGN_OR_RETURN(o.a, rd.Double("a", o.a, 1e-9, 1e9));
  ASSIGN_OR_RETURN(int64_t sink, rd.Int("sink", o.n_sink, 0, kMaxWindow));
  ASSIGN_OR_RETURN(int64_t local, rd.Int("local", o.local_window, 0, kMaxWindow));
  ASSIGN_OR_RETURN(o.rho, rd.Double("rho", o.rho, 1e-9, 1));
  ASSIGN_OR_RETURN(o.candidate_floor, rd.Double("floor", o.candidate_floor, 0, 1000));
  RETURN_IF_ERROR(rd.Finish());
  o.history = static_cast<int>(s);
  o.n_sink = static_cast<int>(sink);
  o.local_window = static_cast<int>(local);
  return o;
}

StatusOr<std::unique_ptr<LfpsSelector>> LfpsSelector::Build(const HeadPrefill& p,
                                                            const LfpsOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  RETURN_IF_ERROR(ValidatePrefill("lfps", p, /*need_queries=*/true, /*need_values=*/false));
  const int64_t n = p.n_tokens;
  const int d = p.head_dim;
  const int G = p.group_size;
  std::unique_ptr<LfpsSelector> sel(new LfpsSelector());
  sel->n_tokens_ = n;
  sel->head_dim_ = d;
  sel->group_size_ = G;
  sel->options_ = options;
  sel->key_mean_.assign(d, 0.0f);
  sel->value_mean_.assign(d, 0.0f);
  // K̄, V̄ over the non-sink keys (the seed keeps the sinks apart, its footnote 1).
  const int64_t first = n > options.n_sink ? options.n_sink : 0;
  {
    std::vector<double> km(d, 0.0), vm(d, 0.0);
    for (int64_t i = first; i < n; ++i) {
      for (int j = 0; j < d; ++j) km[j] += p.keys[i * d + j];
      if (p.values != nullptr) {
        for (int j = 0; j < d; ++j) vm[j] += p.values[i * d + j];
      }
    }
    for (int j = 0; j < d; ++j) {
      sel->key_mean_[j] = static_cast<float>(km[j] / (n - first));
      sel->value_mean_[j] = static_cast<float>(vm[j] / (n - first));
    }
  }
  // Rows used: the last min(s, n_queries) query rows.
  const int64_t rows = std::min<int64_t>(options.history, p.n_queries);
  std::vector<int64_t> positions(rows);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t row = p.n_queries - rows + j;
    positions[j] = p.query_positions ? p.query_positions[row] : n - p.n_queries + row;
    if (positions[j] < 0 || positions[j] >= n) {
      return InvalidArgumentError("lfps: query_positions must lie in [0, n_tokens)");
    }
  }
  const int64_t lo = std::min<int64_t>(options.n_sink, n);
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  sel->ver_.resize(G);
  sel->sla_.resize(G);
  sel->sigma_hat2_.assign(G, 0.0f);
  std::vector<std::vector<float>> weights(rows, std::vector<float>(n, 0.0f));
  for (int g = 0; g < G; ++g) {
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t row = p.n_queries - rows + j;
      const float* q = p.queries + (static_cast<size_t>(g) * p.n_queries + row) * d;
      const int64_t pos = positions[j];
      std::vector<float>& w = weights[j];
      std::fill(w.begin(), w.end(), 0.0f);
      // Causal softmax over the non-sink keys lo..pos (sinks stay out of the tables).
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t i = lo; i <= pos; ++i) {
        w[i] = Dot(q, p.keys + i * d, d) * inv_sqrt_d;
        mx = std::max<double>(mx, w[i]);
      }
      double sum = 0;
      for (int64_t i = lo; i <= pos; ++i) {
        w[i] = static_cast<float>(std::exp(w[i] - mx));
        sum += w[i];
      }
      if (sum > 0) {
        for (int64_t i = lo; i <= pos; ++i) w[i] = static_cast<float>(w[i] / sum);
      }
      if (j == rows - 1) {
        // σ̂² = Var_i(q·k_i/√d) / ‖q‖² over the non-sink keys, from the last row (LFPS §4).
        double s1 = 0, s2 = 0;
        for (int64_t i = first; i <= pos; ++i) {
          const double l = Dot(q, p.keys + i * d, d) * inv_sqrt_d;
          s1 += l;
          s2 += l * l;
        }
        const double cnt = static_cast<double>(std::max<int64_t>(1, pos + 1 - first));
        const double var = std::max(0.0, s2 / cnt - (s1 / cnt) * (s1 / cnt));
        const double qn2 = Dot(q, q, d);
        sel->sigma_hat2_[g] = qn2 > 0 ? static_cast<float>(var / qn2) : 0.0f;
      }
    }
    LfpsInitialTables(weights, positions, n, options.decay, &sel->ver_[g], &sel->sla_[g]);
    for (int64_t i = 0; i < lo; ++i) sel->ver_[g][i] = sel->sla_[g][i] = 0.0f;
  }
  return sel;
}

Status LfpsSelector::SelectHead(int h, const float* q, int64_t budget, const KeySource& keys,
                                std::vector<int32_t>* ids, WorkStats* stats) {
  const int64_t n = n_tokens_;
  const int d = head_dim_;
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<float>& ver = ver_[h];
  std::vector<float>& sla = sla_[h];
  ver.resize(n, 0.0f);  // tokens appended since the last step start at 0
  sla.resize(n, 0.0f);
  const int64_t lo = std::min<int64_t>(options_.n_sink, n);
  const int64_t local_begin = std::max(lo, n - options_.local_window);

  // Keys scored every step: sinks and the local window.
  std::vector<int32_t> fixed;
  for (int64_t i = 0; i < lo; ++i) fixed.push_back(static_cast<int32_t>(i));
  for (int64_t i = local_begin; i < n; ++i) fixed.push_back(static_cast<int32_t>(i));
  std::vector<float> buf(fixed.size() * d);
  RETURN_IF_ERROR(keys.GatherKeys(fixed.data(), static_cast<int64_t>(fixed.size()), buf.data()));
  std::vector<double> sink_logits, local_logits;
  for (size_t k = 0; k < fixed.size(); ++k) {
    const double l = Dot(q, buf.data() + k * d, d) * inv_sqrt_d;
    (fixed[k] < lo ? sink_logits : local_logits).push_back(l);
  }
  uint64_t scored = fixed.size();
  ++counters_.head_steps;
  counters_.keys_total += static_cast<uint64_t>(n);

  // 1. Sink bypass (LFPS Eq. 5-6), in log space.
  if (lo > 0) {
    const double qn2 = Dot(q, q, d);
    const double log_global = std::log(static_cast<double>(std::max<int64_t>(1, n - lo))) +
                              Dot(q, key_mean_.data(), d) * inv_sqrt_d + qn2 * sigma_hat2_[h] / 2.0;
    const double ls = LogSumExp(sink_logits);
    std::vector<double> all = {ls, log_global};
    if (!local_logits.empty()) all.push_back(LogSumExp(local_logits));
    const double rho = std::exp(ls - LogSumExp(all));
    if (rho > options_.epsilon) {
      ++counters_.bypassed;
      counters_.keys_scored += scored;
      *ids = fixed;
      if (stats) {
        stats->keys_scored += scored;
        stats->bytes_touched += scored * d * sizeof(float);
      }
      return Status::OK();
    }
  }

  // 2. Kurtosis thresholds over the table part [lo, n).
  const int64_t m = n - lo;
  const double tv = LfpsThreshold(ver.data() + lo, m, options_.a);
  const double ts = LfpsThreshold(sla.data() + lo, m, options_.a);
  std::vector<int32_t> c0;
  for (int64_t i = lo; i < n; ++i) {
    if (ver[i] > tv || sla[i] > ts) c0.push_back(static_cast<int32_t>(i));
  }
  // 3. Expansion.
  std::vector<int32_t> c1 = LfpsExpand(ver, sla, c0, lo);
  if (options_.candidate_floor > 0) {
    const double want =
        options_.candidate_floor * static_cast<double>(std::max<int64_t>(0, budget - lo));
    c1 = LfpsTopUp(ver, sla, std::move(c1), lo, local_begin,
                   static_cast<int64_t>(std::min(std::ceil(want), static_cast<double>(n))));
  }
  // 4. Exact scores over C1 ∪ local window.
  std::vector<int32_t> cand;
  cand.reserve(c1.size() + static_cast<size_t>(std::min<int64_t>(options_.local_window, n)));
  std::set_union(c1.begin(), c1.end(), fixed.begin() + lo, fixed.end(), std::back_inserter(cand));
  std::vector<int32_t> to_fetch;
  for (int32_t i : cand) {
    if (i < local_begin) to_fetch.push_back(i);
  }
  buf.resize(to_fetch.size() * d);
  RETURN_IF_ERROR(
      keys.GatherKeys(to_fetch.data(), static_cast<int64_t>(to_fetch.size()), buf.data()));
  scored += to_fetch.size();
  std::vector<double> logit(cand.size());
  {
    size_t f = 0;
    for (size_t k = 0; k < cand.size(); ++k) {
      if (cand[k] < local_begin) {
        logit[k] = Dot(q, buf.data() + f * d, d) * inv_sqrt_d;
        ++f;
      } else {
        logit[k] = local_logits[cand[k] - local_begin];
      }
    }
  }
  const int64_t k_top = std::clamp<int64_t>(budget - lo, 0, static_cast<int64_t>(cand.size()));
  std::vector<int32_t> order(cand.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k_top, order.end(), [&](int32_t a, int32_t b) {
    return logit[a] > logit[b] || (logit[a] == logit[b] && cand[a] < cand[b]);
  });
  order.resize(k_top);
  std::sort(order.begin(), order.end());  // cand is sorted, so C2 comes out sorted
  std::vector<int32_t> c2(k_top);
  std::vector<float> w(k_top);
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t k = 0; k < k_top; ++k) mx = std::max(mx, logit[order[k]]);
  double sum = 0;
  for (int64_t k = 0; k < k_top; ++k) {
    c2[k] = cand[order[k]];
    const double e = std::exp(logit[order[k]] - mx);
    w[k] = static_cast<float>(e);
    sum += e;
  }
  for (float& x : w) x = static_cast<float>(x / sum);
  // 5. Table update.
  LfpsUpdateTables(options_.decay, c2, w, &ver, &sla);

  ids->clear();
  for (int64_t i = 0; i < lo; ++i) ids->push_back(static_cast<int32_t>(i));
  ids->insert(ids->end(), c2.begin(), c2.end());
  counters_.keys_scored += scored;
  if (stats) {
    stats->keys_scored += scored;
    stats->entries_touched += 2 * static_cast<uint64_t>(n);
    stats->bytes_touched +=
        scored * d * sizeof(float) + 2 * static_cast<uint64_t>(n) * sizeof(float);
  }
  return Status::OK();
}

Status LfpsSelector::Select(const SelectInput& in, Selection* out, WorkStats* stats) {
  if (out == nullptr) return InvalidArgumentError("lfps: out must not be null");
  RETURN_IF_ERROR(ValidateSelectInput("lfps", in, head_dim_, n_tokens_, /*need_keys=*/true));
  if (in.n_queries != group_size_) {
    return InvalidArgumentError("lfps: n_queries must equal group_size=" +
                                std::to_string(group_size_));
  }
  int64_t budget =
      in.budget > 0 ? in.budget : static_cast<int64_t>(std::ceil(options_.rho * n_tokens_));
  budget = std::min(budget, n_tokens_);
  if (stats) *stats = WorkStats{};
  out->per_head.assign(group_size_, {});
  out->estimated_mass = -1.0;
  for (int h = 0; h < group_size_; ++h) {
    RETURN_IF_ERROR(SelectHead(h, in.queries + static_cast<size_t>(h) * head_dim_, budget, *in.keys,
                               &out->per_head[h], stats));
  }
  out->merged.clear();
  for (const auto& ids : out->per_head)
    out->merged.insert(out->merged.end(), ids.begin(), ids.end());
  std::sort(out->merged.begin(), out->merged.end());
  out->merged.erase(std::unique(out->merged.begin(), out->merged.end()), out->merged.end());
  return Status::OK();
}

Status LfpsSelector::Append(const float*, const float*, const float*) {
  if (n_tokens_ >= INT32_MAX - 1) return OutOfRangeError("lfps: too many tokens");
  ++n_tokens_;  // tables grow lazily in Select()
  return Status::OK();
}

Status LfpsSelector::Serialize(std::string* out) const {
  out->clear();
  ByteWriter w(out);
  w.PutHeader("LFP1", kFormatVersion);
  w.Put<int64_t>(n_tokens_);
  w.Put<int32_t>(head_dim_);
  w.Put<int32_t>(group_size_);
  w.Put<int32_t>(options_.history);
  w.Put<double>(options_.decay);
  w.Put<double>(options_.epsilon);
  w.Put<double>(options_.a);
  w.Put<int32_t>(options_.n_sink);
  w.Put<int32_t>(options_.local_window);
  w.Put<double>(options_.rho);
  w.Put<double>(options_.candidate_floor);
  PutVector(&w, key_mean_);
  PutVector(&w, value_mean_);
  PutVector(&w, sigma_hat2_);
  for (int h = 0; h < group_size_; ++h) {
    w.Put<int64_t>(static_cast<int64_t>(ver_[h].size()));
    PutVector(&w, ver_[h]);
    PutVector(&w, sla_[h]);
  }
  return Status::OK();
}

StatusOr<std::unique_ptr<LfpsSelector>> LfpsSelector::Load(std::string_view bytes) {
  ByteReader r(bytes);
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader("LFP1", kFormatVersion, &version, "lfps"));
  std::unique_ptr<LfpsSelector> sel(new LfpsSelector());
  int32_t d = 0, g = 0;
  LfpsOptions& o = sel->options_;
  if (!r.Get(&sel->n_tokens_) || !r.Get(&d) || !r.Get(&g) || !r.Get(&o.history) ||
      !r.Get(&o.decay) || !r.Get(&o.epsilon) || !r.Get(&o.a) || !r.Get(&o.n_sink) ||
      !r.Get(&o.local_window) || !r.Get(&o.rho)) {
    return DataLossError("lfps: truncated artifact header");
  }
  // Version 1 had no floor: its sessions keep the seed's candidate set.
  o.candidate_floor = 0;
  if (version >= 2 && !r.Get(&o.candidate_floor)) {
    return DataLossError("lfps: truncated artifact header");
  }
  RETURN_IF_ERROR(CheckOptions(o));
  if (d <= 0 || d > 4096 || g <= 0 || g > 1024 || sel->n_tokens_ < 0 ||
      sel->n_tokens_ >= INT32_MAX) {
    return DataLossError("lfps: corrupt artifact header");
  }
  sel->head_dim_ = d;
  sel->group_size_ = g;
  auto get_floats = [&r](size_t n, std::vector<float>* v) {
    if (n > r.remaining() / sizeof(float)) return false;
    v->resize(n);
    return GetVector(&r, v);
  };
  if (!get_floats(d, &sel->key_mean_) || !get_floats(d, &sel->value_mean_) ||
      !get_floats(g, &sel->sigma_hat2_)) {
    return DataLossError("lfps: truncated artifact");
  }
  sel->ver_.resize(g);
  sel->sla_.resize(g);
  for (int h = 0; h < g; ++h) {
    int64_t len = 0;
    if (!r.Get(&len) || len < 0 || len > sel->n_tokens_ || !get_floats(len, &sel->ver_[h]) ||
        !get_floats(len, &sel->sla_[h])) {
      return DataLossError("lfps: truncated or corrupt score tables");
    }
  }
  if (r.remaining() != 0) return DataLossError("lfps: trailing bytes in artifact");
  return sel;
}

std::unique_ptr<Selector> LfpsSelector::Clone() const {
  return std::unique_ptr<Selector>(new LfpsSelector(*this));
}

uint64_t LfpsSelector::MemoryBytes() const {
  uint64_t b =
      sizeof(*this) +
      (key_mean_.capacity() + value_mean_.capacity() + sigma_hat2_.capacity()) * sizeof(float);
  for (int h = 0; h < group_size_; ++h) {
    b += (ver_[h].capacity() + sla_[h].capacity()) * sizeof(float);
  }
  return b;
}

StatusOr<std::unique_ptr<Selector>> BuildLfpsSelector(const HeadPrefill& prefill,
                                                      const MethodParams& params) {
  ASSIGN_OR_RETURN(LfpsOptions o, ParseLfpsParams(params));
  ASSIGN_OR_RETURN(auto sel, LfpsSelector::Build(prefill, o));
  return std::unique_ptr<Selector>(std::move(sel));
}

StatusOr<std::unique_ptr<Selector>> LoadLfpsSelector(std::string_view bytes) {
  ASSIGN_OR_RETURN(auto sel, LfpsSelector::Load(bytes));
  return std::unique_ptr<Selector>(std::move(sel));
}

}  // namespace ctxcache::index
