// Test helper for python/tests/test_selection.py (not part of any build):
// runs the compiled C++ core of a build (<build>/lib/libctxcache_session.a
// and libctxcache_index.a) on inputs written by the test, so that the Python
// copy of the csa session pipeline (python/ctxcache/torch/selection.py) can be
// compared bit for bit, logit estimates included (the server does not send
// those).
//
//   csa_core_harness gemv IN OUT
//       IN: i32 count, then per case i32 rows, i32 cols, f32 a[rows][cols],
//       f32 x[cols]. OUT: f32 y[rows] per case: y = a * x with the Eigen
//       row-major GEMV kernel that csa.cc calls (the library's instance).
//   csa_core_harness step ARTIFACT QUERIES G key=value...
//       ARTIFACT: a csa artifact; QUERIES: f32 [cases][G][d]; key=value:
//       session params. Per case, with one selector (its schedule state
//       carries over like a session's): CsaSelector::Select with
//       SessionParams::TokenBudget, then SessionParams::PageStep. Prints
//       "case c", then per q head "sel h ids...", "log h <f32 bits hex>...",
//       "att h ids..." (after the page step), then per subgroup "tab s pages...".
#include <Eigen/Dense>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "index/csa.h"
#include "session/session_params.h"

// Use the library's GEMV instance (csa.cc's), not one compiled here.
namespace Eigen::internal {
extern template struct general_matrix_vector_product<
    long, float, const_blas_data_mapper<float, long, RowMajor>, RowMajor, false, float,
    const_blas_data_mapper<float, long, ColMajor>, false, 0>;
}  // namespace Eigen::internal

namespace {

using RowMatrixXf = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using namespace ctxcache;

bool ReadFile(const char* path, std::string* out) {
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) return false;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out->append(buf, n);
  std::fclose(f);
  return true;
}

int Gemv(const char* in_path, const char* out_path) {
  std::string in;
  if (!ReadFile(in_path, &in) || in.size() < 4) return 2;
  size_t pos = 0;
  auto take = [&](void* dst, size_t bytes) {
    std::memcpy(dst, in.data() + pos, bytes);
    pos += bytes;
  };
  int32_t count = 0;
  take(&count, 4);
  FILE* out = std::fopen(out_path, "wb");
  for (int32_t c = 0; c < count; ++c) {
    int32_t rows = 0, cols = 0;
    take(&rows, 4);
    take(&cols, 4);
    std::vector<float> a(static_cast<size_t>(rows) * cols), x(cols), y(rows);
    take(a.data(), a.size() * 4);
    take(x.data(), x.size() * 4);
    Eigen::Map<const RowMatrixXf> A(a.data(), rows, cols);
    Eigen::Map<const Eigen::VectorXf> xv(x.data(), cols);
    Eigen::Map<Eigen::VectorXf> yv(y.data(), rows);
    yv.noalias() = A * xv;
    std::fwrite(y.data(), 4, y.size(), out);
  }
  std::fclose(out);
  return 0;
}

void PrintIds(const char* tag, int h, const std::vector<int32_t>& ids) {
  std::printf("%s %d", tag, h);
  for (int32_t id : ids) std::printf(" %d", id);
  std::printf("\n");
}

int Step(int argc, char** argv) {
  std::string art, queries;
  if (!ReadFile(argv[2], &art) || !ReadFile(argv[3], &queries)) return 2;
  const int g = std::atoi(argv[4]);
  std::map<std::string, std::string> params;
  for (int i = 5; i < argc; ++i) {
    const std::string kv = argv[i];
    const size_t eq = kv.find('=');
    params[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  auto sel = index::CsaSelector::Load(art);
  if (!sel.ok()) {
    std::fprintf(stderr, "load: %s\n", std::string(sel.status().message()).c_str());
    return 1;
  }
  auto sp = session::SessionParams::Parse("csa", params, 16);
  if (!sp.ok()) {
    std::fprintf(stderr, "params: %s\n", std::string(sp.status().message()).c_str());
    return 1;
  }
  const int d = (*sel)->head_dim();
  const int64_t n = (*sel)->n_tokens();
  const size_t per_case = static_cast<size_t>(g) * d;
  for (size_t c = 0; c < queries.size() / (per_case * 4); ++c) {
    std::vector<float> q(per_case);
    std::memcpy(q.data(), queries.data() + c * per_case * 4, per_case * 4);
    index::SelectInput in;
    in.queries = q.data();
    in.n_queries = g;
    in.budget = sp->TokenBudget(n);
    index::Selection s;
    Status st = (*sel)->Select(in, &s, nullptr);
    if (!st.ok()) {
      std::fprintf(stderr, "select: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    std::printf("case %zu\n", c);
    for (int h = 0; h < g; ++h) {
      PrintIds("sel", h, s.per_head[h]);
      std::printf("log %d", h);
      if (h < static_cast<int>(s.per_head_logits.size())) {
        for (float x : s.per_head_logits[h]) {
          uint32_t u;
          std::memcpy(&u, &x, 4);
          std::printf(" %08x", u);
        }
      }
      std::printf("\n");
    }
    std::vector<index::PageTable> tables;
    st = sp->PageStep(n, &s.per_head, &tables, &s.per_head_logits);
    if (!st.ok()) {
      std::fprintf(stderr, "page step: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    for (int h = 0; h < g; ++h) PrintIds("att", h, s.per_head[h]);
    for (const auto& t : tables) PrintIds("tab", t.subgroup, t.pages);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[1]) == "gemv") return Gemv(argv[2], argv[3]);
  if (argc >= 5 && std::string(argv[1]) == "step") return Step(argc, argv);
  std::fprintf(stderr, "usage: %s gemv IN OUT | step ARTIFACT QUERIES G [key=value...]\n",
               argv[0]);
  return 2;
}
