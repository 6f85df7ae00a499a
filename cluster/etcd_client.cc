#include "cluster/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>

#include "etcd/etcdserver/api/v3election/v3electionpb/v3election.grpc.pb.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace ctxcache::cluster {

namespace {

bool ValidClusterName(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

Status FromGrpc(const grpc::Status& s, const char* what) {
  std::string msg = std::string("etcd ").append(what).append(": ").append(s.error_message());
  switch (s.error_code()) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return DeadlineExceededError(msg);
    case grpc::StatusCode::NOT_FOUND:
      return NotFoundError(msg);
    case grpc::StatusCode::INVALID_ARGUMENT:
      return InvalidArgumentError(msg);
    case grpc::StatusCode::FAILED_PRECONDITION:
      return FailedPreconditionError(msg);
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
      return PermissionDeniedError(msg);
    default:
      return UnavailableError(msg);
  }
}

// The end of the key range holding every key with `prefix` (etcd's
// range_end convention: the prefix with its last byte incremented).
std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto c = static_cast<unsigned char>(end.back());
    if (c < 0xff) {
      end.back() = static_cast<char>(c + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // whole keyspace
}

}  // namespace

StatusOr<ClusterUri> ParseClusterUri(const std::string& uri, const char* flag) {
  const std::string scheme = "etcd://";
  auto bad = [&](const std::string& why) {
    return InvalidArgumentError(std::string(flag).append(" '").append(uri).append("': ").append(
        why + " (expected etcd://host:port[,host:port...]/<cluster-name>)"));
  };
  if (uri.rfind(scheme, 0) != 0) return bad("does not start with etcd://");
  std::string rest = uri.substr(scheme.size());
  auto slash = rest.find('/');
  if (slash == std::string::npos) return bad("no /<cluster-name>");
  ClusterUri out;
  out.cluster = rest.substr(slash + 1);
  if (!ValidClusterName(out.cluster)) return bad("cluster name must be 1-128 of [A-Za-z0-9._-]");
  std::string hosts = rest.substr(0, slash);
  size_t start = 0;
  while (start <= hosts.size()) {
    auto comma = hosts.find(',', start);
    std::string h =
        hosts.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    auto colon = h.rfind(':');
    if (h.empty() || colon == std::string::npos || colon == 0 || colon + 1 == h.size()) {
      return bad("endpoint '" + h + "' is not host:port");
    }
    out.endpoints.push_back(h);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

struct EtcdClient::Impl {
  struct Endpoint {
    std::string addr;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<v3electionpb::Election::Stub> election;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  };
  Options options;
  std::vector<Endpoint> endpoints;
  std::atomic<size_t> current{0};

  void Deadline(grpc::ClientContext* ctx, int64_t ms) const {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  }

  // One unary RPC through Call(): each attempt gets a fresh context with a
  // deadline of `ms`. rpc(endpoint, context) makes the call.
  template <typename Rpc>
  grpc::Status Unary(int64_t ms, Rpc&& rpc) {
    return Call([&](Endpoint& e) {
      grpc::ClientContext ctx;
      Deadline(&ctx, ms);
      return rpc(e, &ctx);
    });
  }

  // Runs `call` against the current endpoint, moving to the next one on
  // UNAVAILABLE (at most once per endpoint).
  grpc::Status Call(const std::function<grpc::Status(Endpoint&)>& call) {
    grpc::Status s;
    for (size_t attempt = 0; attempt < endpoints.size(); ++attempt) {
      size_t i = current.load() % endpoints.size();
      s = call(endpoints[i]);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return s;
      current.compare_exchange_strong(i, i + 1);
    }
    return s;
  }
};

StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(const Options& options) {
  if (options.endpoints.empty()) return InvalidArgumentError("etcd: no endpoints");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  for (const auto& addr : options.endpoints) {
    Impl::Endpoint e;
    e.addr = addr;
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // Detects a dead etcd under a long-lived watch stream. etcd's default
    // --grpc-keepalive-min-time is 5 s: pinging more often gets the
    // connection closed (too_many_pings).
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10'000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5'000);
    e.channel = grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
    e.kv = etcdserverpb::KV::NewStub(e.channel);
    e.lease = etcdserverpb::Lease::NewStub(e.channel);
    e.election = v3electionpb::Election::NewStub(e.channel);
    e.watch = etcdserverpb::Watch::NewStub(e.channel);
    impl->endpoints.push_back(std::move(e));
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(impl)));
}

EtcdClient::EtcdClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdClient::~EtcdClient() = default;

StatusOr<int64_t> EtcdClient::GrantLease(int64_t ttl_s) {
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(ttl_s);
  etcdserverpb::LeaseGrantResponse resp;
  grpc::Status s =
      impl_->Unary(impl_->options.rpc_timeout_ms, [&](Impl::Endpoint& e, grpc::ClientContext* ctx) {
        return e.lease->LeaseGrant(ctx, req, &resp);
      });
  if (!s.ok()) return FromGrpc(s, "LeaseGrant");
  if (!resp.error().empty()) return UnavailableError("etcd LeaseGrant: " + resp.error());
  return resp.id();
}

StatusOr<int64_t> EtcdClient::KeepAlive(int64_t lease) {
  etcdserverpb::LeaseKeepAliveResponse resp;
  grpc::Status s = impl_->Call([&](Impl::Endpoint& e) {
    grpc::ClientContext ctx;
    impl_->Deadline(&ctx, impl_->options.rpc_timeout_ms);
    auto stream = e.lease->LeaseKeepAlive(&ctx);
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    if (!stream->Write(req) || !stream->Read(&resp)) {
      stream->WritesDone();
      grpc::Status f = stream->Finish();
      return f.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "keep-alive stream closed") : f;
    }
    stream->WritesDone();
    ctx.TryCancel();
    stream->Finish().IgnoreError();
    return grpc::Status::OK;
  });
  if (!s.ok()) return FromGrpc(s, "LeaseKeepAlive");
  if (resp.ttl() <= 0) return NotFoundError("etcd lease " + std::to_string(lease) + " expired");
  return resp.ttl();
}

Status EtcdClient::RevokeLease(int64_t lease) {
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease);
  etcdserverpb::LeaseRevokeResponse resp;
  grpc::Status s =
      impl_->Unary(impl_->options.rpc_timeout_ms, [&](Impl::Endpoint& e, grpc::ClientContext* ctx) {
        return e.lease->LeaseRevoke(ctx, req, &resp);
      });
  return s.ok() ? Status::OK() : FromGrpc(s, "LeaseRevoke");
}

Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  etcdserverpb::PutRequest req;
  req.set_key(key);
  req.set_value(value);
  req.set_lease(lease);
  etcdserverpb::PutResponse resp;
  grpc::Status s = impl_->Unary(
      impl_->options.rpc_timeout_ms,
      [&](Impl::Endpoint& e, grpc::ClientContext* ctx) { return e.kv->Put(ctx, req, &resp); });
  return s.ok() ? Status::OK() : FromGrpc(s, "Put");
}

StatusOr<bool> EtcdClient::PutIfAbsent(const std::string& key, const std::string& value,
                                       int64_t lease) {
  etcdserverpb::TxnRequest req;
  auto* cmp = req.add_compare();
  cmp->set_key(key);
  cmp->set_target(etcdserverpb::Compare::CREATE);
  cmp->set_result(etcdserverpb::Compare::EQUAL);
  cmp->set_create_revision(0);
  auto* put = req.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  etcdserverpb::TxnResponse resp;
  grpc::Status s = impl_->Unary(
      impl_->options.rpc_timeout_ms,
      [&](Impl::Endpoint& e, grpc::ClientContext* ctx) { return e.kv->Txn(ctx, req, &resp); });
  if (!s.ok()) return FromGrpc(s, "Txn");
  return resp.succeeded();
}

StatusOr<EtcdKeyValue> EtcdClient::Get(const std::string& key) {
  etcdserverpb::RangeRequest req;
  req.set_key(key);
  etcdserverpb::RangeResponse resp;
  grpc::Status s = impl_->Unary(
      impl_->options.rpc_timeout_ms,
      [&](Impl::Endpoint& e, grpc::ClientContext* ctx) { return e.kv->Range(ctx, req, &resp); });
  if (!s.ok()) return FromGrpc(s, "Range");
  if (resp.kvs_size() == 0) return NotFoundError("etcd: no key " + key);
  const auto& kv = resp.kvs(0);
  return EtcdKeyValue{kv.key(), kv.value(), kv.lease(), kv.mod_revision()};
}

StatusOr<std::vector<EtcdKeyValue>> EtcdClient::GetPrefix(const std::string& prefix,
                                                          int64_t* revision) {
  etcdserverpb::RangeRequest req;
  req.set_key(prefix);
  req.set_range_end(PrefixEnd(prefix));
  etcdserverpb::RangeResponse resp;
  grpc::Status s = impl_->Unary(
      impl_->options.rpc_timeout_ms,
      [&](Impl::Endpoint& e, grpc::ClientContext* ctx) { return e.kv->Range(ctx, req, &resp); });
  if (!s.ok()) return FromGrpc(s, "Range");
  if (revision) *revision = resp.header().revision();
  std::vector<EtcdKeyValue> out;
  out.reserve(resp.kvs_size());
  for (const auto& kv : resp.kvs()) {
    out.push_back({kv.key(), kv.value(), kv.lease(), kv.mod_revision()});
  }
  return out;
}

Status EtcdClient::Delete(const std::string& key) {
  etcdserverpb::DeleteRangeRequest req;
  req.set_key(key);
  etcdserverpb::DeleteRangeResponse resp;
  grpc::Status s =
      impl_->Unary(impl_->options.rpc_timeout_ms, [&](Impl::Endpoint& e, grpc::ClientContext* ctx) {
        return e.kv->DeleteRange(ctx, req, &resp);
      });
  return s.ok() ? Status::OK() : FromGrpc(s, "DeleteRange");
}

Status EtcdClient::DeletePrefix(const std::string& prefix) {
  etcdserverpb::DeleteRangeRequest req;
  req.set_key(prefix);
  req.set_range_end(PrefixEnd(prefix));
  etcdserverpb::DeleteRangeResponse resp;
  grpc::Status s =
      impl_->Unary(impl_->options.rpc_timeout_ms, [&](Impl::Endpoint& e, grpc::ClientContext* ctx) {
        return e.kv->DeleteRange(ctx, req, &resp);
      });
  return s.ok() ? Status::OK() : FromGrpc(s, "DeleteRange");
}

void EtcdWatchCanceller::Cancel() {
  std::lock_guard lock(mu_);
  cancelled_ = true;
  if (cancel_) cancel_();
}

bool EtcdWatchCanceller::cancelled() const {
  std::lock_guard lock(mu_);
  return cancelled_;
}

Status EtcdClient::Watch(const std::string& prefix, int64_t start_revision,
                         EtcdWatchCanceller* canceller,
                         const std::function<void(const EtcdWatchBatch&)>& on_batch) {
  size_t i = impl_->current.load() % impl_->endpoints.size();
  Impl::Endpoint& e = impl_->endpoints[i];
  grpc::ClientContext ctx;
  {
    std::lock_guard lock(canceller->mu_);
    if (canceller->cancelled_) return Status::OK();
    canceller->cancel_ = [&ctx] { ctx.TryCancel(); };
  }
  auto stream = e.watch->Watch(&ctx);
  etcdserverpb::WatchRequest req;
  auto* create = req.mutable_create_request();
  create->set_key(prefix);
  create->set_range_end(PrefixEnd(prefix));
  create->set_start_revision(start_revision);
  Status result = UnavailableError("etcd Watch " + e.addr + ": stream closed");
  if (stream->Write(req)) {
    etcdserverpb::WatchResponse resp;
    while (stream->Read(&resp)) {
      if (resp.compact_revision() > 0) {
        result = OutOfRangeError("etcd Watch: revision " + std::to_string(start_revision) +
                                 " compacted (compact revision " +
                                 std::to_string(resp.compact_revision()) + ")");
        break;
      }
      if (resp.canceled()) {
        result = UnavailableError("etcd Watch canceled by the server: " + resp.cancel_reason());
        break;
      }
      EtcdWatchBatch batch;
      batch.revision = resp.header().revision();
      batch.created = resp.created();
      batch.events.reserve(resp.events_size());
      for (const auto& ev : resp.events()) {
        EtcdWatchBatch::Event out;
        out.deleted = ev.type() == mvccpb::Event::DELETE;
        out.kv = {ev.kv().key(), ev.kv().value(), ev.kv().lease(), ev.kv().mod_revision()};
        batch.events.push_back(std::move(out));
      }
      on_batch(batch);
    }
  }
  ctx.TryCancel();
  grpc::Status fin = stream->Finish();
  {
    std::lock_guard lock(canceller->mu_);
    canceller->cancel_ = nullptr;
    if (canceller->cancelled_) return Status::OK();
  }
  if (result.code() == StatusCode::kUnavailable) {
    if (!fin.ok() && fin.error_code() != grpc::StatusCode::CANCELLED) {
      result = FromGrpc(fin, "Watch");
    }
    impl_->current.compare_exchange_strong(i, i + 1);
  }
  return result;
}

StatusOr<std::string> EtcdClient::Campaign(const std::string& election, int64_t lease,
                                           const std::string& value, int64_t wait_ms) {
  v3electionpb::CampaignRequest req;
  req.set_name(election);
  req.set_lease(lease);
  req.set_value(value);
  v3electionpb::CampaignResponse resp;
  grpc::Status s = impl_->Unary(wait_ms, [&](Impl::Endpoint& e, grpc::ClientContext* ctx) {
    return e.election->Campaign(ctx, req, &resp);
  });
  if (!s.ok()) return FromGrpc(s, "Campaign");
  return resp.leader().key();
}

StatusOr<std::string> EtcdClient::Leader(const std::string& election) {
  v3electionpb::LeaderRequest req;
  req.set_name(election);
  v3electionpb::LeaderResponse resp;
  grpc::Status s =
      impl_->Unary(impl_->options.rpc_timeout_ms, [&](Impl::Endpoint& e, grpc::ClientContext* ctx) {
        return e.election->Leader(ctx, req, &resp);
      });
  if (!s.ok()) return FromGrpc(s, "Leader");
  if (!resp.has_kv()) return NotFoundError("etcd election " + election + ": no leader");
  return resp.kv().value();
}

}  // namespace ctxcache::cluster
