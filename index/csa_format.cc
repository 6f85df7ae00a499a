// CsaSelector's artifact formats: CSAP (plain) and CSAC (compact) writers,
// the loader (ReadTables, Load) and the size accounting
// (docs/storage-format.md, "Index artifacts").
#include "index/csa.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "common/dtype.h"
#include "common/thread_pool.h"
#include "index/byte_io.h"
#include "index/csa_internal.h"
#include "index/metrics.h"
#include "index/oracle.h"
#include "index/params.h"

namespace ctxcache::index {

using csa_internal::kPlainVersion;
using csa_internal::kCompactVersion;
using csa_internal::kPlainSketchVersion;
using csa_internal::kCompactSketchVersion;
using csa_internal::kSketchBits;
using csa_internal::kSketchMaxCode;
using csa_internal::kCompactScoreBits;
using csa_internal::kIdsVarint;
using csa_internal::kIdsBitmap;
using csa_internal::kIdsEliasFano;
using csa_internal::kEntryBytes;
using csa_internal::Half;
using csa_internal::Beats;
using csa_internal::CheckOptions;

namespace {

// Elias-Fano coding of L strictly increasing ids in [0, n): with k low bits,
// the low parts packed (L * k bits), then an upper bitmap of L + ((n - 1) >> k)
// + 1 bits where entry e sets bit (id_e >> k) + e. Bits are little-endian
// (bit i is byte i / 8, bit i % 8).
struct EliasFanoShape {
  int k = 0;
  uint64_t low_bytes = 0, upper_bits = 0, upper_bytes = 0;
  uint64_t bytes() const { return 1 + low_bytes + upper_bytes; }  // + the k byte
};

EliasFanoShape EliasFanoFor(int k, int64_t L, int64_t n) {
  EliasFanoShape s;
  s.k = k;
  s.low_bytes = (static_cast<uint64_t>(L) * k + 7) / 8;
  s.upper_bits = static_cast<uint64_t>(L) + (static_cast<uint64_t>(n - 1) >> k) + 1;
  s.upper_bytes = (s.upper_bits + 7) / 8;
  return s;
}

// The k that minimizes the coded size (the smaller k on ties).
EliasFanoShape BestEliasFano(int64_t L, int64_t n) {
  EliasFanoShape best = EliasFanoFor(0, L, n);
  for (int k = 1; k <= 31; ++k) {
    const EliasFanoShape s = EliasFanoFor(k, L, n);
    if (s.bytes() < best.bytes()) best = s;
  }
  return best;
}
// Sorts a list worst entry first (ascending score, among equal scores the
// higher id first): the order Build writes, and a heap with the worst entry
// at the root. ids_ascending: the ids come in ascending order (the compact
// loader's), which a stable radix sort on the fp16 order keys keeps for ties;
// otherwise a comparison sort.
void SortWorstFirst(int32_t* ids, uint16_t* sc, int64_t L, bool ids_ascending,
                    std::vector<uint64_t>* a, std::vector<uint64_t>* b) {
  if (!ids_ascending) {
    bool sorted = true;
    for (int64_t e = 1; e < L && sorted; ++e) {
      sorted = Beats(Half(sc[e]), ids[e], Half(sc[e - 1]), ids[e - 1]);
    }
    if (sorted) return;
  }
  a->resize(static_cast<size_t>(L));
  b->resize(static_cast<size_t>(L));
  for (int64_t e = 0; e < L; ++e) {
    // Descending order key on top, then the payload.
    const uint16_t h = sc[e] == 0x8000 ? 0 : sc[e];
    const uint16_t key = static_cast<uint16_t>(
        ~(h ^ (static_cast<uint16_t>(static_cast<int16_t>(h) >> 15) | 0x8000)));
    (*a)[e] = (uint64_t{key} << 48) | (uint64_t{sc[e]} << 32) | static_cast<uint32_t>(ids[e]);
  }
  if (ids_ascending) {
    for (int shift = 48; shift < 64; shift += 8) {
      size_t count[257] = {};
      for (uint64_t v : *a) ++count[((v >> shift) & 0xFF) + 1];
      for (int k = 0; k < 256; ++k) count[k + 1] += count[k];
      for (uint64_t v : *a) (*b)[count[(v >> shift) & 0xFF]++] = v;
      a->swap(*b);
    }
    std::reverse(a->begin(), a->end());  // ascending key, ties: descending id
  } else {
    std::sort(a->begin(), a->end(), [](uint64_t x, uint64_t y) {
      const uint16_t kx = static_cast<uint16_t>(x >> 48), ky = static_cast<uint16_t>(y >> 48);
      if (kx != ky) return kx > ky;  // descending key: ascending score
      return static_cast<int32_t>(x) > static_cast<int32_t>(y);
    });
  }
  for (int64_t e = 0; e < L; ++e) {
    ids[e] = static_cast<int32_t>(static_cast<uint32_t>((*a)[e]));
    sc[e] = static_cast<uint16_t>((*a)[e] >> 32);
  }
}

// Codebook entries per list: 2^bits, or L when the list is shorter.
int CodebookLevels(int bits, int64_t L) {
  return static_cast<int>(std::min<int64_t>(int64_t{1} << bits, L));
}

uint64_t VarintSize(uint64_t v) {
  uint64_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// The index of the level nearest to v in the ascending book (the lower one
// on a tie). Distances fall towards v's insertion point from both sides, so
// the nearest level is one of its two neighbours; equal distances further
// down (duplicate levels, or float rounding) are walked to the first.
uint32_t NearestLevel(const float* book, int levels, float v) {
  int best = 0;  // lower_bound by counting (branch-free over <= 16 levels)
  for (int i = 0; i < levels; ++i) best += book[i] < v ? 1 : 0;
  if (best == levels) {
    best = levels - 1;
  } else if (best > 0 && !(std::abs(v - book[best]) < std::abs(v - book[best - 1]))) {
    --best;
  }
  while (best > 0 && std::abs(v - book[best - 1]) <= std::abs(v - book[best])) --best;
  return static_cast<uint32_t>(best);
}

// The order-preserving 16-bit image of fp16 bits h (negatives' bits
// inverted, positives' sign bit set): a < b as halves iff image(a) < image(b)
// (+0 and -0 apart).
uint16_t HalfOrderKey(uint16_t h) {
  return (h & 0x8000u) ? static_cast<uint16_t>(~h) : static_cast<uint16_t>(h | 0x8000u);
}

// The n fp16 values h ascending, as floats, by a two-pass LSD radix sort of
// their HalfOrderKey images; those sorted images are left in `keys`. `keys`
// and `tmp` hold n entries each.
void SortHalves(const uint16_t* h, int64_t n, uint16_t* keys, uint16_t* tmp, float* out) {
  for (int64_t i = 0; i < n; ++i) keys[i] = HalfOrderKey(h[i]);
  for (int shift = 0; shift < 16; shift += 8) {
    int64_t count[257] = {};
    for (int64_t i = 0; i < n; ++i) ++count[((keys[i] >> shift) & 0xFF) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (int64_t i = 0; i < n; ++i) tmp[count[(keys[i] >> shift) & 0xFF]++] = keys[i];
    std::swap(keys, tmp);
  }
  // Two passes: the sorted keys are back in the caller's `keys`.
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t k = keys[i];
    out[i] = Half((k & 0x8000u) ? static_cast<uint16_t>(k & 0x7FFFu) : static_cast<uint16_t>(~k));
  }
}

// A 1-D Lloyd-Max codebook of `levels` fp16 values (ascending) for the n
// ascending scores: equal-count groups' means, then Lloyd iterations (each
// level the mean of the scores nearest to it).
void ScoreCodebook(const float* sorted, int64_t n, int levels, uint16_t* book) {
  std::vector<double> level(levels);
  for (int g = 0; g < levels; ++g) {
    const int64_t a = g * n / levels, b = (g + 1) * n / levels;
    if (b > a) {
      double sum = 0;
      for (int64_t i = a; i < b; ++i) sum += sorted[i];
      level[g] = sum / static_cast<double>(b - a);
    } else {
      level[g] = sorted[std::min<int64_t>(a, n - 1)];
    }
  }
  std::vector<double> sum(levels);
  std::vector<int64_t> count(levels);
  // Whether score x is strictly nearer to level g + 1 than to level g.
  auto nearer_next = [&](float x, int g) {
    return std::abs(x - level[g + 1]) < std::abs(x - level[g]);
  };
  // The scores are fp16 values (multiples of 2^-24): while n * max|score| <
  // 2^29 every partial sum of them is exact in a double, so a run's sum is
  // a difference of two prefix sums, bit for bit the sum the walk below
  // accumulates, and each run's end is found by binary search instead of a
  // test per score (nearer_next is monotone in x over ascending scores).
  const double max_abs = n > 0 ? std::max(std::abs(sorted[0]), std::abs(sorted[n - 1])) : 0.0;
  const bool exact_prefix = static_cast<double>(n) * max_abs < 536870912.0;  // 2^29
  std::vector<double> prefix;
  if (exact_prefix) {
    prefix.resize(n + 1);
    prefix[0] = 0;
    for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + sorted[i];
  }
  for (int it = 0; it < 8; ++it) {
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(count.begin(), count.end(), 0);
    // Levels ascend, scores ascend: the nearest level only moves up, so each
    // level's scores are one run.
    int g = 0;
    if (exact_prefix) {
      for (int64_t i = 0;;) {
        int64_t j = n;  // the first score of [i, n) nearer to level g + 1
        if (g + 1 < levels) {
          int64_t lo = i, hi = n;
          while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (nearer_next(sorted[mid], g)) {
              hi = mid;
            } else {
              lo = mid + 1;
            }
          }
          j = lo;
        }
        sum[g] = prefix[j] - prefix[i];
        count[g] = j - i;
        if (j == n) break;
        while (g + 1 < levels && nearer_next(sorted[j], g)) ++g;
        i = j;
      }
    } else {  // the walk, summed in a register
      double run = 0;
      int64_t run_n = 0;
      for (int64_t i = 0; i < n; ++i) {
        while (g + 1 < levels && nearer_next(sorted[i], g)) {
          sum[g] = run;
          count[g] = run_n;
          run = 0;
          run_n = 0;
          ++g;
        }
        run += sorted[i];
        ++run_n;
      }
      sum[g] = run;
      count[g] = run_n;
    }
    for (int k = 0; k < levels; ++k) {
      if (count[k] > 0) level[k] = sum[k] / static_cast<double>(count[k]);
    }
    std::sort(level.begin(), level.end());
  }
  for (int k = 0; k < levels; ++k) book[k] = FloatToHalf(static_cast<float>(level[k]));
  std::sort(book, book + levels, [](uint16_t a, uint16_t b) { return Half(a) < Half(b); });
}

void PutOptions(ByteWriter* w, const CsaOptions& o) {
  w->Put<int32_t>(o.m);
  w->Put<int32_t>(o.C);
  w->Put<double>(o.alpha);
  w->Put<int64_t>(o.fixed_L);
  w->Put<int64_t>(o.query_cap);
  w->Put<int32_t>(o.kmeans_iters);
  w->Put<uint8_t>(o.center_keys ? 1 : 0);
  w->Put<uint64_t>(o.seed);
  w->Put<double>(o.rho);
  w->Put<int32_t>(o.recent);
  w->Put<int32_t>(o.sinks);
  w->Put<int32_t>(o.tau);
  w->Put<double>(o.backoff_cos);
  w->Put<uint8_t>(o.norm_weights ? 1 : 0);
  w->Put<uint8_t>(o.proj_weights ? 1 : 0);
  w->Put<uint8_t>(o.impute_min ? 1 : 0);
  w->Put<uint8_t>(o.impute_tail_mean ? 1 : 0);
  w->Put<int32_t>(o.period);
  w->Put<uint8_t>(o.compact ? 1 : 0);
}

bool GetOptions(ByteReader* r, CsaOptions* o) {
  uint8_t norm = 0, proj = 0, compact = 0, center = 0, impute = 0, tail = 0;
  bool ok = r->Get(&o->m) && r->Get(&o->C) && r->Get(&o->alpha) && r->Get(&o->fixed_L) &&
            r->Get(&o->query_cap) && r->Get(&o->kmeans_iters) && r->Get(&center) &&
            r->Get(&o->seed) && r->Get(&o->rho) && r->Get(&o->recent) && r->Get(&o->sinks) &&
            r->Get(&o->tau) && r->Get(&o->backoff_cos) && r->Get(&norm) && r->Get(&proj) &&
            r->Get(&impute) && r->Get(&tail) && r->Get(&o->period) && r->Get(&compact);
  o->norm_weights = norm != 0;
  o->proj_weights = proj != 0;
  o->center_keys = center != 0;
  o->impute_min = impute != 0;
  o->impute_tail_mean = tail != 0;
  o->compact = compact != 0;
  return ok;
}

Status Loss(const std::string& what) { return DataLossError("csa artifact: " + what); }

// Plain lists: every list's ids, then every list's scores, raw; each list
// is then put worst first.
Status ReadPlainLists(ByteReader* r, int64_t n_lists, int64_t L, int64_t n_tokens, int32_t* ids,
                      uint16_t* scores) {
  const uint64_t entries = static_cast<uint64_t>(n_lists) * L;
  if (!r->GetArray(ids, entries) || !r->GetArray(scores, entries)) {
    return Loss("truncated lists");
  }
  for (uint64_t e = 0; e < entries; ++e) {
    if (ids[e] < 0 || ids[e] >= n_tokens) return Loss("list id out of range");
  }
  std::vector<uint64_t> sort_a, sort_b;  // SortWorstFirst scratch
  for (int64_t l = 0; l < n_lists; ++l) {
    SortWorstFirst(ids + l * L, scores + l * L, L, /*ids_ascending=*/false, &sort_a, &sort_b);
  }
  return Status::OK();
}

// One list's L ids as varint deltas: strictly ascending, each < n_tokens.
Status ReadVarintIds(ByteReader* r, int64_t L, int64_t n_tokens, int32_t* ids) {
  int64_t prev = -1;
  for (int64_t e = 0; e < L; ++e) {
    uint64_t delta = 0;
    // Unsigned compare: a huge delta must not wrap prev (signed overflow).
    if (!r->GetVarint(&delta) || delta == 0 ||
        delta > static_cast<uint64_t>(n_tokens - 1 - prev)) {
      return Loss("bad list ids");
    }
    prev += static_cast<int64_t>(delta);
    ids[e] = static_cast<int32_t>(prev);
  }
  return Status::OK();
}

// One list's L ids as a bitmap over the n_tokens tokens. *bitmap: scratch,
// sized on first use, after the bytes for it are known to be there (a
// corrupt n_tokens must not allocate).
Status ReadBitmapIds(ByteReader* r, int64_t L, int64_t n_tokens, std::vector<uint8_t>* bitmap,
                     int32_t* ids) {
  const size_t bitmap_bytes = static_cast<size_t>((n_tokens + 7) / 8);
  if (r->remaining() < bitmap_bytes) return Loss("truncated list bitmap");
  bitmap->resize(bitmap_bytes);
  if (!r->GetArray(bitmap->data(), bitmap->size())) return Loss("truncated list bitmap");
  int64_t e = 0;
  for (size_t byte = 0; byte < bitmap->size(); ++byte) {
    for (uint32_t v = (*bitmap)[byte]; v != 0; v &= v - 1) {
      const int64_t id = static_cast<int64_t>(byte) * 8 + __builtin_ctz(v);
      if (id >= n_tokens || e >= L) return Loss("bad list bitmap");
      ids[e++] = static_cast<int32_t>(id);
    }
  }
  if (e != L) return Loss("bad list bitmap");
  return Status::OK();
}

// One list's L ids Elias-Fano coded (EliasFanoShape): the k byte, the low
// bits, the upper bitmap. *buf: scratch.
Status ReadEliasFanoIds(ByteReader* r, int64_t L, int64_t n_tokens, std::vector<uint8_t>* buf,
                        int32_t* ids) {
  uint8_t k = 0;
  if (!r->Get(&k) || k > 31) return Loss("bad Elias-Fano low bits");
  const EliasFanoShape ef = EliasFanoFor(k, L, n_tokens);
  if (r->remaining() < ef.low_bytes + ef.upper_bytes) return Loss("truncated Elias-Fano ids");
  buf->resize(ef.low_bytes + ef.upper_bytes);
  if (!r->GetArray(buf->data(), buf->size())) return Loss("truncated Elias-Fano ids");
  const uint8_t* low = buf->data();
  const uint8_t* upper = low + ef.low_bytes;
  int64_t e = 0, prev = -1;
  for (uint64_t byte = 0; byte < ef.upper_bytes; ++byte) {
    for (uint32_t v = upper[byte]; v != 0; v &= v - 1) {
      const uint64_t bit = byte * 8 + static_cast<uint64_t>(__builtin_ctz(v));
      if (bit >= ef.upper_bits || e >= L) return Loss("bad Elias-Fano ids");
      // Entry e's k low bits start at bit e * k: up to 5 bytes.
      const uint64_t at = static_cast<uint64_t>(e) * k;
      uint64_t window = 0;
      const uint64_t first = at >> 3;
      if (first + 8 <= ef.low_bytes) {
        static_assert(std::endian::native == std::endian::little);
        std::memcpy(&window, low + first, 8);  // the bytes are little-endian
      } else {
        const uint64_t last = std::min<uint64_t>(first + 5, ef.low_bytes);
        for (uint64_t i = first; i < last; ++i) window |= uint64_t{low[i]} << (8 * (i - first));
      }
      const uint64_t lo = (window >> (at & 7)) & ((uint64_t{1} << k) - 1);
      const int64_t id = static_cast<int64_t>(((bit - static_cast<uint64_t>(e)) << k) | lo);
      if (id <= prev || id >= n_tokens) return Loss("bad Elias-Fano ids");
      ids[e++] = static_cast<int32_t>(id);
      prev = id;
    }
  }
  if (e != L) return Loss("bad Elias-Fano ids");
  return Status::OK();
}

// ReadCodedScores' buffers, reused from list to list.
struct CodedListScratch {
  CodedListScratch(int levels, int64_t L, uint8_t bits)
      : book(levels),
        packed((L * bits + 7) / 8),
        codes(static_cast<size_t>(L)),
        code_rank(levels),
        rank_start(levels + 1) {}
  std::vector<uint16_t> book;
  std::vector<uint8_t> packed;
  std::vector<uint8_t> codes;
  std::vector<int32_t> id_copy;
  std::vector<int> code_rank;
  std::vector<int64_t> rank_start;
  std::vector<uint8_t> id_bytes;  // ReadBitmapIds, ReadEliasFanoIds
};

// One list's codebook and packed 4-bit score codes; the list's ids (which
// arrive ascending) and scores are left worst first (SortWorstFirst's order)
// straight from the codes: a counting sort over the codebook values' ranks
// (equal values, +0 and -0 included, share a rank), each rank's entries by
// descending id.
Status ReadCodedScores(ByteReader* r, int64_t L, CodedListScratch* s, int32_t* ids,
                       uint16_t* sc) {
  const int levels = static_cast<int>(s->book.size());
  if (!r->GetArray(s->book.data(), s->book.size())) return Loss("truncated score codebook");
  for (uint16_t h : s->book) {
    if (!std::isfinite(Half(h))) return Loss("bad score codebook");
  }
  if (!r->GetArray(s->packed.data(), s->packed.size())) return Loss("truncated scores");
  for (int c = 0; c < levels; ++c) {
    int rank = 0;
    for (int o = 0; o < levels; ++o) rank += Half(s->book[o]) < Half(s->book[c]);
    s->code_rank[c] = rank;
  }
  std::fill(s->rank_start.begin(), s->rank_start.end(), 0);
  for (int64_t e = 0; e < L; ++e) {
    const int code = (s->packed[e >> 1] >> (4 * (e & 1))) & 0xf;
    if (code >= levels) return Loss("bad score code");
    s->codes[e] = static_cast<uint8_t>(code);
    ++s->rank_start[s->code_rank[code] + 1];
  }
  for (int k = 0; k < levels; ++k) s->rank_start[k + 1] += s->rank_start[k];
  s->id_copy.assign(ids, ids + L);
  for (int64_t e = L - 1; e >= 0; --e) {
    const int64_t at = s->rank_start[s->code_rank[s->codes[e]]]++;
    ids[at] = s->id_copy[e];
    sc[at] = s->book[s->codes[e]];
  }
  return Status::OK();
}

// Compact lists of version >= 2: per list an id coding byte and the ids
// (bitmap, varint deltas, or from version 3 Elias-Fano), then the scores
// (ReadCodedScores).
Status ReadCodedLists(ByteReader* r, uint32_t version, uint8_t bits, int64_t n_lists, int64_t L,
                      int64_t n_tokens, int32_t* all_ids, uint16_t* all_scores) {
  CodedListScratch scratch(CodebookLevels(bits, L), L, bits);
  for (int64_t l = 0; l < n_lists; ++l) {
    int32_t* ids = all_ids + l * L;
    uint8_t coding = 0;
    if (!r->Get(&coding)) return Loss("truncated lists");
    if (coding == kIdsBitmap) {
      RETURN_IF_ERROR(ReadBitmapIds(r, L, n_tokens, &scratch.id_bytes, ids));
    } else if (coding == kIdsVarint) {
      RETURN_IF_ERROR(ReadVarintIds(r, L, n_tokens, ids));
    } else if (coding == kIdsEliasFano && version >= 3) {
      RETURN_IF_ERROR(ReadEliasFanoIds(r, L, n_tokens, &scratch.id_bytes, ids));
    } else {
      return Loss("bad list id coding");
    }
    RETURN_IF_ERROR(ReadCodedScores(r, L, &scratch, ids, all_scores + l * L));
  }
  return Status::OK();
}

// Compact lists of version 1: per list a float score range, varint ids and
// 8-bit scores quantized over the range; each list is then put worst first.
Status ReadQuantizedLists(ByteReader* r, int64_t n_lists, int64_t L, int64_t n_tokens,
                          int32_t* ids, uint16_t* scores) {
  std::vector<uint64_t> sort_a, sort_b;  // SortWorstFirst scratch
  std::vector<uint8_t> q(L);
  for (int64_t l = 0; l < n_lists; ++l) {
    float lo = 0, hi = 0;
    if (!r->Get(&lo) || !r->Get(&hi) || !std::isfinite(lo) || !std::isfinite(hi) || hi < lo) {
      return Loss("bad list range");
    }
    RETURN_IF_ERROR(ReadVarintIds(r, L, n_tokens, ids + l * L));
    if (!r->GetArray(q.data(), L)) return Loss("truncated scores");
    const float step = hi > lo ? (hi - lo) / 255.0f : 0.0f;
    for (int64_t e = 0; e < L; ++e) scores[l * L + e] = FloatToHalf(lo + q[e] * step);
    SortWorstFirst(ids + l * L, scores + l * L, L, /*ids_ascending=*/true, &sort_a, &sort_b);
  }
  return Status::OK();
}

}  // namespace

void CsaSelector::PutSketch(ByteWriter* w) const {
  w->Put<double>(options_.rerank);
  if (!has_sketch()) {
    w->Put<uint8_t>(0);
    return;
  }
  w->Put<uint8_t>(kSketchBits);
  const Tables& t = *base_;
  w->PutArray(t.sketch.data(), t.sketch.size());
  w->PutArray(overlay_.sketch.data(), overlay_.sketch.size());
  w->PutArray(t.sketch_scale.data(), t.sketch_scale.size());
  w->PutArray(overlay_.sketch_scale.data(), overlay_.sketch_scale.size());
}

void CsaSelector::SerializePlain(std::string* out) const {
  out->clear();
  ByteWriter w(out);
  const Tables& t = *base_;
  w.PutHeader("CSAP", kPlainVersion);
  PutOptions(&w, options_);
  w.Put<int32_t>(d_);
  w.Put<int64_t>(n_tokens_);
  w.Put<int64_t>(n_built_);
  w.Put<int64_t>(L_);
  w.PutArray(t.centroids.data(), t.centroids.size());
  w.PutArray(t.key_mean.data(), t.key_mean.size());
  w.PutArray(t.tail_mean.data(), t.tail_mean.size());
  if (overlay_.lists.empty()) {
    w.PutArray(t.ids.data(), t.ids.size());
    w.PutArray(t.scores.data(), t.scores.size());
    PutSketch(&w);
    return;
  }
  std::vector<int32_t> ids(t.ids.size());
  std::vector<uint16_t> scores(t.scores.size()), list_sc;
  std::vector<int32_t> list_ids;
  for (int64_t l = 0; l < static_cast<int64_t>(options_.m) * options_.C; ++l) {
    MaterializeList(l, &list_ids, &list_sc);
    std::copy(list_ids.begin(), list_ids.end(), ids.begin() + l * L_);
    std::copy(list_sc.begin(), list_sc.end(), scores.begin() + l * L_);
  }
  w.PutArray(ids.data(), ids.size());
  w.PutArray(scores.data(), scores.size());
  PutSketch(&w);
}

void CsaSelector::SerializeCompact(std::string* out) const {
  out->clear();
  ByteWriter w(out);
  const Tables& t = *base_;
  w.PutHeader("CSAC", kCompactVersion);
  PutOptions(&w, options_);
  w.Put<int32_t>(d_);
  w.Put<int64_t>(n_tokens_);
  w.Put<int64_t>(n_built_);
  w.Put<int64_t>(L_);
  w.PutArray(t.centroids.data(), t.centroids.size());
  w.PutArray(t.key_mean.data(), t.key_mean.size());
  w.PutArray(t.tail_mean.data(), t.tail_mean.size());
  w.Put<uint8_t>(kCompactScoreBits);
  const int levels = CodebookLevels(kCompactScoreBits, L_);
  // Sorting by id and by score without comparison sorts (they were most of
  // a commit's CPU): ids are unique in [0, n_tokens), so a bitmap walk
  // orders them; fp16 scores sort by a two-pass radix on their bits.
  std::vector<std::pair<int32_t, uint16_t>> list(L_);
  std::vector<uint64_t> seen((n_tokens_ + 63) / 64);
  std::vector<uint16_t> score_of(static_cast<size_t>(n_tokens_));
  std::vector<uint16_t> keys(L_), keys_tmp(L_);
  std::vector<float> sorted(L_);
  std::vector<uint16_t> book(levels);
  std::vector<float> book_f(levels);
  std::vector<uint16_t> thresholds(levels);
  std::vector<uint8_t> bitmap((n_tokens_ + 7) / 8);
  const EliasFanoShape ef = BestEliasFano(L_, n_tokens_);
  std::vector<uint8_t> ef_buf(ef.low_bytes + ef.upper_bytes);
  std::vector<uint8_t> packed((L_ * kCompactScoreBits + 7) / 8);
  std::vector<int32_t> view_ids;
  std::vector<uint16_t> view_sc;
  const int64_t n_lists = static_cast<int64_t>(options_.m) * options_.C;
  for (int64_t l = 0; l < n_lists; ++l) {
    const int32_t* ids = nullptr;
    const uint16_t* sc = nullptr;
    ListView(l, &view_ids, &view_sc, &ids, &sc);
    for (int64_t e = 0; e < L_; ++e) {
      seen[static_cast<size_t>(ids[e]) >> 6] |= uint64_t{1} << (ids[e] & 63);
      score_of[static_cast<size_t>(ids[e])] = sc[e];
    }
    for (size_t wi = 0, e = 0; wi < seen.size(); ++wi) {
      for (uint64_t word = seen[wi]; word != 0; word &= word - 1) {
        const int32_t id = static_cast<int32_t>(wi * 64 + std::countr_zero(word));
        list[e++] = {id, score_of[static_cast<size_t>(id)]};
      }
      seen[wi] = 0;
    }
    // Ids: a bitmap over n_tokens, delta varints or Elias-Fano, whichever is
    // smallest (ties: bitmap, then varints).
    uint64_t varint_bytes = 0;
    for (int64_t e = 0, prev = -1; e < L_; prev = list[e].first, ++e) {
      varint_bytes += VarintSize(static_cast<uint64_t>(list[e].first - prev));
    }
    if (ef.bytes() < std::min<uint64_t>(bitmap.size(), varint_bytes)) {
      w.Put<uint8_t>(kIdsEliasFano);
      w.Put<uint8_t>(static_cast<uint8_t>(ef.k));
      std::fill(ef_buf.begin(), ef_buf.end(), 0);
      uint8_t* low = ef_buf.data();
      uint8_t* upper = low + ef.low_bytes;
      const uint64_t low_mask = (uint64_t{1} << ef.k) - 1;
      uint64_t acc = 0;  // low parts not yet written, < 8 + 31 bits
      int acc_bits = 0;
      size_t out = 0;
      for (int64_t e = 0; e < L_; ++e) {
        const uint32_t id = static_cast<uint32_t>(list[e].first);
        acc |= (id & low_mask) << acc_bits;
        for (acc_bits += ef.k; acc_bits >= 8; acc_bits -= 8, acc >>= 8) {
          low[out++] = static_cast<uint8_t>(acc);
        }
        const uint64_t u = (static_cast<uint64_t>(id) >> ef.k) + static_cast<uint64_t>(e);
        upper[u >> 3] |= static_cast<uint8_t>(1u << (u & 7));
      }
      if (acc_bits > 0) low[out] = static_cast<uint8_t>(acc);
      w.PutArray(ef_buf.data(), ef_buf.size());
    } else if (bitmap.size() < varint_bytes) {
      w.Put<uint8_t>(kIdsBitmap);
      std::fill(bitmap.begin(), bitmap.end(), 0);
      for (const auto& [id, h] : list) bitmap[id >> 3] |= static_cast<uint8_t>(1u << (id & 7));
      w.PutArray(bitmap.data(), bitmap.size());
    } else {
      w.Put<uint8_t>(kIdsVarint);
      int32_t prev = -1;
      for (const auto& [id, h] : list) {
        w.PutVarint(static_cast<uint64_t>(id - prev));  // >= 1: ids are unique
        prev = id;
      }
    }
    // Scores: a codebook of `levels` fp16 values and one code per entry.
    SortHalves(sc, L_, keys.data(), keys_tmp.data(), sorted.data());
    ScoreCodebook(sorted.data(), L_, levels, book.data());
    for (int i = 0; i < levels; ++i) book_f[i] = Half(book[i]);
    w.PutArray(book.data(), book.size());
    // NearestLevel is non-decreasing in the score, so over the ascending
    // scores each code is one run: its first score, found by binary search,
    // gives a threshold on the order-preserving 16-bit image (`keys`, from
    // SortHalves), and an entry's code is the number of thresholds at or
    // below its image.
    int n_thr = 0;
    int64_t lo = 0;
    for (int c = 1; c < levels; ++c) {
      int64_t a = lo, b = L_;  // the first sorted score whose code is >= c
      while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        if (NearestLevel(book_f.data(), levels, sorted[mid]) >= static_cast<uint32_t>(c)) {
          b = mid;
        } else {
          a = mid + 1;
        }
      }
      if (a == L_) break;
      thresholds[n_thr++] = keys[a];
      lo = a;
    }
    std::fill(packed.begin(), packed.end(), 0);
    for (int64_t e = 0; e < L_; ++e) {
      const uint16_t key = HalfOrderKey(list[e].second);
      uint32_t code = 0;
      for (int t = 0; t < n_thr; ++t) code += key >= thresholds[t] ? 1 : 0;
      packed[e >> 1] |= static_cast<uint8_t>(code << (4 * (e & 1)));
    }
    w.PutArray(packed.data(), packed.size());
  }
  PutSketch(&w);
}

Status CsaSelector::Serialize(std::string* out) const {
  if (options_.compact) {
    SerializeCompact(out);
  } else {
    SerializePlain(out);
  }
  return Status::OK();
}

Status CsaSelector::ReadKeySketch(ByteReader* r, bool compact, uint32_t version, Tables* t) {
  options_.rerank = 0;
  if (version >= (compact ? kCompactSketchVersion : kPlainSketchVersion)) {
    uint8_t bits = 0;
    if (!r->Get(&options_.rerank) || !r->Get(&bits)) return Loss("truncated key sketch header");
    if (!CheckOptions(options_).ok()) return Loss("bad rerank");
    if (bits != 0 && bits != kSketchBits) return Loss("bad key sketch bits");
    if ((bits != 0) != (options_.rerank > 0)) return Loss("rerank and key sketch disagree");
    if (bits != 0) {
      const uint64_t cells = static_cast<uint64_t>(n_tokens_) * d_;
      if (cells + 2 * static_cast<uint64_t>(n_tokens_) > r->remaining()) {
        return Loss("truncated key sketch");
      }
      t->sketch.resize(cells);
      t->sketch_scale.resize(static_cast<size_t>(n_tokens_));
      if (!r->GetArray(t->sketch.data(), cells) ||
          !r->GetArray(t->sketch_scale.data(), t->sketch_scale.size())) {
        return Loss("truncated key sketch");
      }
      for (int8_t c : t->sketch) {
        if (c < -kSketchMaxCode) return Loss("bad key sketch code");
      }
      for (uint16_t h : t->sketch_scale) {
        const float v = Half(h);
        if (!std::isfinite(v) || v < 0) return Loss("bad key sketch scale");
      }
    }
  }
  return Status::OK();
}

Status CsaSelector::ReadTables(std::string_view bytes) {
  ByteReader r(bytes);
  auto t = std::make_shared<Tables>();
  const bool compact = bytes.substr(0, 4) == "CSAC";
  uint32_t version = 0;
  RETURN_IF_ERROR(r.GetHeader(compact ? "CSAC" : "CSAP", compact ? kCompactVersion : kPlainVersion,
                              &version, "csa"));
  if (!GetOptions(&r, &options_)) return Loss("truncated options");
  if (!CheckOptions(options_).ok() || options_.m < 1) return Loss("corrupt options");
  if (!r.Get(&d_) || !r.Get(&n_tokens_) || !r.Get(&n_built_) || !r.Get(&L_)) {
    return Loss("truncated header");
  }
  if (d_ < 1 || d_ > 4096 || d_ % options_.m != 0 || n_tokens_ < 1 || n_tokens_ > INT32_MAX ||
      n_built_ < 1 || n_built_ > n_tokens_ || L_ < 1 || L_ > n_built_ || options_.C > n_built_) {
    return Loss("corrupt shape fields");
  }
  const int64_t n_lists = static_cast<int64_t>(options_.m) * options_.C;
  const size_t n_cent = static_cast<size_t>(options_.C) * d_;
  if (n_cent * sizeof(float) > r.remaining()) return Loss("truncated centroids");
  t->centroids.resize(n_cent);
  if (!r.GetArray(t->centroids.data(), n_cent)) return Loss("truncated centroids");
  t->key_mean.resize(d_);
  if (!r.GetArray(t->key_mean.data(), d_) || HasNonFinite(t->key_mean.data(), d_) ||
      HasNonFinite(t->centroids.data(), n_cent)) {
    return Loss("bad centroids or key mean");
  }
  t->tail_mean.resize(static_cast<size_t>(options_.m) * options_.C);
  if (!r.GetArray(t->tail_mean.data(), t->tail_mean.size()) ||
      HasNonFinite(t->tail_mean.data(), t->tail_mean.size())) {
    return Loss("bad list tail means");
  }
  const uint64_t entries = static_cast<uint64_t>(n_lists) * L_;
  uint8_t bits = 0;
  if (compact && version >= 2) {
    if (!r.Get(&bits) || bits != kCompactScoreBits) return Loss("bad score bits");
    // >= 1 coding byte, the codebook and the packed codes per list.
    const uint64_t min_list = 1 + 2 * CodebookLevels(bits, L_) + (L_ * bits + 7) / 8;
    if (static_cast<uint64_t>(n_lists) * min_list > r.remaining()) return Loss("truncated lists");
  } else if (entries > r.remaining()) {
    return Loss("truncated lists");  // >= 1 byte per entry
  }
  t->ids.resize(entries);
  t->scores.resize(entries);
  if (!compact) {
    RETURN_IF_ERROR(ReadPlainLists(&r, n_lists, L_, n_tokens_, t->ids.data(), t->scores.data()));
  } else if (version >= 2) {
    RETURN_IF_ERROR(ReadCodedLists(&r, version, bits, n_lists, L_, n_tokens_, t->ids.data(),
                                   t->scores.data()));
  } else {
    RETURN_IF_ERROR(
        ReadQuantizedLists(&r, n_lists, L_, n_tokens_, t->ids.data(), t->scores.data()));
  }
  RETURN_IF_ERROR(ReadKeySketch(&r, compact, version, t.get()));
  if (r.remaining() != 0) return Loss("trailing bytes");
  n_base_ = n_tokens_;
  base_ = std::move(t);
  return Status::OK();
}

StatusOr<std::unique_ptr<CsaSelector>> CsaSelector::Load(std::string_view bytes) {
  std::unique_ptr<CsaSelector> s(new CsaSelector());
  RETURN_IF_ERROR(s->ReadTables(bytes));
  return s;
}

std::unique_ptr<Selector> CsaSelector::Clone() const {
  return std::unique_ptr<Selector>(new CsaSelector(*this));
}

uint64_t CsaSelector::MemoryBytes() const {
  return TableBytes() + SessionBytes();
}

uint64_t CsaSelector::TableBytes() const {
  const Tables& t = *base_;
  return (t.centroids.size() + t.key_mean.size() + t.tail_mean.size()) * sizeof(float) +
         t.ids.size() * sizeof(int32_t) + t.scores.size() * sizeof(uint16_t) + t.sketch.size() +
         t.sketch_scale.size() * sizeof(uint16_t);
}

uint64_t CsaSelector::SessionBytes() const {
  uint64_t bytes = sizeof(*this) + overlay_.lists.capacity() * sizeof(ListOverlay);
  for (const auto& o : overlay_.lists) bytes += o.live.capacity() * sizeof(Entry);
  for (const auto& h : last_per_head_) bytes += h.capacity() * sizeof(int32_t);
  bytes += overlay_.sketch.capacity() + overlay_.sketch_scale.capacity() * sizeof(uint16_t);
  for (const auto& v : views_) {
    bytes += v.second.first.capacity() * sizeof(int32_t) +
             v.second.second.capacity() * sizeof(uint16_t);
  }
  return bytes;
}

double CsaSelector::PlainBytesPerToken() const {
  return static_cast<double>(base_->ids.size() * kEntryBytes +
                             base_->centroids.size() * sizeof(float) + base_->sketch.size() +
                             base_->sketch_scale.size() * sizeof(uint16_t)) /
         static_cast<double>(n_tokens_);
}

double CsaSelector::CompactBytesPerToken() const {
  std::string bytes;
  SerializeCompact(&bytes);
  return static_cast<double>(bytes.size()) / static_cast<double>(n_tokens_);
}

}  // namespace ctxcache::index
