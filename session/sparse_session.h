// SparseSession: the one sparse decode-session core (DESIGN §11). The server
// (service/decode_session.h), the SDK's client mode (client/sdk/) and the
// embedded decode (model::SparseAttention) all run it; only the PageFetcher
// differs, so the three agree by construction.
//
// Per context it owns (or borrows) one index::Selector per (layer, kv head),
// the K/V/Q of the tokens appended during decode, and the per-step pipeline:
//
//   select (the method, index::Selector::Select)
//     -> page cap ranked by estimated attention mass (index::CapSelectedPages)
//     -> block-union page tables (index::BuildPageTables)
//     -> the pages to fetch (stored, or reaching into the appended tokens)
//     -> whole-page widening (index::ExpandToTablePages)
//     -> attention inputs (LoadPages; session/attention.h attends them).
//
// The session's sequence in layer l is the stored context (shape.n_stored
// tokens) followed by the n_appended(l) tokens appended to that layer. Page b
// covers tokens [b*B, (b+1)*B) of that sequence; pages that reach past the
// stored context are assembled from the stored rows and the appended K/V.
//
// Thread-safety: not safe for concurrent mutation. PlanHead / Append* mutate
// (selectors keep per-session state). The const members may run on another
// thread while no mutation runs (the SDK's prefetcher relies on this).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "index/page_table.h"
#include "index/selector.h"
#include "session/page_fetcher.h"
#include "session/session_params.h"

namespace ctxcache::session {

struct SessionShape {
  int n_layers = 0;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  // Tokens per page (B). Default: 16.
  int page_size = 16;
  // Tokens of the stored context.
  int64_t n_stored = 0;

  // The shape of a stored context of `n_stored` tokens in pages of
  // `page_size` tokens, for the model `spec` describes: model::ModelSpec
  // (fields n_layers, n_q_heads, n_kv_heads, head_dim) or the proto
  // v1::ModelSpec (accessors of those names). A template so that session/
  // includes neither model/ nor the generated code. Not validated: call
  // Validate.
  template <typename Spec>
  static SessionShape From(const Spec& spec, int64_t page_size, int64_t n_stored);

  int group_size() const { return n_kv_heads > 0 ? n_q_heads / n_kv_heads : 0; }
  // InvalidArgument naming the field unless every size is positive and
  // n_q_heads is a multiple of n_kv_heads.
  Status Validate() const;
};

template <typename Spec>
SessionShape SessionShape::From(const Spec& spec, int64_t page_size, int64_t n_stored) {
  SessionShape shape;
  if constexpr (requires { spec.n_layers(); }) {
    shape.n_layers = static_cast<int>(spec.n_layers());
    shape.n_q_heads = static_cast<int>(spec.n_q_heads());
    shape.n_kv_heads = static_cast<int>(spec.n_kv_heads());
    shape.head_dim = static_cast<int>(spec.head_dim());
  } else {
    shape.n_layers = static_cast<int>(spec.n_layers);
    shape.n_q_heads = static_cast<int>(spec.n_q_heads);
    shape.n_kv_heads = static_cast<int>(spec.n_kv_heads);
    shape.head_dim = static_cast<int>(spec.head_dim);
  }
  shape.page_size = static_cast<int>(page_size);
  shape.n_stored = n_stored;
  return shape;
}

// One (layer, kv head) of one step: what each q head attends and the pages
// that carry it.
struct HeadStep {
  // Per q head of the GQA group (G entries): the token ids it attends, sorted
  // and unique, after the page cap and (with whole_pages) the widening.
  std::vector<std::vector<int32_t>> per_q_head;
  // One block-union page table per execution subgroup.
  std::vector<index::PageTable> tables;
  // Union of the tables' pages, sorted ascending, unique.
  std::vector<uint32_t> pages;
  // pages[0, n_whole_stored) hold stored tokens only;
  // pages[0, n_with_stored) hold at least one stored token (the fetcher's
  // share); pages[n_whole_stored, end) reach into the appended tokens.
  size_t n_whole_stored = 0;
  size_t n_with_stored = 0;
  // Per q head of the group (G entries): the estimated attention mass that
  // per_q_head captures, in [0, 1], from the method's own logit estimates
  // (index::EstimateCapturedMass over Selection::per_head_logits and
  // per_head_log_normalizer: csa, oracle), or exactly 1 when every q head
  // attends every token (full). Only with the session param estimate_mass;
  // empty without it and when the method gives no estimate
  // (tactic with a token budget, quest, lfps, streaming; csa steps that reuse
  // a selection under a search period).
  std::vector<float> estimated_mass;

  std::span<const uint32_t> whole_stored_pages() const {
    return std::span<const uint32_t>(pages).first(n_whole_stored);
  }
  std::span<const uint32_t> pages_with_stored() const {
    return std::span<const uint32_t>(pages).first(n_with_stored);
  }
  std::span<const uint32_t> mixed_pages() const {
    return std::span<const uint32_t>(pages).subspan(n_whole_stored);
  }
};

class SparseSession {
 public:
  // selectors: [layer * n_kv_heads + kv_head], one method, each covering
  // shape.n_stored tokens of shape.head_dim. fetcher: not owned, outlives the
  // session. InvalidArgument for a wrong count, null entries, mixed methods
  // or a selector that does not match the shape. params.selector_overrides
  // (csa's rerank) are applied to these selectors; InvalidArgument from
  // Selector::ApplySessionOverrides when one cannot take them.
  // A selector loaded from a stored context's index artifact against the
  // context's manifest (n_tokens, head_dim): DataLoss when they disagree (the
  // stored context is inconsistent: `ctxcache fsck` finds it), naming the
  // layer, kv head and both counts. Where a session is opened on stored
  // data, this runs before Create, whose InvalidArgument is for callers'
  // selectors.
  static Status CheckStoredSelector(const index::Selector& selector, int layer, int kv_head,
                                    int64_t n_tokens, int head_dim);
  static StatusOr<std::unique_ptr<SparseSession>> Create(
      const SessionShape& shape, const SessionParams& params,
      std::vector<std::unique_ptr<index::Selector>> selectors, PageFetcher* fetcher);
  // Same, with selectors the caller owns (they must outlive the session).
  // InvalidArgument when params.selector_overrides is not empty: the
  // session does not change selectors it does not own.
  static StatusOr<std::unique_ptr<SparseSession>> CreateBorrowed(
      const SessionShape& shape, const SessionParams& params,
      std::vector<index::Selector*> selectors, PageFetcher* fetcher);
  ~SparseSession();

  const SessionShape& shape() const { return shape_; }
  const SessionParams& params() const { return params_; }
  std::string_view method() const;
  // Tokens in layer `layer`'s sequence: stored + appended to that layer.
  int64_t n_tokens(int layer) const { return shape_.n_stored + n_appended_[layer]; }
  // Tokens in the last layer's sequence (all layers agree between steps).
  int64_t n_tokens() const { return n_tokens(shape_.n_layers - 1); }

  // Runs the pipeline for kv head `kv_head` of `layer` with the session's
  // selector. group_queries: the G query rows of the kv head's group, G * d
  // floats. work (may be null) accumulates the selector's work.
  // InvalidArgument for a layer or head out of range.
  Status PlanHead(int layer, int kv_head, const float* group_queries, HeadStep* out,
                  index::WorkStats* work);
  // Same pipeline with another selector and key source of `layer`, e.g. a
  // prediction copy on a prefetch thread. `selector` must cover
  // n_tokens(layer) tokens; keys may be null for methods that need none.
  Status PlanHeadWith(int layer, index::Selector* selector, const index::KeySource* keys,
                      const float* group_queries, HeadStep* out, index::WorkStats* work) const;

  // A key source over (layer, kv_head) for exact-scoring selectors: stored
  // keys through `fetcher` (not owned), appended keys from the session.
  // Valid while the session lives.
  std::unique_ptr<index::KeySource> MakeKeySource(int layer, int kv_head,
                                                  PageFetcher* fetcher) const;

  // Decoded K/V of every page of `step` into *out: pages with stored rows
  // through `fetcher` (null: the session's), pages reaching into the
  // appended tokens assembled (AssemblePage).
  Status LoadPages(int layer, int kv_head, const HeadStep& step, PageMap* out,
                   PageFetcher* fetcher = nullptr) const;

  // Page `block` of (layer, kv_head) built from its stored rows
  // (`stored_part`, null when the block starts at or after n_stored) and the
  // appended K/V. InvalidArgument when the block lies outside the sequence
  // or stored_part has the wrong number of rows.
  StatusOr<PageRef> AssemblePage(int layer, int kv_head, uint32_t block,
                                 const DecodedPage* stored_part) const;

  // Streaming update of one layer with a new token: k and v [n_kv][d], q
  // [n_q][d] or null. The token joins every selector of the layer
  // (Selector::Append) and the appended K/V.
  Status AppendLayer(int layer, const float* k, const float* v, const float* q);
  // AppendLayer for every layer: k, v [n_layers][n_kv][d], q
  // [n_layers][n_q][d] or null.
  Status Append(const float* k, const float* v, const float* q);

  // Appended K or V of (layer, kv_head): [n_appended(layer)][d] floats.
  const std::vector<float>& appended_k(int layer, int kv_head) const {
    return app_k_[Slot(layer, kv_head)];
  }
  const std::vector<float>& appended_v(int layer, int kv_head) const {
    return app_v_[Slot(layer, kv_head)];
  }
  int64_t n_appended(int layer) const { return n_appended_[layer]; }
  // Bytes this session holds on its own: the owned selectors' per-session
  // state (Selector::SessionBytes; tables shared with other clones are not
  // counted), the appended K/V and the session's bookkeeping.
  uint64_t MemoryBytes() const;
  index::Selector* selector(int layer, int kv_head) const {
    return selectors_[Slot(layer, kv_head)];
  }

 private:
  class KeySourceImpl;
  SparseSession(const SessionShape& shape, const SessionParams& params, PageFetcher* fetcher);
  size_t Slot(int layer, int kv_head) const {
    return static_cast<size_t>(layer) * shape_.n_kv_heads + kv_head;
  }
  Status CheckHead(int layer, int kv_head) const;
  static Status CheckSelectors(const SessionShape& shape,
                               const std::vector<index::Selector*>& selectors);

  SessionShape shape_;
  SessionParams params_;
  PageFetcher* fetcher_;
  std::vector<std::unique_ptr<index::Selector>> owned_;
  std::vector<index::Selector*> selectors_;                // [layer * n_kv + head]
  std::vector<std::unique_ptr<index::KeySource>> keys_;    // the session's fetcher
  std::vector<std::vector<float>> app_k_, app_v_;          // [slot] -> [n_appended][d]
  std::vector<int64_t> n_appended_;                        // per layer
};

}  // namespace ctxcache::session
