// K-means over row-major fp32 points, with Eigen GEMM for the distance
// computations (points are processed in row blocks, never one at a time).
//
//   kL2:     minimizes sum ||x - c_a(x)||^2 (Tactic, DESIGN §5.2).
//   kCosine: spherical k-means: points are L2-normalized, centroids are kept
//            at unit norm and assignment maximizes x.c (CSAttention §3.2).
// Seeding: k-means++ (D^2 sampling; for cosine the distance is 1 - cos), k
// distinct random points, or given centroids. Optional mini-batch updates (Sculley 2010) with
// per-centroid learning rates. Empty clusters are re-seeded with the point
// farthest from its centroid. Deterministic for a given seed and input.
//
// Thread-safety: KMeans() and AssignNearest() are reentrant. Their
// assignment GEMMs spread row blocks over ThreadPool::Default() (KMeans' unless
// KMeansOptions::parallel is false; inline when called from a pool thread);
// results do not depend on the thread count.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "index/eigen_blocking.h"

namespace ctxcache::index {

using RowMatrixXf = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

enum class KMeansMetric { kL2, kCosine };
// kGiven starts from KMeansOptions::initial (k x d, row-major).
enum class KMeansInit { kPlusPlus, kRandom, kGiven };

struct KMeansOptions {
  // Number of centroids. Must be in [1, n]. Default: 128.
  int k = 128;
  // Distance. Default: kL2.
  KMeansMetric metric = KMeansMetric::kL2;
  // Seeding. Default: k-means++.
  KMeansInit init = KMeansInit::kPlusPlus;
  // kGiven: the k x d starting centroids (row-major, finite; for kCosine they
  // are normalized). Must outlive the call. Default: nullptr.
  const float* initial = nullptr;
  // Maximum number of iterations (full passes, or mini-batch steps). Default: 20.
  int max_iters = 20;
  // Stop when the relative objective change between iterations is below this
  // (full-batch only; 0 disables). Default: 1e-4.
  double tolerance = 1e-4;
  // 0: full-batch Lloyd iterations. >0: mini-batch k-means with batches of
  // this many points per step. Default: 0.
  int64_t batch_size = 0;
  // RNG seed (std::mt19937_64). Default: 42.
  uint64_t seed = 42;
  // Spread the assignment GEMMs over ThreadPool::Default(). Callers that
  // already run KMeans calls in parallel set false. Default: true.
  bool parallel = true;
  // k-means++ runs on at most this many points (a deterministic random
  // subsample) to bound its O(n k d) cost. Default: 65536.
  int64_t max_init_points = 65536;
};

struct KMeansResult {
  RowMatrixXf centroids;        // k x d (unit rows for kCosine)
  std::vector<int32_t> assign;  // n: centroid of each point (final assignment)
  double objective = 0.0;       // L2: mean squared distance; cosine: mean (1 - cos)
  int iterations = 0;           // iterations run
};

// Clusters n points of dimension d; point i starts at x + i * ld (ld >= d
// floats), so a column block of a wider matrix can be clustered in place.
// InvalidArgument on bad sizes, k > n, or NaN/Inf in the points.
StatusOr<KMeansResult> KMeans(const float* x, int64_t n, int d, int64_t ld,
                              const KMeansOptions& options);

// Nearest centroid of each of n points (row stride ld) under `metric`; for
// kCosine the points need not be normalized (argmax x.c is scale-free).
// Writes n ids to assign and, if non-null, the best similarity (cosine:
// x.c / |x|; L2: squared distance) to best. The same blocked search as
// KMeans' assignment step, so against KMeansResult::centroids it returns
// KMeansResult::assign.
void AssignNearest(const float* x, int64_t n, int d, int64_t ld, const RowMatrixXf& centroids,
                   KMeansMetric metric, int32_t* assign, float* best);

}  // namespace ctxcache::index
