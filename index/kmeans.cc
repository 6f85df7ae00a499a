#include "index/kmeans.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "common/dtype.h"

namespace ctxcache::index {
namespace {

using StridedMap = Eigen::Map<const RowMatrixXf, 0, Eigen::OuterStride<>>;
constexpr int64_t kBlockRows = 2048;

// The one nearest-centroid search (KMeans and AssignNearest): for each row of
// X (n x d) the best centroid and, if score is non-null, its raw score
// (L2: |c|^2 - 2 x.c, the squared distance minus |x|^2; cosine: x.c).
// Rows go through one GEMM per block of kBlockRows; ties take the lowest id.
void AssignBlockwise(const StridedMap& X, const RowMatrixXf& C, KMeansMetric metric,
                     int32_t* assign, float* score) {
  const int64_t n = X.rows();
  const int k = static_cast<int>(C.rows());
  Eigen::VectorXf c_norm2 = C.rowwise().squaredNorm();
  RowMatrixXf G;
  for (int64_t r0 = 0; r0 < n; r0 += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, n - r0);
    G.noalias() = X.middleRows(r0, rows) * C.transpose();
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = G.row(r).data();
      int best = 0;
      float best_val;
      if (metric == KMeansMetric::kL2) {
        best_val = c_norm2[0] - 2.0f * g[0];
        for (int j = 1; j < k; ++j) {
          const float v = c_norm2[j] - 2.0f * g[j];
          if (v < best_val) {
            best_val = v;
            best = j;
          }
        }
      } else {
        best_val = g[0];
        for (int j = 1; j < k; ++j) {
          if (g[j] > best_val) {
            best_val = g[j];
            best = j;
          }
        }
      }
      assign[r0 + r] = best;
      if (score) score[r0 + r] = best_val;
    }
  }
}

// KMeans' distances from AssignBlockwise's scores, in place (L2: squared
// distance; cosine: 1 - x.c, X rows unit or zero).
void ScoresToDistances(const Eigen::VectorXf& x_norm2, KMeansMetric metric, float* dist) {
  const int64_t n = x_norm2.size();
  for (int64_t i = 0; i < n; ++i) {
    dist[i] = metric == KMeansMetric::kL2 ? std::max(0.0f, dist[i] + x_norm2[i])
                                          : std::max(0.0f, 1.0f - dist[i]);
  }
}

float PointDistance(const float* a, const float* b, int d, KMeansMetric metric) {
  float acc = 0;
  if (metric == KMeansMetric::kL2) {
    for (int j = 0; j < d; ++j) acc += (a[j] - b[j]) * (a[j] - b[j]);
    return acc;
  }
  for (int j = 0; j < d; ++j) acc += a[j] * b[j];
  return std::max(0.0f, 1.0f - acc);
}

void NormalizeRows(RowMatrixXf* m) {
  for (int64_t i = 0; i < m->rows(); ++i) {
    const float norm = m->row(i).norm();
    if (norm > 0) m->row(i) /= norm;
  }
}

// k-means++ on a subsample of X; returns k row indices of X.
std::vector<int64_t> SeedPlusPlus(const RowMatrixXf& X, int k, KMeansMetric metric,
                                  int64_t max_points, std::mt19937_64* rng) {
  const int64_t n = X.rows();
  const int d = static_cast<int>(X.cols());
  std::vector<int64_t> pool(n);
  std::iota(pool.begin(), pool.end(), 0);
  if (n > max_points && max_points >= k) {
    for (int64_t i = 0; i < max_points; ++i) {
      std::uniform_int_distribution<int64_t> pick(i, n - 1);
      std::swap(pool[i], pool[pick(*rng)]);
    }
    pool.resize(max_points);
  }
  const int64_t s = static_cast<int64_t>(pool.size());
  std::vector<double> dmin(s, std::numeric_limits<double>::infinity());
  std::vector<int64_t> chosen;
  chosen.reserve(k);
  std::vector<char> taken(s, 0);
  std::uniform_int_distribution<int64_t> first(0, s - 1);
  int64_t next = first(*rng);
  for (int c = 0; c < k; ++c) {
    chosen.push_back(pool[next]);
    taken[next] = 1;
    const float* cv = X.row(pool[next]).data();
    double total = 0;
    for (int64_t i = 0; i < s; ++i) {
      if (taken[i]) {
        dmin[i] = 0;
        continue;
      }
      const double dist = PointDistance(X.row(pool[i]).data(), cv, d, metric);
      dmin[i] = std::min(dmin[i], dist);
      total += dmin[i];
    }
    if (c + 1 == k) break;
    if (total <= 0) {
      // All remaining points coincide with chosen ones: take any untaken.
      next = std::find(taken.begin(), taken.end(), 0) - taken.begin();
      continue;
    }
    std::uniform_real_distribution<double> u(0.0, total);
    double target = u(*rng);
    next = -1;
    for (int64_t i = 0; i < s; ++i) {
      if (taken[i]) continue;
      target -= dmin[i];
      if (target <= 0) {
        next = i;
        break;
      }
    }
    if (next < 0) {  // rounding: last untaken point
      for (int64_t i = s - 1; i >= 0; --i) {
        if (!taken[i]) {
          next = i;
          break;
        }
      }
    }
  }
  return chosen;
}

std::vector<int64_t> SeedRandom(int64_t n, int k, std::mt19937_64* rng) {
  // Partial Fisher-Yates over a lazily materialized permutation.
  std::vector<int64_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = 0; i < k; ++i) {
    std::uniform_int_distribution<int64_t> pick(i, n - 1);
    std::swap(perm[i], perm[pick(*rng)]);
  }
  perm.resize(k);
  return perm;
}

}  // namespace

void AssignNearest(const float* x, int64_t n, int d, int64_t ld, const RowMatrixXf& centroids,
                   KMeansMetric metric, int32_t* assign, float* best) {
  StridedMap X(x, n, d, Eigen::OuterStride<>(ld));
  AssignBlockwise(X, centroids, metric, assign, best);
  if (!best) return;
  for (int64_t i = 0; i < n; ++i) {
    const float xn2 = X.row(i).squaredNorm();
    best[i] = metric == KMeansMetric::kL2 ? std::max(0.0f, best[i] + xn2)
                                          : (xn2 > 0 ? best[i] / std::sqrt(xn2) : 0.0f);
  }
}

StatusOr<KMeansResult> KMeans(const float* x, int64_t n, int d, int64_t ld,
                              const KMeansOptions& o) {
  if (x == nullptr) return InvalidArgumentError("kmeans: points are null");
  if (d < 1) return InvalidArgumentError("kmeans: d=" + std::to_string(d) + ", expected >= 1");
  if (ld < d) {
    return InvalidArgumentError("kmeans: ld=" + std::to_string(ld) + ", expected >= d (" +
                                std::to_string(d) + ")");
  }
  if (n < 1) return InvalidArgumentError("kmeans: n=" + std::to_string(n) + ", expected >= 1");
  if (o.k < 1 || o.k > n) {
    return InvalidArgumentError("kmeans: k=" + std::to_string(o.k) + ", expected 1..n (" +
                                std::to_string(n) + ")");
  }
  if (o.max_iters < 0) return InvalidArgumentError("kmeans: max_iters must be >= 0");
  if (o.batch_size < 0) return InvalidArgumentError("kmeans: batch_size must be >= 0");
  if (!(o.tolerance >= 0)) return InvalidArgumentError("kmeans: tolerance must be >= 0");

  RowMatrixXf X = StridedMap(x, n, d, Eigen::OuterStride<>(ld));
  if (HasNonFinite(X.data(), static_cast<size_t>(n) * d)) {
    return InvalidArgumentError("kmeans: points contain NaN/Inf");
  }
  const KMeansMetric metric = o.metric;
  if (metric == KMeansMetric::kCosine) NormalizeRows(&X);
  Eigen::VectorXf x_norm2 = X.rowwise().squaredNorm();
  StridedMap Xm(X.data(), n, d, Eigen::OuterStride<>(d));

  std::mt19937_64 rng(o.seed);
  std::vector<int64_t> seeds = o.init == KMeansInit::kPlusPlus
                                   ? SeedPlusPlus(X, o.k, metric, o.max_init_points, &rng)
                                   : SeedRandom(n, o.k, &rng);
  KMeansResult res;
  RowMatrixXf& C = res.centroids;
  C.resize(o.k, d);
  for (int j = 0; j < o.k; ++j) C.row(j) = X.row(seeds[j]);

  res.assign.assign(n, 0);
  std::vector<float> dist(n, 0.0f);
  auto reseed_empty = [&](const std::vector<int64_t>& counts) {
    // Empty clusters take the points farthest from their centroids.
    std::vector<int> empty;
    for (int j = 0; j < o.k; ++j) {
      if (counts[j] == 0) empty.push_back(j);
    }
    if (empty.empty()) return;
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    const size_t m = std::min(empty.size(), order.size());
    std::partial_sort(order.begin(), order.begin() + m, order.end(), [&](int64_t a, int64_t b) {
      return dist[a] > dist[b] || (dist[a] == dist[b] && a < b);
    });
    for (size_t e = 0; e < m; ++e) {
      C.row(empty[e]) = X.row(order[e]);
      dist[order[e]] = 0;
    }
  };

  if (o.batch_size == 0) {
    double prev = std::numeric_limits<double>::infinity();
    std::vector<int64_t> counts(o.k);
    for (int it = 0; it < o.max_iters; ++it) {
      AssignBlockwise(Xm, C, metric, res.assign.data(), dist.data());
      ScoresToDistances(x_norm2, metric, dist.data());
      const double obj = std::accumulate(dist.begin(), dist.end(), 0.0) / n;
      ++res.iterations;
      // Update step.
      RowMatrixXf sums = RowMatrixXf::Zero(o.k, d);
      std::fill(counts.begin(), counts.end(), 0);
      for (int64_t i = 0; i < n; ++i) {
        sums.row(res.assign[i]) += X.row(i);
        ++counts[res.assign[i]];
      }
      for (int j = 0; j < o.k; ++j) {
        if (counts[j] == 0) continue;
        if (metric == KMeansMetric::kCosine) {
          const float norm = sums.row(j).norm();
          if (norm > 0) {
            C.row(j) = sums.row(j) / norm;
          } else {
            counts[j] = 0;  // antipodal members: re-seed
          }
        } else {
          C.row(j) = sums.row(j) / static_cast<float>(counts[j]);
        }
      }
      reseed_empty(counts);
      if (std::isfinite(prev) && std::abs(prev - obj) <= o.tolerance * std::max(prev, 1e-12)) {
        break;
      }
      prev = obj;
    }
  } else {
    std::vector<int64_t> seen(o.k, 0);
    const int64_t b = std::min(o.batch_size, n);
    RowMatrixXf batch(b, d);
    std::vector<int32_t> batch_assign(b);
    std::uniform_int_distribution<int64_t> pick(0, n - 1);
    std::vector<int64_t> idx(b);
    for (int it = 0; it < o.max_iters; ++it) {
      for (int64_t i = 0; i < b; ++i) {
        idx[i] = pick(rng);
        batch.row(i) = X.row(idx[i]);
      }
      StridedMap Bm(batch.data(), b, d, Eigen::OuterStride<>(d));
      AssignBlockwise(Bm, C, metric, batch_assign.data(), nullptr);
      for (int64_t i = 0; i < b; ++i) {
        const int j = batch_assign[i];
        const float lr = 1.0f / static_cast<float>(++seen[j]);
        C.row(j) = (1.0f - lr) * C.row(j) + lr * batch.row(i);
      }
      if (metric == KMeansMetric::kCosine) NormalizeRows(&C);
      ++res.iterations;
    }
  }
  // Final assignment against the final centroids.
  AssignBlockwise(Xm, C, metric, res.assign.data(), dist.data());
  ScoresToDistances(x_norm2, metric, dist.data());
  res.objective = std::accumulate(dist.begin(), dist.end(), 0.0) / n;
  return res;
}

}  // namespace ctxcache::index
