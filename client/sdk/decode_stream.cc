#include "client/sdk/decode_stream.h"

#include "client/sdk/channel.h"
#include "client/sdk/retry.h"

namespace ctxcache::client::internal {

StatusOr<v1::ContextInfo> DecodeStream::Open(const SessionOptions& session, bool want_pages) {
  v1::DecodeRequest req;
  req.mutable_open()->set_context_id(session.context_id);
  req.mutable_open()->set_method(session.method);
  for (const auto& [k, v] : session.params) (*req.mutable_open()->mutable_params())[k] = v;
  req.mutable_open()->set_want_pages(want_pages);
  // Opening the stream is retried on UNAVAILABLE (e.g. a server restart).
  StatusOr<v1::DecodeResponse> resp = RetryUnavailable(options_, [&] {
    ctx_ = std::make_unique<grpc::ClientContext>();
    AddCallCredentials(options_, ctx_.get());
    stream_ = stub_->Decode(ctx_.get());
    closed_ = false;
    auto r = RoundTrip(&req, nullptr);
    if (!r.ok()) closed_ = true;
    return r;
  });
  if (!resp.ok()) return resp.status();
  return resp->opened().context();
}

StatusOr<v1::DecodeResponse> DecodeStream::RoundTrip(v1::DecodeRequest* req,
                                                     std::vector<v1::PageBatch>* batches) {
  if (closed_) return FailedPreconditionError("session is closed");
  req->set_request_id(next_id_++);
  if (!stream_->Write(*req)) {
    closed_ = true;
    grpc::Status s = stream_->Finish();
    return Status(s.ok() ? StatusCode::kUnavailable : static_cast<StatusCode>(s.error_code()),
                  "decode stream broke: " + s.error_message());
  }
  v1::DecodeResponse resp;
  if (!stream_->Read(&resp)) {
    closed_ = true;
    grpc::Status s = stream_->Finish();
    return Status(s.ok() ? StatusCode::kUnavailable : static_cast<StatusCode>(s.error_code()),
                  "decode stream ended: " + s.error_message());
  }
  if (resp.has_error()) {
    return Status(static_cast<StatusCode>(resp.error().code()), resp.error().message());
  }
  if (resp.has_step() && batches) {
    for (uint32_t i = 0; i < resp.step().n_page_batches(); ++i) {
      v1::DecodeResponse pr;
      if (!stream_->Read(&pr) || !pr.has_pages()) {
        closed_ = true;
        return UnavailableError("decode stream ended inside a page batch");
      }
      batches->push_back(std::move(*pr.mutable_pages()));
    }
  }
  return resp;
}

Status DecodeStream::Append(const float* k, const float* v, const float* q,
                            const v1::ModelSpec& model) {
  v1::DecodeRequest req;
  auto* a = req.mutable_append();
  const uint32_t layers = model.n_layers(), d = model.head_dim();
  auto set = [&](v1::Tensor* t, const float* data, uint32_t heads) {
    t->set_dtype(v1::DTYPE_F32);
    t->add_shape(layers);
    t->add_shape(heads);
    t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(data), size_t{layers} * heads * d * sizeof(float));
  };
  set(a->mutable_k(), k, model.n_kv_heads());
  set(a->mutable_v(), v, model.n_kv_heads());
  if (q) set(a->mutable_q(), q, model.n_q_heads());
  return RoundTrip(&req, nullptr).status();
}

Status DecodeStream::Close() {
  if (closed_) return Status::OK();
  v1::DecodeRequest req;
  req.mutable_close();
  auto resp = RoundTrip(&req, nullptr);
  closed_ = true;
  stream_->WritesDone();
  grpc::Status s = stream_->Finish();
  if (!resp.ok()) return resp.status();
  return FromGrpc(s, "Decode");
}

}  // namespace ctxcache::client::internal
