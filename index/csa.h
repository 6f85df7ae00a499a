// CSAttention: query-centric centroid-score tables (seed 004, DESIGN §5.1).
//
// Build, per (layer, kv head): pool the prefill queries of the GQA group
// (subsampled to query_cap rows), split d into m equal subspaces, run cosine
// k-means (k-means++, unit centroids) on the L2-normalized sub-queries, score
// every key against every centroid, s_j^b(i) = c_j^b . (k_i^b - kbar^b) (one
// GEMM per subspace; kbar = mean build key, see center_keys; the paper uses
// raw keys, center=0), and keep the top-L (id int32, score fp16) per centroid.
// Ranking uses the fp16-rounded score, ties to the lower id, so that a
// streaming insert reproduces a rebuild exactly (up to GEMM rounding). The
// top-L is a radix select over the 16-bit order keys of the fp16 scores.
// Subspaces are built in parallel on ThreadPool::Default() (inline when
// Build is called from a pool thread); the tables do not depend on the
// thread count.
//
// Retrieve, per query q (CSAttention §3.3): in each subspace the nearest
// centroid by cosine, or the top tau when the best cosine < backoff_cos;
// sparse accumulation s^(i) = sum_b w_b [i in I_b] V_b[i] into a dense,
// reused accumulator (w_b = 1 "uniform", or ||q^b|| "norm", which makes s^
// approximate q.k; seed 004 §2.3), or q^b.c_b "proj" (confidence-weighted,
// the least-squares estimate of q^b.k^b). A key missing from a gathered list
// scores 0 (the paper's literal sum, default) or is imputed the list
// minimum (missing=min; equivalently entries add V_b[i] - min_b). The
// first `sinks` tokens and the last R tokens are always selected; the rest of
// the budget K (SelectInput.budget, or ceil(rho * N)) is the top of s^, ties
// to the lower id. With period P > 1 a selection is reused for P calls, plus
// the tokens appended since (the "keep-rho, search every P steps" schedules
// 0.05/1, 0.15/4, 0.20/8). Selection.merged is the union over the q heads.
//
// Two-stage retrieval (rerank > 0; not in the paper): the lists propose,
// an 8-bit key sketch decides. The top ceil(rerank * K) - |forced| tokens by
// s^ (forced tokens excluded) are re-scored with the sketch, r_i = q .
// khat_i, where khat_i = scale_i * code_i approximates k_i - kbar (one fp16
// scale per token, codes int8 in [-127, 127]), and
// the top K - |forced| of them by r (ties to the lower id) join the forced
// tokens. The selected tokens' logit estimates are r_i / sqrt(d) (forced
// tokens are sketch-scored too). The query side is quantized too, so the sum
// is exact integer arithmetic: qs = max|q_j| / 2047, qi_j = round(q_j / qs)
// (ties to even), r_i = float(double(sum_j qi_j * code_ij) * (double(qs) *
// double(scale_i))); a client computes the same r_i bit for bit. Why: the
// centroid estimate alone reaches ~0.6 recall@5% on the reference model
// (docs/algorithms.md "Two-stage retrieval").
// The sketch costs d + 2 bytes per token.
//
// Append (§3.3 (5)): the new key is scored against every centroid and
// replaces the worst entry of each list it beats; lists keep size L (stored
// as binary min-heaps, worst entry at the root).
//
// Method parameters ("csa"):
//   m=0 (by head_dim) C=128 alpha=0.125 L=0 (fixed L; 0 = alpha*N) query_cap=4096
//   iters=8 seed=42 center=1 rho=0.05 R=32 sinks=4 tau=2 backoff_cos=0.3
//   weights=norm|uniform|proj missing=zero|min|mean period=1
//   schedule=<rho>/<period> (preset; overrides rho and period) rerank=6
//   format=compact|plain (what Serialize() writes). The defaults are
//   CsaOptions' (below); a served context records them all
//   (CsaOptionsToParams).
//
// Serialized forms (LoadCsaSelector reads both, by magic; byte layouts in
// docs/storage-format.md):
//   plain   "CSAP": options, centroids fp32, the key and tail means, then all
//           lists' int32 ids, then all their fp16 scores, in heap order:
//           bit-exact round trip.
//   compact "CSAC" (version 2, written): lists sorted by id, ids as a bitmap
//           over n_tokens or delta varints (whichever is smaller), scores as
//           4-bit codes into a per-list codebook of min(16, L) fp16 values
//           (1-D Lloyd-Max); after loading the scores equal the codebook
//           values. Version 1 (8-bit scores between the list's min and max,
//           delta varint ids) is still read.
//
// Sharing (issue #19): the tables (centroids, means, lists) are immutable
// once built or loaded and are shared by Clone()s through a
// shared_ptr<const>; a clone costs a few hundred bytes. The lists are kept
// sorted worst entry first (Build writes them so; Load places them so), which is
// also a valid heap. Per-instance state is the retrieval options, the
// search-period schedule and an overlay of the tokens appended to this
// instance: per list the appended entries it holds (8 bytes each) and how
// many of its worst base entries they pushed out. A list is always the top L
// of its base and appended entries, as when the heaps were rewritten in
// place, so selections are the same; list_ids() and the serialized forms
// give each list sorted worst first. Select() scratch (the dense
// accumulator) is per thread, not per instance.
//
// Thread-safety: as Selector: Select() and Append() mutate per-instance
// schedule and overlay state, so one instance per session (Clone()).
// Distinct instances sharing tables may run on any threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/large_buffer.h"
#include "index/kmeans.h"
#include "index/selector.h"
#include "index/topk.h"

namespace ctxcache::index {

class ByteReader;
class ByteWriter;

struct CsaOptions {
  // Subspaces; must divide head_dim. 0 = chosen by head_dim at build
  // (CsaSubspaces: 16 subspaces of 4 dims at d 64, of 8 dims at d 128); a
  // built or loaded selector always holds the resolved m. Why not the
  // paper's 8: docs/algorithms.md, "Subspaces and α". Default: 0.
  int m = 0;
  // Centroids per subspace; <= n_tokens and <= pooled query rows. Default: 128.
  int C = 128;
  // List length L = ceil(alpha * N) when fixed_L == 0. In (0, 1]. With m 16
  // and alpha 0.125 a step reads as many list entries as the paper's m 8,
  // alpha 0.25. Default: 0.125.
  double alpha = 0.125;
  // Fixed list length, overriding alpha when > 0 (clamped to N). Default: 0.
  int64_t fixed_L = 0;
  // Pooled prefill query rows used for k-means (deterministic subsample; 32
  // per centroid at C = 128; docs/algorithms.md has the recall cost of the
  // sample size). Default: 4096.
  int64_t query_cap = 4096;
  // Cosine k-means iterations per subspace (fewer when the objective
  // converges). Default: 8.
  int kmeans_iters = 8;
  // Score centroids against centered keys k_i - mean(k): a shift every query
  // sees equally (q.mean(k) is constant over keys), so top-K and softmax are
  // unchanged, but list membership no longer carries the keys' large common
  // offset (a key missing from a list scores 0, not "offset"). Default: true.
  bool center_keys = true;
  // Seed for subsampling and k-means. Default: 42.
  uint64_t seed = 42;

  // --- retrieval ---
  // Keep ratio: K = ceil(rho * N) when SelectInput.budget == 0. (0, 1]. Default: 0.05.
  double rho = 0.05;
  // Recent window always selected. Default: 32.
  int recent = 32;
  // Leading sink tokens always selected. Default: 4.
  int sinks = 4;
  // Centroids per subspace on backoff (1 disables). Default: 2.
  int tau = 2;
  // Back off to tau centroids when the best cosine is below this. Default: 0.3.
  double backoff_cos = 0.3;
  // w_b = ||q^b|| instead of the paper's 1: the accumulated score then
  // estimates q.k, which the session's mass-ranked page cap needs
  // (docs/algorithms.md). Default: true.
  bool norm_weights = true;
  // w_b = q^b . c_b (the projection of q^b on its centroid: the least-squares
  // estimate of q^b.k^b from c_b.k^b); overrides norm_weights. Default: false.
  bool proj_weights = false;
  // A key missing from a gathered list is imputed the list's minimum (the
  // L-th score, an upper bound on its partial score) instead of 0. Same as
  // accumulating V_b[i] - min_b; ranking is then invariant to per-subspace
  // score offsets. false = the paper's literal sum over present entries.
  // Default: false.
  bool impute_min = false;
  // A missing key is imputed the mean build-time score of the keys outside
  // the list (its expected partial score; one float per list). Overrides
  // impute_min. Default: false.
  bool impute_tail_mean = false;
  // Search period P: a selection is reused for P Select() calls. Default: 1.
  int period = 1;
  // Two-stage retrieval: re-score the top ceil(rerank * K) tokens by the
  // list estimate with the 8-bit key sketch and keep the top K of them
  // (header comment). 0 = the lists alone, and Build stores no sketch;
  // otherwise in [1, 64]. A selector loaded from an artifact without a
  // sketch has rerank 0. Default: 6.
  double rerank = 6.0;
  // Serialize() writes the compact form (bitmap or delta-varint ids, 4-bit
  // codebook scores; docs/storage-format.md). Default: true.
  bool compact = true;
};

// Parses "csa" MethodParams into options (InvalidArgument on bad values).
// Absent keys keep CsaOptions' defaults.
StatusOr<CsaOptions> ParseCsaOptions(const MethodParams& params);
// CsaOptions::rerank's valid values: 0 or in [1, 64] (also a decode
// session's `rerank`, session/session_params.h).
bool IsValidCsaRerank(double rerank);
// The subspaces a build uses: m when m > 0, else the largest divisor of
// head_dim that is <= min(16, head_dim / 4) (at least 1).
int CsaSubspaces(int m, int head_dim);

// Every option as params: ParseCsaOptions(CsaOptionsToParams(o)) == o.
MethodParams CsaOptionsToParams(const CsaOptions& o);

class CsaSelector final : public Selector {
 public:
  // Validates prefill and options and builds the tables.
  static StatusOr<std::unique_ptr<CsaSelector>> Build(const HeadPrefill& prefill,
                                                      const CsaOptions& options);
  // Reads either serialized form.
  static StatusOr<std::unique_ptr<CsaSelector>> Load(std::string_view bytes);

  std::string_view method() const override { return "csa"; }
  int64_t n_tokens() const override { return n_tokens_; }
  int head_dim() const override { return d_; }
  Status Select(const SelectInput& in, Selection* out, WorkStats* stats) override;
  Status Append(const float* key, const float* value, const float* queries) override;
  Status Serialize(std::string* out) const override;
  std::unique_ptr<Selector> Clone() const override;
  uint64_t MemoryBytes() const override;

  // Explicit forms, independent of options().compact.
  void SerializePlain(std::string* out) const;
  void SerializeCompact(std::string* out) const;

  const CsaOptions& options() const { return options_; }
  // Mutable retrieval knobs (rho, recent, sinks, tau, backoff_cos,
  // norm_weights, period); resets the schedule. Table shape (m, C, L) is fixed.
  Status SetRetrievalOptions(const CsaOptions& options);
  // Session overrides: `rerank` (0 or [1, 64]; > 0 needs the key sketch).
  Status ApplySessionOverrides(const MethodParams& overrides) override;

  int m() const { return options_.m; }
  int C() const { return options_.C; }
  int64_t L() const { return L_; }
  int sub_dim() const { return d_ / options_.m; }
  // Centroid (b, j): sub_dim floats, unit norm.
  const std::vector<float>& key_mean() const { return base_->key_mean; }
  const float* centroid(int b, int j) const {
    return base_->centroids.data() + (static_cast<int64_t>(b) * options_.C + j) * sub_dim();
  }
  // List (b, j): L ids and fp16 scores, worst entry first (a heap; sorted),
  // including appended tokens. Inspection: a list this instance appended
  // into is materialized into a per-instance copy, valid until the next
  // Append().
  const int32_t* list_ids(int b, int j) const;
  const uint16_t* list_scores(int b, int j) const;

  // Bytes of this instance's own state (options, schedule, overlay), not
  // counting the shared tables (TableBytes()).
  uint64_t SessionBytes() const override;
  // Bytes of the shared tables.
  uint64_t TableBytes() const;
  // True when both instances read the same table memory.
  bool SharesTablesWith(const CsaSelector& other) const { return base_ == other.base_; }

  // The key sketch of token `id` (< n_tokens(), appended tokens included):
  // d int8 codes and the scale, khat = scale * code ~ k - key_mean. Only
  // when has_sketch().
  bool has_sketch() const { return !base_->sketch_scale.empty(); }
  const int8_t* sketch_codes(int64_t id) const;
  float sketch_scale(int64_t id) const;

  // Table bytes per covered token: plain (int32 + fp16 per entry, plus
  // centroids) and compact (actual encoded size).
  double PlainBytesPerToken() const;
  double CompactBytesPerToken() const;

 private:
  // The immutable tables, shared by clones.
  struct Tables {
    std::vector<float> centroids;  // m * C * sub_dim
    std::vector<float> key_mean;   // d: subtracted from keys before scoring (zeros if !center)
    std::vector<float> tail_mean;  // m * C: mean build score of keys outside each list
    // The lists: nearly all of the tables' bytes, freed to the OS with the
    // last clone (LargeVector, common/large_buffer.h).
    LargeVector<int32_t> ids;      // m * C * L, each list a heap (worst entry first)
    LargeVector<uint16_t> scores;  // m * C * L (fp16)
    // The key sketch (rerank > 0; else empty): codes n_base * d, scales n_base (fp16).
    LargeVector<int8_t> sketch;
    std::vector<uint16_t> sketch_scale;
  };
  // One list's appended state. Base lists are kept sorted worst first (a
  // sorted array is also a heap with the worst entry at the root), so the
  // base entries appended tokens pushed out are its first n_evicted.
  struct Entry {
    int32_t id;
    uint16_t score;  // fp16
  };
  struct ListOverlay {
    uint32_t n_evicted = 0;    // base entries pushed out: the first n_evicted
    std::vector<Entry> live;   // heap (worst first) of the appended entries in the list
  };
  // Per-list overlays: empty until the first Append, then m * C.
  struct Overlay {
    std::vector<ListOverlay> lists;
    // The sketches of the appended tokens (ids n_base_, n_base_ + 1, ...).
    std::vector<int8_t> sketch;
    std::vector<uint16_t> sketch_scale;
  };

  CsaSelector() = default;
  int64_t ListOffset(int b, int j) const { return (static_cast<int64_t>(b) * options_.C + j) * L_; }
  const ListOverlay* overlay(int64_t list) const {
    if (overlay_.lists.empty()) return nullptr;
    const ListOverlay& o = overlay_.lists[static_cast<size_t>(list)];
    return o.live.empty() && o.n_evicted == 0 ? nullptr : &o;
  }
  // Score of the worst entry of `list` (base and overlay).
  float WorstScore(int64_t list) const;
  // The list's current entries, sorted worst first.
  void MaterializeList(int64_t list, std::vector<int32_t>* ids, std::vector<uint16_t>* sc) const;
  // Pointers to list `list`, worst first: the base arrays, or materialized
  // into *ids / *sc when the list has an overlay.
  void ListView(int64_t list, std::vector<int32_t>* ids, std::vector<uint16_t>* sc,
                const int32_t** ids_out, const uint16_t** sc_out) const;
  // acc[id] += fma(score, w, bias) over the list's current entries.
  void AccumulateCurrent(int64_t list, float w, float bias, float* acc) const;
  // logits and log_normalizer may be null: the estimated logits of the
  // selected tokens and log sum_i exp over every covered token's estimate.
  void SearchOne(const float* q, std::vector<int32_t>* selected, std::vector<float>* logits,
                 double* log_normalizer, WorkStats* stats);
  // SearchOne's steps. AccumulateLists: per sub-query, the nearest
  // centroid's list (under backoff the top-tau lists, averaged) added into
  // Scratch().acc; returns the lists gathered, adds the sub-query norms to
  // *norm_sum. SelectBySketch (rerank > 0 with a sketch) and
  // SelectByAccumulators pick k tokens: *selected holds the forced tokens
  // (sinks, recent window) on entry and the selection, ascending, on return.
  int64_t AccumulateLists(const float* q, float* norm_sum);
  void SelectBySketch(const float* q, int64_t k, float to_logit, std::vector<int32_t>* selected,
                      std::vector<float>* logits, double* log_normalizer, WorkStats* stats);
  void SelectByAccumulators(int64_t k, float to_logit, int64_t n_sinks, int64_t recent_start,
                            std::vector<int32_t>* selected, std::vector<float>* logits,
                            double* log_normalizer);
  // out[e] = the sketch score q . khat of token ids[e], e < n.
  void SketchScores(const float* q, const int32_t* ids, int64_t n, float* out) const;
  Status ReadTables(std::string_view bytes);
  // ReadTables' last section (from the sketch versions on): rerank, the
  // sketch bits, codes and scales into *t; sets options_.rerank (0 before
  // those versions). DataLoss naming what is wrong.
  Status ReadKeySketch(ByteReader* r, bool compact, uint32_t version, Tables* t);
  // The sketch section of both serialized forms: rerank, bits, codes, scales.
  void PutSketch(ByteWriter* w) const;

  CsaOptions options_;
  int d_ = 0;
  int64_t n_tokens_ = 0;  // covered tokens, including appended ones
  int64_t n_built_ = 0;   // tokens at build time
  int64_t n_base_ = 0;    // tokens the shared tables cover
  int64_t L_ = 0;
  std::shared_ptr<const Tables> base_;
  Overlay overlay_;
  // list -> materialized (ids, scores), for list_ids()/list_scores().
  mutable std::vector<std::pair<int64_t, std::pair<std::vector<int32_t>, std::vector<uint16_t>>>>
      views_;

  // Search-period schedule (per instance).
  int64_t budget_ = 0;  // SelectInput.budget of the current search
  int steps_since_search_ = 0;
  int64_t n_at_last_search_ = 0;
  std::vector<std::vector<int32_t>> last_per_head_;
};

StatusOr<std::unique_ptr<Selector>> BuildCsaSelector(const HeadPrefill& prefill,
                                                     const MethodParams& params);
StatusOr<std::unique_ptr<Selector>> LoadCsaSelector(std::string_view bytes);

}  // namespace ctxcache::index
