// Server-mode DecodeSession: ctxcached runs the session core and sends the
// selections, page tables and pages of each step.
#include <algorithm>
#include <string>
#include <vector>

#include "client/sdk/decode_stream.h"
#include "client/sdk/page_cache.h"
#include "client/sdk/sessions.h"

namespace ctxcache::client::internal {

namespace {

class ServerModeSession final : public DecodeSession {
 public:
  ServerModeSession(Client* client, v1::DecodeService::Stub* stub, SessionOptions options)
      : options_(std::move(options)), stream_(stub, client->options()) {}
  ~ServerModeSession() override { Close().IgnoreError(); }

  Status Open() {
    ASSIGN_OR_RETURN(info_, stream_.Open(options_, /*want_pages=*/true));
    n_tokens_ = static_cast<int64_t>(info_.n_tokens());
    return Status::OK();
  }
  const v1::ContextInfo& context() const override { return info_; }
  int64_t n_tokens() const override { return n_tokens_; }
  Status Step(uint32_t layer, const float* queries, SelectedKV* out) override;
  // Nothing to do: the server fetches the pages of a step itself.
  Status Prefetch(uint32_t layer, const float*) override {
    if (layer >= info_.model().n_layers()) {
      return InvalidArgumentError("layer " + std::to_string(layer) + " out of range");
    }
    return Status::OK();
  }
  Status Append(const float* k, const float* v, const float* q) override {
    RETURN_IF_ERROR(stream_.Append(k, v, q, info_.model()));
    n_tokens_++;
    return Status::OK();
  }
  Status Close() override { return stream_.Close(); }
  PageCacheStats page_cache_stats() const override { return PageCacheStats(); }

 private:
  SessionOptions options_;
  DecodeStream stream_;
  v1::ContextInfo info_;
  int64_t n_tokens_ = 0;
};

Status ServerModeSession::Step(uint32_t layer, const float* queries, SelectedKV* out) {
  const v1::ModelSpec& m = info_.model();
  if (layer >= m.n_layers()) {
    return InvalidArgumentError("layer " + std::to_string(layer) + " out of range");
  }
  const uint32_t n_q = m.n_q_heads(), n_kv = m.n_kv_heads(), d = m.head_dim();
  v1::DecodeRequest req;
  auto* t = req.mutable_step()->mutable_queries();
  req.mutable_step()->set_layer(layer);
  t->set_dtype(v1::DTYPE_F32);
  t->add_shape(n_q);
  t->add_shape(d);
  t->set_data(reinterpret_cast<const char*>(queries), size_t{n_q} * d * sizeof(float));
  std::vector<v1::PageBatch> batches;
  ASSIGN_OR_RETURN(v1::DecodeResponse resp, stream_.RoundTrip(&req, &batches));
  const v1::StepResult& step = resp.step();
  const uint32_t g = n_q / n_kv;
  *out = SelectedKV();
  out->heads.resize(n_kv);
  for (auto& h : out->heads) h.per_q_head.resize(g);
  bool has_mass = step.selections_size() == static_cast<int>(n_q);
  for (const auto& s : step.selections()) {
    if (s.q_head() >= n_q) return DataLossError("selection of q head out of range");
    auto& head = out->heads[s.q_head() / g];
    head.per_q_head[s.q_head() % g].assign(s.token_ids().begin(), s.token_ids().end());
    has_mass = has_mass && s.has_estimated_mass();
  }
  if (has_mass) {
    for (auto& h : out->heads) h.estimated_mass.assign(g, 0.0f);
    for (const auto& s : step.selections()) {
      out->heads[s.q_head() / g].estimated_mass[s.q_head() % g] = s.estimated_mass();
    }
  }
  for (const auto& pt : step.page_tables()) {
    if (pt.kv_head() >= n_kv) return DataLossError("page table of kv head out of range");
    auto& pages = out->heads[pt.kv_head()].pages;
    pages.insert(pages.end(), pt.blocks().begin(), pt.blocks().end());
  }
  std::vector<session::PageMap> pages(n_kv);
  for (const auto& b : batches) {
    for (const auto& p : b.pages()) {
      if (p.kv_head() >= n_kv) return DataLossError("page of kv head out of range");
      out->bytes_received += p.k().size() + p.v().size();
      out->pages++;
      ASSIGN_OR_RETURN(auto page, DecodePage(p, d));
      pages[p.kv_head()][p.block()] = std::move(page);
    }
  }
  const uint32_t block = info_.block_tokens();
  for (uint32_t h = 0; h < n_kv; ++h) {
    auto& head = out->heads[h];
    std::sort(head.pages.begin(), head.pages.end());
    head.pages.erase(std::unique(head.pages.begin(), head.pages.end()), head.pages.end());
    for (const auto& sel : head.per_q_head) head.ids.insert(head.ids.end(), sel.begin(), sel.end());
    std::sort(head.ids.begin(), head.ids.end());
    head.ids.erase(std::unique(head.ids.begin(), head.ids.end()), head.ids.end());
    for (int32_t id : head.ids) {
      if (!pages[h].count(static_cast<uint32_t>(id) / block)) {
        return DataLossError("server selected token " + std::to_string(id) +
                             " but sent no page for it");
      }
    }
    FillHead(pages[h], block, d, &head);
  }
  return Status::OK();
}

}  // namespace

StatusOr<std::unique_ptr<DecodeSession>> OpenServerModeSession(Client* client,
                                                               v1::DecodeService::Stub* stub,
                                                               const SessionOptions& options) {
  auto s = std::make_unique<ServerModeSession>(client, stub, options);
  RETURN_IF_ERROR(s->Open());
  return std::unique_ptr<DecodeSession>(std::move(s));
}

}  // namespace ctxcache::client::internal
