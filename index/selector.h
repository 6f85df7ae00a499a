// Selector: the one interface every sparse-attention method implements
// (DESIGN §5). A Selector covers one (layer, kv head) of one context: it is
// built from prefill data (or loaded from its serialized artifact), selects
// tokens for the q heads of its GQA group, takes appended tokens (streaming
// update) and reports the work it did.
//
// Methods: "full", "oracle", "csa", "tactic", "lfps", "quest", "streaming".
//
// Ownership: a Selector owns its tables. Inputs passed by pointer are
// borrowed for the duration of the call only.
// Thread-safety: a Selector is NOT safe for concurrent mutation; Select() may
// mutate per-session state (search-period schedules, LFPS tables). Use one
// instance per session (Clone(): csa, tactic and quest clones share their
// immutable tables, so a clone costs SessionBytes()), or guard it. Clones
// sharing tables may be used on different threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ctxcache::index {

// Prefill data for one (layer, kv head). Row-major fp32, post-RoPE.
struct HeadPrefill {
  int64_t n_tokens = 0;                      // N: number of keys
  int head_dim = 0;                          // d
  int group_size = 0;                        // G: q heads sharing this kv head
  const float* keys = nullptr;               // N * d
  const float* values = nullptr;             // N * d; may be null for methods that ignore V
  int64_t n_queries = 0;                     // query rows per q head (<= N; may be a subsample)
  const int64_t* query_positions = nullptr;  // n_queries token positions, ascending;
                                             // null means the last n_queries positions
  const float* queries = nullptr;            // G * n_queries * d, laid out [q_head][row][d]
};

// Access to the keys (and values) of the tokens a Selector covers, for
// methods that score exactly at select time (oracle, tactic, lfps). In the
// service this is backed by KV pages; in tests by a plain array.
class KeySource {
 public:
  virtual ~KeySource() = default;
  virtual int64_t n_tokens() const = 0;
  virtual int head_dim() const = 0;
  // Writes the keys of ids[0..n) to out (n * d floats).
  virtual Status GatherKeys(const int32_t* ids, int64_t n, float* out) const = 0;
};

// A KeySource over a contiguous fp32 array (not owned).
class ArrayKeySource final : public KeySource {
 public:
  ArrayKeySource(const float* keys, int64_t n_tokens, int head_dim)
      : keys_(keys), n_(n_tokens), d_(head_dim) {}
  int64_t n_tokens() const override { return n_; }
  int head_dim() const override { return d_; }
  Status GatherKeys(const int32_t* ids, int64_t n, float* out) const override;
  const float* data() const { return keys_; }

 private:
  const float* keys_;
  int64_t n_;
  int d_;
};

// Method parameters as key=value pairs (e.g. {"m":"8","C":"128"}); each
// method documents its keys and defaults and rejects unknown keys with
// InvalidArgument. ParseParams accepts "m=8,C=128,alpha=0.25".
using MethodParams = std::map<std::string, std::string>;
StatusOr<MethodParams> ParseParams(std::string_view text);

struct SelectInput {
  const float* queries = nullptr;   // n_queries * d: the q heads of this kv head's group
  int n_queries = 0;                // normally G
  int64_t budget = 0;               // tokens per q head; 0 = the method's default (rho * N)
  const KeySource* keys = nullptr;  // required by oracle/tactic/lfps; may be null otherwise
  // Fill Selection::per_head_log_normalizer (methods that can: csa, oracle).
  bool want_log_normalizer = false;
  // Fill Selection::per_head_logits where the method returns them only on
  // request (quest: each selected token gets its page's bound U / sqrt(d)).
  // csa and oracle fill them regardless.
  bool want_logits = false;
};

struct Selection {
  // Per q head: selected token ids, sorted ascending, unique.
  std::vector<std::vector<int32_t>> per_head;
  // Union over all q heads given, sorted ascending, unique.
  std::vector<int32_t> merged;
  // Tactic: the estimated attention mass reached (per head average); -1 if n/a.
  double estimated_mass = -1.0;
  // Optional, parallel to per_head: the method's estimate of each selected
  // token's attention logit (q.k / sqrt(d) scale); empty when the method has
  // none. The page cap ranks pages by the softmax mass of these estimates.
  std::vector<std::vector<float>> per_head_logits;
  // Optional, one per q head when per_head_logits is set: log of the method's
  // estimated softmax normalizer, log sum_i exp(logit_i) over every covered
  // token with the same logit estimates (csa: its accumulated list scores;
  // oracle: exact). Empty when the method has no estimate for the tokens it
  // did not select. The session's per-step attention-mass estimate
  // (EstimateCapturedMass) needs it.
  std::vector<double> per_head_log_normalizer;
};

// Work done by one call, for benchmarks and metrics.
struct WorkStats {
  uint64_t entries_touched = 0;  // index entries read (list entries, centroids, ...)
  uint64_t bytes_touched = 0;    // bytes of index + keys read
  uint64_t keys_scored = 0;      // exact q.k products computed
  void Add(const WorkStats& o) {
    entries_touched += o.entries_touched;
    bytes_touched += o.bytes_touched;
    keys_scored += o.keys_scored;
  }
};

class Selector {
 public:
  virtual ~Selector() = default;

  virtual std::string_view method() const = 0;
  // Tokens covered, including appended ones.
  virtual int64_t n_tokens() const = 0;
  virtual int head_dim() const = 0;

  // Selects tokens for in.n_queries query vectors. `stats` may be null.
  virtual Status Select(const SelectInput& in, Selection* out, WorkStats* stats) = 0;

  // Streaming update: one new token at position n_tokens(). `value` may be
  // null for methods that ignore V; `queries` (G * d) may be null.
  virtual Status Append(const float* key, const float* value, const float* queries) = 0;

  // Serialized artifact (self-describing; includes a format version).
  virtual Status Serialize(std::string* out) const = 0;

  // A deep copy, e.g. one per decode session.
  virtual std::unique_ptr<Selector> Clone() const = 0;

  // In-memory size of the index tables, in bytes.
  virtual uint64_t MemoryBytes() const = 0;

  // Bytes this instance holds that its Clone()s do not share with it: the
  // per-session state (schedules, appended tokens, overlays). Methods whose
  // clones share their tables (csa, tactic, quest) count only their own
  // part. Default: MemoryBytes() (nothing shared).
  virtual uint64_t SessionBytes() const { return MemoryBytes(); }

  // Per-session overrides of the method's retrieval params (a decode
  // session's params such as csa's `rerank`; session/session_params.h), applied
  // to this instance, which must be the session's own (a Clone or a freshly
  // loaded artifact). InvalidArgument naming the param for one the method
  // does not take or a value the index cannot serve; nothing changes then.
  // Default: only an empty map is accepted.
  virtual Status ApplySessionOverrides(const MethodParams& overrides);
};

// Builds the selector `method` from prefill data.
StatusOr<std::unique_ptr<Selector>> BuildSelector(std::string_view method,
                                                  const HeadPrefill& prefill,
                                                  const MethodParams& params);

// Loads a selector from Serialize() output.
StatusOr<std::unique_ptr<Selector>> LoadSelector(std::string_view method, std::string_view bytes);

// Names of all registered methods.
std::vector<std::string> SelectorMethods();

}  // namespace ctxcache::index
