#include "index/kmeans.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "common/dtype.h"
#include "common/thread_pool.h"

namespace ctxcache::index {
namespace {

using StridedMap = Eigen::Map<const RowMatrixXf, 0, Eigen::OuterStride<>>;
// Rows per assignment GEMM: the block's n x k score tile stays near 128 KiB
// (in L2), between 64 and 2048 rows.
int64_t BlockRows(int64_t k) {
  return std::clamp<int64_t>(32768 / std::max<int64_t>(k, 1), 64, 2048);
}

// Index of the largest of v[0..k) (the lowest index among equal maxima) and
// that value. AVX2: the maximum with 4 independent vmaxps chains, then the
// first index holding it (cmpeq + movemask).
inline int ArgMax(const float* v, int k, float* best_val) {
  int j = 0;
  float bv = v[0];
#ifdef __AVX2__
  if (k >= 32) {
    __m256 m0 = _mm256_loadu_ps(v), m1 = _mm256_loadu_ps(v + 8), m2 = _mm256_loadu_ps(v + 16),
           m3 = _mm256_loadu_ps(v + 24);
    for (j = 32; j + 32 <= k; j += 32) {
      m0 = _mm256_max_ps(m0, _mm256_loadu_ps(v + j));
      m1 = _mm256_max_ps(m1, _mm256_loadu_ps(v + j + 8));
      m2 = _mm256_max_ps(m2, _mm256_loadu_ps(v + j + 16));
      m3 = _mm256_max_ps(m3, _mm256_loadu_ps(v + j + 24));
    }
    __m256 mv = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    bv = _mm_cvtss_f32(h);
    for (; j < k; ++j) bv = std::max(bv, v[j]);
    // The first index holding the maximum.
    const __m256 target = _mm256_set1_ps(bv);
    int i = 0;
    for (; i + 8 <= k; i += 8) {
      const int mask =
          _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), target, _CMP_EQ_OQ));
      if (mask != 0) {
        *best_val = bv;
        return i + __builtin_ctz(static_cast<unsigned>(mask));
      }
    }
    for (; i < k; ++i) {
      if (v[i] == bv) break;
    }
    *best_val = bv;
    return i;
  }
#endif
  int best = 0;
  for (j = 1; j < k; ++j) {
    if (v[j] > bv) {
      bv = v[j];
      best = j;
    }
  }
  *best_val = bv;
  return best;
}

// Points of at most this many dimensions skip the GEMM: one pass per point
// over the transposed centroids (d x k, in L1), scores into a k-float row.
constexpr int kSmallDim = 16;

void AssignSmallDim(const StridedMap& X, const RowMatrixXf& C, KMeansMetric metric, int32_t* assign,
                    float* score) {
  const int64_t n = X.rows();
  const int d = static_cast<int>(X.cols());
  const int k = static_cast<int>(C.rows());
  const int kp = (k + 31) / 32 * 32;
  // ct[t * kp + j] = C(j, t); the L2 bias -|c_j|^2 (padding: -inf, never the max).
  std::vector<float> ct(static_cast<size_t>(d) * kp, 0.0f), bias(kp, 0.0f);
  for (int j = 0; j < k; ++j) {
    for (int t = 0; t < d; ++t) ct[static_cast<size_t>(t) * kp + j] = C(j, t);
    if (metric == KMeansMetric::kL2) bias[j] = -C.row(j).squaredNorm();
  }
  for (int j = k; j < kp; ++j) bias[j] = -std::numeric_limits<float>::infinity();
  const float scale = metric == KMeansMetric::kL2 ? 2.0f : 1.0f;
  std::vector<float> g(kp);
  for (int64_t i = 0; i < n; ++i) {
    const float* x = X.row(i).data();
    int j = 0;
#ifdef __AVX2__
    // 32 centroids per pass: 4 independent FMA chains of length d.
    const __m256 sv = _mm256_set1_ps(scale);
    for (; j < kp; j += 32) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const float* c = ct.data() + j;
      for (int t = 0; t < d; ++t, c += kp) {
        const __m256 xv = _mm256_set1_ps(x[t]);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(c), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(c + 8), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(c + 16), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(c + 24), a3);
      }
      const float* bj = bias.data() + j;
      _mm256_storeu_ps(g.data() + j, _mm256_fmadd_ps(a0, sv, _mm256_loadu_ps(bj)));
      _mm256_storeu_ps(g.data() + j + 8, _mm256_fmadd_ps(a1, sv, _mm256_loadu_ps(bj + 8)));
      _mm256_storeu_ps(g.data() + j + 16, _mm256_fmadd_ps(a2, sv, _mm256_loadu_ps(bj + 16)));
      _mm256_storeu_ps(g.data() + j + 24, _mm256_fmadd_ps(a3, sv, _mm256_loadu_ps(bj + 24)));
    }
#endif
    for (; j < kp; ++j) {
      float acc = 0;
      for (int t = 0; t < d; ++t) acc += x[t] * ct[static_cast<size_t>(t) * kp + j];
      g[j] = acc * scale + bias[j];
    }
    float best_val;
    assign[i] = ArgMax(g.data(), kp, &best_val);
    if (score) score[i] = metric == KMeansMetric::kL2 ? -best_val : best_val;
  }
}

// The one nearest-centroid search (KMeans and AssignNearest): for each row of
// X (n x d) the best centroid and, if score is non-null, its raw score
// (L2: |c|^2 - 2 x.c, the squared distance minus |x|^2; cosine: x.c).
// Rows go through one GEMM per block of BlockRows(k) (blocks spread over
// ThreadPool::Default(); a call from a pool thread runs inline); the argmax is SIMD (for
// L2 over 2 x.c - |c|^2, which negates |c|^2 - 2 x.c exactly); ties take the
// lowest id.
void AssignBlockwise(const StridedMap& X, const RowMatrixXf& C, KMeansMetric metric,
                     int32_t* assign, float* score, bool parallel) {
  const int64_t n = X.rows();
  const int k = static_cast<int>(C.rows());
  const Eigen::RowVectorXf c_norm2 = C.rowwise().squaredNorm().transpose();
  if (X.cols() <= kSmallDim) {
    AssignSmallDim(X, C, metric, assign, score);
    return;
  }
  const int64_t block = BlockRows(k);
  const int64_t n_blocks = (n + block - 1) / block;
  auto run = [&](size_t b0, size_t b1) {
    RowMatrixXf G;
    for (int64_t r0 = static_cast<int64_t>(b0) * block;
         r0 < std::min<int64_t>(n, static_cast<int64_t>(b1) * block); r0 += block) {
      const int64_t rows = std::min(block, n - r0);
      G.noalias() = X.middleRows(r0, rows) * C.transpose();
      if (metric == KMeansMetric::kL2) G = (2.0f * G).rowwise() - c_norm2;
      for (int64_t r = 0; r < rows; ++r) {
        float best_val;
        assign[r0 + r] = ArgMax(G.row(r).data(), k, &best_val);
        if (score) score[r0 + r] = metric == KMeansMetric::kL2 ? -best_val : best_val;
      }
    }
  };
  // Blocks are independent; at least 2 per task, so small inputs stay inline.
  if (parallel && n_blocks >= 4) {
    ThreadPool::Default()->ParallelFor(static_cast<size_t>(n_blocks), run, 2);
  } else {
    run(0, static_cast<size_t>(n_blocks));
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

void NormalizeRows(RowMatrixXf* m) {
  for (int64_t i = 0; i < m->rows(); ++i) {
    const float norm = m->row(i).norm();
    if (norm > 0) m->row(i) /= norm;
  }
}

constexpr int64_t kSeedBlock = 64;

// Sum of n <= kSeedBlock floats (AVX2: 8 lanes, then across lanes).
double BlockSum(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  total = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) total += x[i];
  return total;
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
  // The pool's rows, contiguous: each new centre costs one GEMV over them.
  RowMatrixXf P(s, d);
  for (int64_t i = 0; i < s; ++i) P.row(i) = X.row(pool[i]);
  const Eigen::VectorXf p_norm2 = P.rowwise().squaredNorm();
  Eigen::VectorXf g(s);
  std::vector<float> dmin(s, std::numeric_limits<float>::infinity());
  std::vector<int64_t> chosen;
  chosen.reserve(k);
  std::vector<char> taken(s, 0);
  const int64_t n_blocks = (s + kSeedBlock - 1) / kSeedBlock;
  std::vector<double> block_sum(n_blocks);
  std::uniform_int_distribution<int64_t> first(0, s - 1);
  int64_t next = first(*rng);
  for (int c = 0; c < k; ++c) {
    chosen.push_back(pool[next]);
    taken[next] = 1;
    dmin[next] = 0;
    const Eigen::VectorXf cv = P.row(next).transpose();
    g.noalias() = P * cv;
    // D^2 weights: L2 |p|^2 - 2 p.c + |c|^2, cosine 1 - p.c (unit rows).
    const float c_norm2 = cv.squaredNorm();
    float* dm = dmin.data();
    const float* gv = g.data();
    const float* pn = p_norm2.data();
    if (metric == KMeansMetric::kL2) {
      for (int64_t i = 0; i < s; ++i) {
        dm[i] = std::min(dm[i], std::max(0.0f, pn[i] - 2.0f * gv[i] + c_norm2));
      }
    } else {
      for (int64_t i = 0; i < s; ++i) dm[i] = std::min(dm[i], std::max(0.0f, 1.0f - gv[i]));
    }
    // Taken points stay at 0 (dmin[next] = 0 above; min keeps it). Block
    // sums (SIMD within a block, double across blocks) let the draw below
    // skip whole blocks.
    double total = 0;
    for (int64_t bk = 0; bk < n_blocks; ++bk) {
      block_sum[bk] = BlockSum(dm + bk * kSeedBlock, std::min(kSeedBlock, s - bk * kSeedBlock));
      total += block_sum[bk];
    }
    if (c + 1 == k) break;
    if (total <= 0) {
      // All remaining points coincide with chosen ones: take any untaken.
      next = std::find(taken.begin(), taken.end(), 0) - taken.begin();
      continue;
    }
    std::uniform_real_distribution<double> u(0.0, total);
    double target = u(*rng);
    int64_t bk = 0;
    while (bk + 1 < n_blocks && target > block_sum[bk]) target -= block_sum[bk++];
    next = -1;
    for (int64_t i = bk * kSeedBlock; i < s; ++i) {
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
  AssignBlockwise(X, centroids, metric, assign, best, /*parallel=*/true);
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
  if (o.init == KMeansInit::kGiven &&
      (o.initial == nullptr || HasNonFinite(o.initial, static_cast<size_t>(o.k) * d))) {
    return InvalidArgumentError("kmeans: init kGiven needs k x d finite initial centroids");
  }

  RowMatrixXf X = StridedMap(x, n, d, Eigen::OuterStride<>(ld));
  if (HasNonFinite(X.data(), static_cast<size_t>(n) * d)) {
    return InvalidArgumentError("kmeans: points contain NaN/Inf");
  }
  const KMeansMetric metric = o.metric;
  if (metric == KMeansMetric::kCosine) NormalizeRows(&X);
  Eigen::VectorXf x_norm2 = X.rowwise().squaredNorm();
  StridedMap Xm(X.data(), n, d, Eigen::OuterStride<>(d));

  std::mt19937_64 rng(o.seed);
  KMeansResult res;
  RowMatrixXf& C = res.centroids;
  C.resize(o.k, d);
  if (o.init == KMeansInit::kGiven) {
    C = Eigen::Map<const RowMatrixXf>(o.initial, o.k, d);
    if (metric == KMeansMetric::kCosine) NormalizeRows(&C);
  } else {
    std::vector<int64_t> seeds = o.init == KMeansInit::kPlusPlus
                                     ? SeedPlusPlus(X, o.k, metric, o.max_init_points, &rng)
                                     : SeedRandom(n, o.k, &rng);
    for (int j = 0; j < o.k; ++j) C.row(j) = X.row(seeds[j]);
  }

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
      AssignBlockwise(Xm, C, metric, res.assign.data(), dist.data(), o.parallel);
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
      AssignBlockwise(Bm, C, metric, batch_assign.data(), nullptr, o.parallel);
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
  AssignBlockwise(Xm, C, metric, res.assign.data(), dist.data(), o.parallel);
  ScoresToDistances(x_norm2, metric, dist.data());
  res.objective = std::accumulate(dist.begin(), dist.end(), 0.0) / n;
  return res;
}

}  // namespace ctxcache::index
