// Security and tenancy of the real ctxcached (issue "Security and
// multi-tenancy"), on loopback, with certificates made by openssl at test
// time (tests/security/make-certs.sh) and keys made by `ctxcache keys`:
// TLS and mTLS (bad CA, expired and unmapped certs), API keys (missing,
// wrong, revoked by a keys-file reload), every role x every RPC, cross-tenant
// access on every RPC, no existence leak, the ingest-poisoning attack, each
// quota, the loopback / --insecure rule, certificate reload, the audit log
// and the metrics bearer token.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ctxcache/v1/cluster_service.grpc.pb.h"
#include "ctxcache/v1/ctxcache_service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/service/http_get.h"
#include "tests/service/server_process.h"

namespace ctxcache {
namespace {

using testing::ReadFile;
using testing::ServerProcess;
using testing::TempDir;

std::string ModelDir() { return testing::SourceDir() + "/tests/data/golden"; }

std::vector<uint32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = rng() % 500 + 3;
  return t;
}

// Runs the CLI; returns its exit code, output in *out.
int Cli(const std::vector<std::string>& args, std::string* out) {
  std::vector<std::string> argv = {testing::BinDir() + "/ctxcache"};
  argv.insert(argv.end(), args.begin(), args.end());
  return ServerProcess::RunCapture(argv, out);
}

// `ctxcache keys create`: the key (first line of its stdout).
std::string CreateKey(const std::string& keys_file, const std::string& tenant,
                      const std::string& role) {
  std::vector<std::string> args = {"keys",   "create", "--keys-file", keys_file,
                                   "--role", role,     "--json"};
  if (!tenant.empty()) args.insert(args.end(), {"--tenant", tenant});
  std::string out;
  EXPECT_EQ(Cli(args, &out), 0) << out;
  auto pos = out.find("\"key\":\"");
  EXPECT_NE(pos, std::string::npos) << out;
  if (pos == std::string::npos) return "";
  auto end = out.find('"', pos + 7);
  return out.substr(pos + 7, end - pos - 7);
}

std::string KeyId(const std::string& key) { return key.substr(3, 12); }

struct Creds {
  std::string key;         // "" = none
  std::string ca;          // "" = plaintext
  std::string cert, pkey;  // client cert (mTLS)
};

// A caller: one channel with its credentials, raw stubs (every RPC,
// Ingest included).
class Caller {
 public:
  Caller(const std::string& address, Creds c) : creds_(std::move(c)) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    // Own subchannels: no connection backoff shared with other callers.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    std::shared_ptr<grpc::ChannelCredentials> cc = grpc::InsecureChannelCredentials();
    if (!creds_.ca.empty()) {
      grpc::SslCredentialsOptions o;
      o.pem_root_certs = ReadFile(creds_.ca);
      if (!creds_.cert.empty()) {
        o.pem_cert_chain = ReadFile(creds_.cert);
        o.pem_private_key = ReadFile(creds_.pkey);
      }
      cc = grpc::SslCredentials(o);
    }
    channel_ = grpc::CreateCustomChannel(address, cc, args);
    admin_ = v1::ContextAdmin::NewStub(channel_);
    decode_ = v1::DecodeService::NewStub(channel_);
  }

  void Prepare(grpc::ClientContext* ctx, double seconds = 30) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
    if (!creds_.key.empty()) ctx->AddMetadata("authorization", "Bearer " + creds_.key);
  }

  grpc::Status Build(const std::vector<uint32_t>& tokens, v1::BuildProgress* done,
                     const std::string& tenant = "",
                     const std::function<void(const v1::BuildProgress&)>& on = nullptr) {
    v1::BuildContextRequest req;
    for (uint32_t t : tokens) req.mutable_tokens()->add_ids(t);
    req.set_name("secret-name");
    req.set_tenant(tenant);
    grpc::ClientContext ctx;
    Prepare(&ctx, 120);
    auto reader = admin_->BuildContext(&ctx, req);
    v1::BuildProgress p;
    while (reader->Read(&p)) {
      if (on) on(p);
      if (done) *done = p;
    }
    return reader->Finish();
  }

  grpc::Status Extend(const std::string& parent, const std::vector<uint32_t>& extra,
                      v1::BuildProgress* done = nullptr) {
    v1::ExtendContextRequest req;
    req.set_parent_id(parent);
    for (uint32_t t : extra) req.mutable_tokens()->add_ids(t);
    grpc::ClientContext ctx;
    Prepare(&ctx, 120);
    auto reader = admin_->ExtendContext(&ctx, req);
    v1::BuildProgress p;
    while (reader->Read(&p)) {
      if (done) *done = p;
    }
    return reader->Finish();
  }

  // Ingests `tokens` with the given spec and K/V filled with `fill`
  // (no Q: the index methods that need none).
  grpc::Status Ingest(const v1::ModelSpec& spec, const std::vector<uint32_t>& tokens, float fill,
                      v1::ContextInfo* info, const std::string& tenant = "") {
    grpc::ClientContext ctx;
    Prepare(&ctx, 120);
    auto stream = admin_->IngestContext(&ctx, info);
    v1::IngestChunk h;
    *h.mutable_header()->mutable_model() = spec;
    for (uint32_t t : tokens) h.mutable_header()->mutable_tokens()->add_ids(t);
    h.mutable_header()->add_indexes()->set_method("streaming");
    h.mutable_header()->set_tenant(tenant);
    stream->Write(h);
    const uint32_t n = static_cast<uint32_t>(tokens.size());
    std::vector<float> kv(size_t{spec.n_kv_heads()} * n * spec.head_dim(), fill);
    for (uint32_t l = 0; l < spec.n_layers(); ++l) {
      v1::IngestChunk c;
      auto* ch = c.mutable_chunk();
      ch->set_layer(l);
      ch->set_token_start(0);
      ch->set_n_tokens(n);
      for (auto* t : {ch->mutable_k(), ch->mutable_v()}) {
        t->set_dtype(v1::DTYPE_F32);
        t->add_shape(spec.n_kv_heads());
        t->add_shape(n);
        t->add_shape(spec.head_dim());
        t->set_data(std::string(reinterpret_cast<const char*>(kv.data()), kv.size() * 4));
      }
      if (!stream->Write(c)) break;
    }
    v1::IngestChunk commit;
    commit.mutable_commit();
    stream->Write(commit);
    stream->WritesDone();
    return stream->Finish();
  }

  grpc::Status Get(const std::string& id, v1::ContextInfo* info = nullptr) {
    v1::GetContextRequest req;
    req.set_context_id(id);
    v1::ContextInfo tmp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return admin_->GetContext(&ctx, req, info ? info : &tmp);
  }
  grpc::Status List(v1::ListContextsResponse* resp, const std::string& tenant = "") {
    v1::ListContextsRequest req;
    req.set_tenant(tenant);
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return admin_->ListContexts(&ctx, req, resp);
  }
  grpc::Status Evict(const std::string& id) {
    v1::EvictContextRequest req;
    req.set_context_id(id);
    v1::EvictContextResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return admin_->EvictContext(&ctx, req, &resp);
  }
  grpc::Status Pin(const std::string& id, bool pin) {
    v1::PinContextRequest req;
    req.set_context_id(id);
    req.set_pinned(pin);
    v1::ContextInfo info;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return admin_->PinContext(&ctx, req, &info);
  }
  grpc::Status Share(const std::string& id, bool shared) {
    v1::ShareContextRequest req;
    req.set_context_id(id);
    req.set_shared(shared);
    v1::ContextInfo info;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return admin_->ShareContext(&ctx, req, &info);
  }
  grpc::Status ClusterLocalStatus() {
    v1::ClusterNodeStatus out;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return v1::ClusterService::NewStub(channel_)->LocalStatus(&ctx, v1::ClusterStatusRequest{},
                                                               &out);
  }
  grpc::Status Stats(v1::ServerStats* out = nullptr) {
    v1::ServerStats tmp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return admin_->GetStats(&ctx, v1::GetStatsRequest{}, out ? out : &tmp);
  }
  grpc::Status FetchIndex(const std::string& id) {
    v1::FetchIndexRequest req;
    req.set_context_id(id);
    req.add_layers(0);
    req.add_kv_heads(0);
    grpc::ClientContext ctx;
    Prepare(&ctx);
    auto reader = decode_->FetchIndex(&ctx, req);
    v1::IndexChunk c;
    while (reader->Read(&c)) {
    }
    return reader->Finish();
  }
  grpc::Status FetchPages(const std::string& id, std::vector<v1::Page>* pages = nullptr) {
    v1::FetchPagesRequest req;
    req.set_context_id(id);
    auto* t = req.add_tables();
    t->set_layer(0);
    t->set_kv_head(0);
    t->add_blocks(0);
    grpc::ClientContext ctx;
    Prepare(&ctx);
    auto reader = decode_->FetchPages(&ctx, req);
    v1::PageBatch b;
    while (reader->Read(&b)) {
      if (pages) pages->insert(pages->end(), b.pages().begin(), b.pages().end());
    }
    return reader->Finish();
  }
  // Opens a decode session; the status of the Open (a RequestError inside
  // the stream counts as its code), then closes it.
  grpc::Status OpenSession(const std::string& id, bool keep_open = false) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    Prepare(ctx.get());
    auto stream = decode_->Decode(ctx.get());
    v1::DecodeRequest req;
    req.set_request_id(1);
    req.mutable_open()->set_context_id(id);
    req.mutable_open()->set_method("streaming");
    v1::DecodeResponse resp;
    grpc::Status result = grpc::Status::OK;
    if (!stream->Write(req) || !stream->Read(&resp)) {
      return stream->Finish();
    }
    if (resp.has_error()) {
      result =
          grpc::Status(static_cast<grpc::StatusCode>(resp.error().code()), resp.error().message());
    }
    if (keep_open && result.ok()) {
      open_.push_back({std::move(ctx), std::move(stream)});
      return result;
    }
    stream->WritesDone();
    grpc::Status fin = stream->Finish();
    return result.ok() ? fin : result;
  }
  void CloseSessions() {
    for (auto& o : open_) {
      o.stream->WritesDone();
      o.stream->Finish();
    }
    open_.clear();
  }
  // Starts a watch; events go to *events until StopWatch. Returns the
  // call's error if it fails before the subscription is live.
  grpc::Status StartWatch(std::vector<v1::ContextEvent>* events, std::mutex* mu) {
    watch_ctx_ = std::make_unique<grpc::ClientContext>();
    Prepare(watch_ctx_.get(), 60);
    watch_reader_ = decode_->WatchContexts(watch_ctx_.get(), v1::WatchRequest{});
    v1::ContextEvent hello;
    if (!watch_reader_->Read(&hello)) {  // not live
      grpc::Status s = watch_reader_->Finish();
      watch_reader_.reset();
      return s.ok() ? grpc::Status(grpc::StatusCode::UNKNOWN, "watch ended") : s;
    }
    watch_thread_ = std::thread([this, events, mu] {
      v1::ContextEvent ev;
      while (watch_reader_->Read(&ev)) {
        std::lock_guard<std::mutex> l(*mu);
        events->push_back(ev);
      }
    });
    return grpc::Status::OK;
  }
  grpc::Status StopWatch() {
    watch_ctx_->TryCancel();
    return WaitWatch();
  }
  // Waits for the server to end the watch (or its 60 s deadline).
  grpc::Status WaitWatch() {
    watch_thread_.join();
    return watch_reader_->Finish();
  }
  v1::DecodeService::Stub* decode() { return decode_.get(); }
  ~Caller() { CloseSessions(); }

 private:
  struct Open {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream;
  };
  Creds creds_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ContextAdmin::Stub> admin_;
  std::unique_ptr<v1::DecodeService::Stub> decode_;
  std::vector<Open> open_;
  std::unique_ptr<grpc::ClientContext> watch_ctx_;
  std::unique_ptr<grpc::ClientReader<v1::ContextEvent>> watch_reader_;
  std::thread watch_thread_;
};

// Shared across the suite: the PKI (made once, ~1 s).
class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = new TempDir();
    std::string out;
    int rc = ServerProcess::RunCapture(
        {"/bin/bash", testing::SourceDir() + "/tests/security/make-certs.sh", pki_->path()}, &out);
    ASSERT_EQ(rc, 0) << out;
  }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }
  static std::string Pki(const std::string& f) { return pki_->path() + "/" + f; }

  void SetUp() override { keys_file_ = tmp_.path() + "/keys"; }

  // Starts ctxcached on the golden llama3 model with `extra` flags.
  void Start(std::vector<std::string> extra) {
    // The golden llama3 declares 256 positions; these tests use longer contexts.
    std::vector<std::string> args = {
        "--model-dir",       ModelDir(),  "--default-model",      "llama3",
        "--default-indexes", "streaming", "--max-context-tokens", "65536"};
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_TRUE(server_.Start(tmp_.path() + "/data", args)) << server_.log();
  }
  void StartTlsWithKeys(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--tls-cert",      Pki("server.pem"), "--tls-key",
                                     Pki("server.key"), "--keys-file",     keys_file_};
    args.insert(args.end(), extra.begin(), extra.end());
    Start(args);
  }
  Creds Tls(const std::string& key) { return Creds{key, Pki("ca.pem"), "", ""}; }

  static inline TempDir* pki_ = nullptr;
  TempDir tmp_;
  std::string keys_file_;
  ServerProcess server_;
};

// ---- transport --------------------------------------------------------------

TEST_F(SecurityTest, TlsServesKeyedCallsAndRejectsPlaintextAndBadCa) {
  const std::string admin = CreateKey(keys_file_, "", "operator");
  StartTlsWithKeys();
  Caller good(server_.address(), Tls(admin));
  EXPECT_TRUE(good.Stats().ok());
  // A plaintext client cannot talk to the TLS port.
  Caller plain(server_.address(), Creds{admin, "", "", ""});
  EXPECT_EQ(plain.Stats().error_code(), grpc::StatusCode::UNAVAILABLE);
  // A client that trusts another CA refuses the server's certificate.
  Caller bad_ca(server_.address(), Creds{admin, Pki("other-ca.pem"), "", ""});
  EXPECT_EQ(bad_ca.Stats().error_code(), grpc::StatusCode::UNAVAILABLE);
  // Health stays open (no key), over TLS.
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadFile(Pki("ca.pem"));
  auto ch = grpc::CreateChannel(server_.address(), grpc::SslCredentials(o));
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckResponse resp;
  EXPECT_TRUE(grpc::health::v1::Health::NewStub(ch)->Check(&ctx, {}, &resp).ok());
}

TEST_F(SecurityTest, MtlsRequiresAValidClientCertificateMappedToATenant) {
  std::string out;
  ASSERT_EQ(Cli({"keys", "map-cert", "--keys-file", keys_file_, "--cn", "worker-a", "--tenant",
                 "acme", "--role", "reader"},
                &out),
            0)
      << out;
  StartTlsWithKeys({"--tls-client-ca", Pki("ca.pem")});
  Caller mapped(server_.address(),
                Creds{"", Pki("ca.pem"), Pki("client-a.pem"), Pki("client-a.key")});
  v1::ListContextsResponse list;
  EXPECT_TRUE(mapped.List(&list).ok());
  // The subject maps to a reader: building is denied.
  EXPECT_EQ(mapped.Build(Tokens(16, 1), nullptr).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // A valid certificate whose subject is not mapped: UNAUTHENTICATED.
  Caller unmapped(server_.address(),
                  Creds{"", Pki("ca.pem"), Pki("client-unmapped.pem"), Pki("client-unmapped.key")});
  EXPECT_EQ(unmapped.List(&list).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // No certificate, an expired one, or one from another CA: no handshake.
  Caller none(server_.address(), Creds{"", Pki("ca.pem"), "", ""});
  EXPECT_EQ(none.List(&list).error_code(), grpc::StatusCode::UNAVAILABLE);
  Caller expired(server_.address(),
                 Creds{"", Pki("ca.pem"), Pki("expired.pem"), Pki("expired.key")});
  EXPECT_EQ(expired.List(&list).error_code(), grpc::StatusCode::UNAVAILABLE);
  Caller other(server_.address(),
               Creds{"", Pki("ca.pem"), Pki("other-client.pem"), Pki("other-client.key")});
  EXPECT_EQ(other.List(&list).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecurityTest, CertificateReloadsWithoutRestartOrDroppingSessions) {
  const std::string admin = CreateKey(keys_file_, "", "operator");
  const std::string cert = tmp_.path() + "/server.pem", key = tmp_.path() + "/server.key";
  std::filesystem::copy_file(Pki("server.pem"), cert);
  std::filesystem::copy_file(Pki("server.key"), key);
  Start({"--tls-cert", cert, "--tls-key", key, "--keys-file", keys_file_, "--tls-refresh-s", "1"});
  const pid_t pid = server_.pid();
  Caller old_ca(server_.address(), Tls(admin));
  v1::BuildProgress done;
  ASSERT_TRUE(old_ca.Build(Tokens(32, 7), &done).ok());
  const std::string id = done.context().context_id();
  ASSERT_TRUE(old_ca.OpenSession(id, /*keep_open=*/true).ok());
  // Rotate to a certificate from another CA, then SIGHUP.
  std::filesystem::copy_file(Pki("server2.pem"), cert + ".new");
  std::filesystem::copy_file(Pki("server2.key"), key + ".new");
  std::filesystem::rename(key + ".new", key);
  std::filesystem::rename(cert + ".new", cert);
  kill(pid, SIGHUP);
  bool rotated = false;
  for (int i = 0; i < 100 && !rotated; ++i) {  // <= 10 s; the watcher polls every 1 s
    rotated = Caller(server_.address(), Creds{admin, Pki("other-ca.pem"), "", ""}).Stats().ok();
    if (!rotated) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(rotated) << server_.log();
  EXPECT_EQ(server_.pid(), pid);
  // The connection made before the rotation still works (its session too).
  EXPECT_TRUE(old_ca.Stats().ok());
  old_ca.CloseSessions();
}

TEST_F(SecurityTest, NonLoopbackListenNeedsTlsAndKeysOrInsecure) {
  ServerProcess p;
  const std::vector<std::string> base = {"--model-dir", ModelDir(),         "--listen",
                                         "0.0.0.0:0",   "--metrics-listen", ""};
  EXPECT_FALSE(p.Start(tmp_.path() + "/d1", base));
  EXPECT_NE(p.log().find("not a loopback address"), std::string::npos) << p.log();
  // TLS without keys is not enough either.
  std::vector<std::string> tls_only = base;
  tls_only.insert(tls_only.end(),
                  {"--tls-cert", Pki("server.pem"), "--tls-key", Pki("server.key")});
  ServerProcess p2;
  EXPECT_FALSE(p2.Start(tmp_.path() + "/d2", tls_only));
  // --insecure starts, with a warning.
  std::vector<std::string> insecure = base;
  insecure.push_back("--insecure");
  ServerProcess p3;
  ASSERT_TRUE(p3.Start(tmp_.path() + "/d3", insecure)) << p3.log();
  EXPECT_NE(p3.log().find("--insecure"), std::string::npos);
  // TLS and keys: starts, no warning.
  CreateKey(keys_file_, "", "operator");
  std::vector<std::string> secured = tls_only;
  secured.insert(secured.end(), {"--keys-file", keys_file_});
  ServerProcess p4;
  ASSERT_TRUE(p4.Start(tmp_.path() + "/d4", secured)) << p4.log();
  EXPECT_EQ(p4.log().find("--insecure"), std::string::npos);
}

// ---- keys and roles -----------------------------------------------------------

TEST_F(SecurityTest, MissingWrongAndRevokedKeysAreUnauthenticated) {
  const std::string reader = CreateKey(keys_file_, "acme", "reader");
  const std::string other = CreateKey(keys_file_, "acme", "reader");
  StartTlsWithKeys();
  v1::ListContextsResponse list;
  EXPECT_TRUE(Caller(server_.address(), Tls(reader)).List(&list).ok());
  EXPECT_EQ(Caller(server_.address(), Tls("")).List(&list).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  std::string wrong = reader;
  wrong.back() = wrong.back() == '0' ? '1' : '0';
  grpc::Status s = Caller(server_.address(), Tls(wrong)).List(&list);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(s.error_message().find(reader.substr(16)), std::string::npos);
  EXPECT_EQ(Caller(server_.address(), Tls("not-a-key")).List(&list).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // Revoke by rewriting the keys file: takes effect without a restart.
  std::string out;
  ASSERT_EQ(Cli({"keys", "revoke", "--keys-file", keys_file_, "--id", KeyId(reader)}, &out), 0)
      << out;
  bool revoked = false;
  for (int i = 0; i < 60 && !revoked; ++i) {  // re-read at most once a second
    revoked = Caller(server_.address(), Tls(reader)).List(&list).error_code() ==
              grpc::StatusCode::UNAUTHENTICATED;
    if (!revoked) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(revoked);
  EXPECT_TRUE(Caller(server_.address(), Tls(other)).List(&list).ok());
  // The keys file holds hashes only.
  const std::string file = ReadFile(keys_file_);
  EXPECT_EQ(file.find(other.substr(16)), std::string::npos);
  // The server log never shows a key.
  EXPECT_EQ(server_.log().find(other.substr(16)), std::string::npos);
}

// Regression: after a revocation, new calls with the key were refused, yet a
// Decode session opened before still served, and a Watch still delivered
// events (a new context's name among them). Both streams now end with
// UNAUTHENTICATED.
TEST_F(SecurityTest, RevokedKeyEndsOpenDecodeAndWatchStreams) {
  const std::string builder = CreateKey(keys_file_, "acme", "builder");
  const std::string reader = CreateKey(keys_file_, "acme", "reader");
  StartTlsWithKeys();
  Caller b(server_.address(), Tls(builder));
  v1::BuildProgress done;
  ASSERT_TRUE(b.Build(Tokens(48, 5), &done, "acme").ok()) << server_.log();
  const std::string id = done.context().context_id();

  Caller r(server_.address(), Tls(reader));
  grpc::ClientContext dctx;
  r.Prepare(&dctx, 120);
  auto session = r.decode()->Decode(&dctx);
  v1::DecodeRequest open;
  open.set_request_id(1);
  open.mutable_open()->set_context_id(id);
  open.mutable_open()->set_method("streaming");
  v1::DecodeResponse resp;
  ASSERT_TRUE(session->Write(open) && session->Read(&resp));
  ASSERT_TRUE(resp.has_opened()) << resp.DebugString();
  std::vector<v1::ContextEvent> events;
  std::mutex mu;
  ASSERT_TRUE(r.StartWatch(&events, &mu).ok());

  std::string out;
  ASSERT_EQ(Cli({"keys", "revoke", "--keys-file", keys_file_, "--id", KeyId(reader)}, &out), 0)
      << out;
  // The keys file is re-read at most once a second: poll with messages (an
  // Open on an open session is an in-stream error that keeps it open).
  bool ended = false;
  for (int i = 0; i < 60 && !ended; ++i) {
    open.set_request_id(2 + i);
    ended = !session->Write(open) || !session->Read(&resp);
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(ended);
  grpc::Status s = session->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("revoked"), std::string::npos) << s.error_message();
  // The watch ends too, and a context built afterwards never reaches it.
  ASSERT_TRUE(b.Build(Tokens(40, 6), &done, "acme").ok());
  grpc::Status w = r.WaitWatch();
  EXPECT_EQ(w.error_code(), grpc::StatusCode::UNAUTHENTICATED) << w.error_message();
  std::lock_guard<std::mutex> l(mu);
  for (const auto& ev : events) {
    EXPECT_NE(ev.context().context_id(), done.context().context_id()) << ev.DebugString();
  }
}

TEST_F(SecurityTest, EveryRoleTimesEveryRpc) {
  const std::map<std::string, std::string> keys = {
      {"operator", CreateKey(keys_file_, "", "operator")},
      {"admin", CreateKey(keys_file_, "acme", "admin")},
      {"builder", CreateKey(keys_file_, "acme", "builder")},
      {"reader", CreateKey(keys_file_, "acme", "reader")}};
  StartTlsWithKeys();
  // acme's context, built by acme's builder.
  Caller builder(server_.address(), Tls(keys.at("builder")));
  v1::BuildProgress done;
  ASSERT_TRUE(builder.Build(Tokens(48, 1), &done).ok()) << server_.log();
  const std::string id = done.context().context_id();
  v1::ContextInfo probe;
  {
    Caller op(server_.address(), Tls(keys.at("operator")));
    ASSERT_TRUE(op.Get(id, &probe).ok());
  }
  using Rpc = std::function<grpc::Status(Caller&, int)>;
  // A tenant's admin may call every ContextAdmin and DecodeService RPC; its
  // reach (its own tenant only) is NoTenantCanReach... and
  // ATenantAdminStaysInsideItsTenant's business.
  const std::set<std::string> builds = {"operator", "admin", "builder"};
  const std::set<std::string> reads = {"operator", "admin", "reader"};
  const std::vector<std::tuple<std::string, Rpc, std::set<std::string>>> table = {
      {"BuildContext",
       [](Caller& c, int i) { return c.Build(Tokens(24, 100 + i), nullptr, "acme"); },
       builds},
      {"IngestContext",
       [&](Caller& c, int i) {
         v1::ContextInfo info;
         v1::ModelSpec spec = probe.model();
         spec.set_name("external-model");
         return c.Ingest(spec, Tokens(16, 200 + i), 0.5f, &info, "acme");
       },
       builds},
      {"ExtendContext", [&](Caller& c, int i) { return c.Extend(id, Tokens(8, 300 + i)); },
       builds},
      {"GetContext", [&](Caller& c, int) { return c.Get(id); }, reads},
      {"ListContexts",
       [](Caller& c, int) {
         v1::ListContextsResponse r;
         return c.List(&r);
       },
       reads},
      {"PinContext", [&](Caller& c, int) { return c.Pin(id, true); }, builds},
      {"ShareContext", [&](Caller& c, int) { return c.Share(id, false); }, {"operator", "admin"}},
      {"GetStats", [](Caller& c, int) { return c.Stats(); },
       {"operator", "admin", "builder", "reader"}},
      {"Decode", [&](Caller& c, int) { return c.OpenSession(id); }, reads},
      {"FetchIndex", [&](Caller& c, int) { return c.FetchIndex(id); }, reads},
      {"FetchPages", [&](Caller& c, int) { return c.FetchPages(id); }, reads},
      {"WatchContexts",
       [](Caller& c, int) {
         std::vector<v1::ContextEvent> ev;
         std::mutex mu;
         if (grpc::Status started = c.StartWatch(&ev, &mu); !started.ok()) return started;
         grpc::Status s = c.StopWatch();
         return s.error_code() == grpc::StatusCode::CANCELLED ? grpc::Status::OK : s;
       },
       reads},
      {"EvictContext",
       [&](Caller& c, int i) {
         // A throwaway context of acme per role, built by the builder.
         v1::BuildProgress d;
         EXPECT_TRUE(builder.Build(Tokens(20, 400 + i), &d).ok());
         return c.Evict(d.context().context_id());
       },
       builds},
  };
  int i = 0;
  for (const auto& [rpc, call, allowed] : table) {
    for (const auto& [role, key] : keys) {
      Caller c(server_.address(), Tls(key));
      grpc::Status s = call(c, i++);
      if (allowed.count(role)) {
        EXPECT_TRUE(s.ok()) << rpc << " as " << role << ": " << s.error_message();
      } else {
        EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
            << rpc << " as " << role << ": " << s.error_message();
      }
    }
  }
  // The ClusterService is the operator's only: every other role, a tenant's
  // admin included, is refused before the call looks for a cluster (this
  // server has none: the operator gets FAILED_PRECONDITION saying so).
  for (const auto& [role, key] : keys) {
    grpc::Status s = Caller(server_.address(), Tls(key)).ClusterLocalStatus();
    if (role == "operator") {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
      EXPECT_NE(s.error_message().find("not in a cluster"), std::string::npos);
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << role << ": " << s.error_message();
      EXPECT_NE(s.error_message().find("'" + role + "'"), std::string::npos) << s.error_message();
    }
  }
}

// ---- tenancy ----------------------------------------------------------------------

TEST_F(SecurityTest, NoTenantCanReachAnotherTenantsContextThroughAnyRpc) {
  const std::string a_builder = CreateKey(keys_file_, "a", "builder");
  const std::string a_reader = CreateKey(keys_file_, "a", "reader");
  const std::string b_builder = CreateKey(keys_file_, "b", "builder");
  const std::string b_reader = CreateKey(keys_file_, "b", "reader");
  const std::string admin = CreateKey(keys_file_, "", "operator");
  StartTlsWithKeys();
  Caller ab(server_.address(), Tls(a_builder)), ar(server_.address(), Tls(a_reader));
  Caller bb(server_.address(), Tls(b_builder)), br(server_.address(), Tls(b_reader));
  // b watches from the start: it must see none of a's events.
  std::vector<v1::ContextEvent> b_events, a_events;
  std::mutex b_mu, a_mu;
  ASSERT_TRUE(br.StartWatch(&b_events, &b_mu).ok());
  ASSERT_TRUE(ar.StartWatch(&a_events, &a_mu).ok());

  const auto prompt = Tokens(64, 42);
  v1::BuildProgress a_done;
  ASSERT_TRUE(ab.Build(prompt, &a_done).ok());
  const std::string a_id = a_done.context().context_id();
  EXPECT_EQ(a_done.context().tenant(), "a");
  // A builder may not act for another tenant: not by building, not by
  // ingesting into it.
  EXPECT_EQ(bb.Build(prompt, nullptr, "a").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  {
    v1::ContextInfo ingested;
    v1::ModelSpec spec = a_done.context().model();
    spec.set_name("external-model");
    EXPECT_EQ(bb.Ingest(spec, prompt, 0.5f, &ingested, "a").error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }

  // Every RPC of b on a's context fails exactly like an unknown id.
  const std::string unknown = "0123456789abcdef0123456789abcdef";
  auto same_as_unknown = [&](const std::function<grpc::Status(const std::string&)>& f,
                             const char* what) {
    grpc::Status foreign = f(a_id), missing = f(unknown);
    EXPECT_EQ(foreign.error_code(), grpc::StatusCode::NOT_FOUND) << what;
    EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND) << what;
    std::string fm = foreign.error_message(), mm = missing.error_message();
    auto strip = [](std::string m, const std::string& id) {
      auto p = m.find(id);
      if (p != std::string::npos) m.replace(p, id.size(), "<id>");
      return m;
    };
    EXPECT_EQ(strip(fm, a_id), strip(mm, unknown)) << what;
  };
  same_as_unknown([&](const std::string& id) { return br.Get(id); }, "GetContext");
  same_as_unknown([&](const std::string& id) { return br.FetchIndex(id); }, "FetchIndex");
  same_as_unknown([&](const std::string& id) { return br.FetchPages(id); }, "FetchPages");
  same_as_unknown([&](const std::string& id) { return br.OpenSession(id); }, "Decode");
  same_as_unknown([&](const std::string& id) { return bb.Extend(id, Tokens(4, 1)); },
                  "ExtendContext");
  same_as_unknown([&](const std::string& id) { return bb.Pin(id, true); }, "PinContext");
  same_as_unknown([&](const std::string& id) { return bb.Evict(id); }, "EvictContext");
  v1::ListContextsResponse list;
  ASSERT_TRUE(br.List(&list).ok());
  EXPECT_EQ(list.contexts_size(), 0);
  EXPECT_EQ(br.List(&list, "a").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  v1::ServerStats bstats;
  ASSERT_TRUE(br.Stats(&bstats).ok());
  EXPECT_EQ(bstats.n_contexts(), 0u);
  EXPECT_EQ(bstats.stored_bytes(), 0u);

  // No existence leak: b building the same prompt gets its own id and its
  // own prefill (reused=false).
  v1::BuildProgress b_done;
  ASSERT_TRUE(bb.Build(prompt, &b_done).ok());
  EXPECT_NE(b_done.context().context_id(), a_id);
  EXPECT_FALSE(b_done.reused());
  v1::BuildProgress again;
  ASSERT_TRUE(bb.Build(prompt, &again).ok());
  EXPECT_TRUE(again.reused());  // within a tenant, content addressing still dedups

  // a's context survives all of b's attempts; a still reads it.
  EXPECT_TRUE(ar.Get(a_id).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(br.StopWatch().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(ar.StopWatch().error_code(), grpc::StatusCode::CANCELLED);
  {
    std::lock_guard<std::mutex> l(b_mu);
    for (const auto& ev : b_events) EXPECT_EQ(ev.context().tenant(), "b");
    EXPECT_FALSE(b_events.empty());
  }
  {
    std::lock_guard<std::mutex> l(a_mu);
    for (const auto& ev : a_events) EXPECT_EQ(ev.context().tenant(), "a");
    EXPECT_FALSE(a_events.empty());
  }

  // The operator shares a's context: b may read it, but not evict or pin it.
  Caller ad(server_.address(), Tls(admin));
  ASSERT_TRUE(ad.Share(a_id, true).ok());
  EXPECT_TRUE(br.Get(a_id).ok());
  EXPECT_TRUE(br.OpenSession(a_id).ok());
  EXPECT_TRUE(br.FetchPages(a_id).ok());
  ASSERT_TRUE(br.List(&list).ok());
  EXPECT_EQ(list.contexts_size(), 2);  // b's own and the shared one
  EXPECT_EQ(bb.Evict(a_id).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(bb.Pin(a_id, true).error_code(), grpc::StatusCode::NOT_FOUND);
  // b may extend a shared context: the child is b's.
  v1::BuildProgress child;
  ASSERT_TRUE(bb.Extend(a_id, Tokens(8, 5), &child).ok());
  EXPECT_EQ(child.context().tenant(), "b");
  ASSERT_TRUE(ad.Share(a_id, false).ok());
  EXPECT_EQ(br.Get(a_id).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Regression: an admin key was a server-wide superuser, so tenant a's admin
// listed, read, pinned, extended and evicted tenant b's contexts. An admin
// is now scoped to its tenant exactly as a builder or reader is (another
// tenant's context is NOT_FOUND, as an unknown id; naming another tenant is
// PERMISSION_DENIED); only the operator role reaches every tenant.
TEST_F(SecurityTest, ATenantAdminStaysInsideItsTenant) {
  const std::string a_admin = CreateKey(keys_file_, "a", "admin");
  const std::string b_builder = CreateKey(keys_file_, "b", "builder");
  const std::string op_key = CreateKey(keys_file_, "", "operator");
  StartTlsWithKeys();
  Caller aa(server_.address(), Tls(a_admin)), bb(server_.address(), Tls(b_builder));
  Caller op(server_.address(), Tls(op_key));
  std::vector<v1::ContextEvent> a_events;
  std::mutex a_mu;
  ASSERT_TRUE(aa.StartWatch(&a_events, &a_mu).ok());

  v1::BuildProgress a_done, b_done;
  ASSERT_TRUE(aa.Build(Tokens(48, 11), &a_done).ok()) << server_.log();
  EXPECT_EQ(a_done.context().tenant(), "a");
  ASSERT_TRUE(bb.Build(Tokens(48, 12), &b_done).ok());
  const std::string a_id = a_done.context().context_id();
  const std::string b_id = b_done.context().context_id();

  // Every RPC of a's admin on b's context fails exactly like an unknown id.
  const std::string unknown = "0123456789abcdef0123456789abcdef";
  auto same_as_unknown = [&](const std::function<grpc::Status(const std::string&)>& f,
                             const char* what) {
    grpc::Status foreign = f(b_id), missing = f(unknown);
    EXPECT_EQ(foreign.error_code(), grpc::StatusCode::NOT_FOUND)
        << what << ": " << foreign.error_message();
    EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND) << what;
    std::string fm = foreign.error_message(), mm = missing.error_message();
    if (auto p = fm.find(b_id); p != std::string::npos) fm.replace(p, b_id.size(), "<id>");
    if (auto p = mm.find(unknown); p != std::string::npos) mm.replace(p, unknown.size(), "<id>");
    EXPECT_EQ(fm, mm) << what;
  };
  same_as_unknown([&](const std::string& id) { return aa.Get(id); }, "GetContext");
  same_as_unknown([&](const std::string& id) { return aa.FetchIndex(id); }, "FetchIndex");
  same_as_unknown([&](const std::string& id) { return aa.FetchPages(id); }, "FetchPages");
  same_as_unknown([&](const std::string& id) { return aa.OpenSession(id); }, "Decode");
  same_as_unknown([&](const std::string& id) { return aa.Extend(id, Tokens(4, 1)); },
                  "ExtendContext");
  same_as_unknown([&](const std::string& id) { return aa.Pin(id, true); }, "PinContext");
  same_as_unknown([&](const std::string& id) { return aa.Share(id, true); }, "ShareContext");
  same_as_unknown([&](const std::string& id) { return aa.Evict(id); }, "EvictContext");
  // Listing: a's contexts only; naming b is refused, naming a is allowed.
  v1::ListContextsResponse list;
  ASSERT_TRUE(aa.List(&list).ok());
  ASSERT_EQ(list.contexts_size(), 1);
  EXPECT_EQ(list.contexts(0).context_id(), a_id);
  grpc::Status named = aa.List(&list, "b");
  EXPECT_EQ(named.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(named.error_message().find("operator"), std::string::npos) << named.error_message();
  list.Clear();
  ASSERT_TRUE(aa.List(&list, "a").ok());
  EXPECT_EQ(list.contexts_size(), 1);
  // No building or ingesting into b.
  EXPECT_EQ(aa.Build(Tokens(16, 13), nullptr, "b").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  {
    v1::ContextInfo ingested;
    v1::ModelSpec spec = a_done.context().model();
    spec.set_name("external-model");
    EXPECT_EQ(aa.Ingest(spec, Tokens(16, 14), 0.5f, &ingested, "b").error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // GetStats: a's numbers, not the server's.
  v1::ServerStats a_stats, all_stats;
  ASSERT_TRUE(aa.Stats(&a_stats).ok());
  EXPECT_EQ(a_stats.n_contexts(), 1u);
  EXPECT_EQ(a_stats.stored_bytes(), a_done.context().stored_bytes());
  ASSERT_TRUE(op.Stats(&all_stats).ok());
  EXPECT_EQ(all_stats.n_contexts(), 2u);
  // Watch: none of b's events.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(aa.StopWatch().error_code(), grpc::StatusCode::CANCELLED);
  {
    std::lock_guard<std::mutex> l(a_mu);
    EXPECT_FALSE(a_events.empty());
    for (const auto& ev : a_events) EXPECT_EQ(ev.context().tenant(), "a") << ev.DebugString();
  }
  // Within its tenant an admin does everything, ShareContext included.
  EXPECT_TRUE(aa.Pin(a_id, true).ok());
  EXPECT_TRUE(aa.Pin(a_id, false).ok());
  EXPECT_TRUE(aa.Share(a_id, true).ok());
  EXPECT_TRUE(aa.Share(a_id, false).ok());

  // The operator reaches b's context: read, list b, pin, extend (the child
  // stays b's), evict.
  v1::ContextInfo info;
  ASSERT_TRUE(op.Get(b_id, &info).ok());
  EXPECT_EQ(info.tenant(), "b");
  list.Clear();
  ASSERT_TRUE(op.List(&list, "b").ok());
  ASSERT_EQ(list.contexts_size(), 1);
  EXPECT_EQ(list.contexts(0).context_id(), b_id);
  list.Clear();
  ASSERT_TRUE(op.List(&list).ok());
  EXPECT_EQ(list.contexts_size(), 2);
  EXPECT_TRUE(op.Pin(b_id, true).ok());
  EXPECT_TRUE(op.Pin(b_id, false).ok());
  EXPECT_TRUE(op.FetchPages(b_id).ok());
  v1::BuildProgress child;
  ASSERT_TRUE(op.Extend(b_id, Tokens(8, 15), &child).ok());
  EXPECT_EQ(child.context().tenant(), "b");
  EXPECT_TRUE(op.Evict(child.context().context_id()).ok());
  EXPECT_TRUE(op.Evict(b_id).ok());
  EXPECT_EQ(bb.Extend(b_id, Tokens(4, 16)).error_code(), grpc::StatusCode::NOT_FOUND);
}

// What an identity without a key gets: a verified client certificate gets
// the tenant and role of its `cert` line, an admin mapping staying inside
// its tenant and an operator mapping reaching every tenant; an unmapped one
// gets UNAUTHENTICATED (MtlsRequiresAValidClientCertificateMappedToATenant).
TEST_F(SecurityTest, ACertificateGetsItsMappedRoleAndTenantOnly) {
  const std::string b_builder = CreateKey(keys_file_, "b", "builder");
  std::string out;
  ASSERT_EQ(Cli({"keys", "map-cert", "--keys-file", keys_file_, "--cn", "worker-a", "--tenant",
                 "a", "--role", "admin"},
                &out),
            0)
      << out;
  StartTlsWithKeys({"--tls-client-ca", Pki("ca.pem")});
  const Creds cert{"", Pki("ca.pem"), Pki("client-a.pem"), Pki("client-a.key")};
  Caller bb(server_.address(), Creds{b_builder, cert.ca, cert.cert, cert.pkey});
  v1::BuildProgress b_done, a_done;
  ASSERT_TRUE(bb.Build(Tokens(40, 21), &b_done).ok()) << server_.log();
  const std::string b_id = b_done.context().context_id();
  {
    Caller wa(server_.address(), cert);
    ASSERT_TRUE(wa.Build(Tokens(40, 22), &a_done).ok());
    EXPECT_EQ(a_done.context().tenant(), "a");
    EXPECT_EQ(wa.Get(b_id).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(wa.Evict(b_id).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(wa.ClusterLocalStatus().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  // Remapped as an operator (no tenant): the same certificate reaches b.
  ASSERT_EQ(Cli({"keys", "map-cert", "--keys-file", keys_file_, "--cn", "worker-a", "--role",
                 "operator"},
                &out),
            0)
      << out;
  bool reaches = false;
  for (int i = 0; i < 60 && !reaches; ++i) {  // the keys file is re-read at most once a second
    reaches = Caller(server_.address(), cert).Get(b_id).ok();
    if (!reaches) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(reaches);
}

// Keys files and their roles at start-up: a bad role and a server-wide
// admin of an old file stop ctxcached with the line, the field and the way
// out; a cluster key of another role than operator is refused too.
TEST_F(SecurityTest, KeysFileRolesAreCheckedAtStartup) {
  const std::string salt(32, 'a'), sha(64, 'b');
  auto start_with = [&](const std::string& keys_text, std::vector<std::string> extra,
                        const std::string& dir) {
    {
      std::ofstream f(keys_file_);
      f << keys_text;
    }
    ServerProcess p;
    std::vector<std::string> args = {"--model-dir", ModelDir(), "--keys-file", keys_file_};
    args.insert(args.end(), extra.begin(), extra.end());
    EXPECT_FALSE(p.Start(tmp_.path() + "/" + dir, args)) << "started with:\n" << keys_text;
    return p.log();
  };
  std::string log = start_with(
      "key 0123456789ab tenant=acme role=superuser salt=" + salt + " sha256=" + sha + "\n", {},
      "bad-role");
  EXPECT_NE(log.find("keys file line 1: role: expected reader, builder, admin or operator, got "
                     "'superuser'"),
            std::string::npos)
      << log;
  log = start_with("# written before operators existed\nkey 0123456789ab tenant=- role=admin "
                   "salt=" + salt + " sha256=" + sha + "\n",
                   {}, "old-admin");
  EXPECT_NE(log.find("keys file line 2: tenant '-': role admin is scoped to one tenant"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("role operator"), std::string::npos) << log;
  // The CLI refuses to write such a key in the first place.
  std::string out;
  std::filesystem::remove(keys_file_);
  EXPECT_NE(Cli({"keys", "create", "--keys-file", keys_file_, "--role", "admin"}, &out), 0);
  EXPECT_NE(out.find("--tenant: role admin is scoped to one tenant"), std::string::npos) << out;
  EXPECT_NE(Cli({"keys", "create", "--keys-file", keys_file_, "--tenant", "a", "--role", "root"},
                &out),
            0);
  EXPECT_NE(out.find("role: expected reader, builder, admin or operator, got 'root'"),
            std::string::npos)
      << out;
  // A tenant admin as the cluster key: nodes would fail to replicate.
  const std::string admin = CreateKey(keys_file_, "ops", "admin");
  const std::string cluster_key = tmp_.path() + "/cluster.key";
  {
    std::ofstream f(cluster_key);
    f << admin << "\n";
  }
  ServerProcess p;
  EXPECT_FALSE(p.Start(tmp_.path() + "/cluster-admin",
                       {"--model-dir", ModelDir(), "--keys-file", keys_file_, "--cluster",
                        "etcd://127.0.0.1:1/c", "--advertise-addr", "127.0.0.1:1",
                        "--cluster-key-file", cluster_key}));
  EXPECT_NE(p.log().find("--cluster-key-file: key " + KeyId(admin) + " has role admin"),
            std::string::npos)
      << p.log();
}

// The ingest-poisoning attack, in the default (no-auth) mode where it was
// possible: fake KV ingested under the hosted model's spec and fingerprint
// with the victim's tokens must never be served to the victim's build.
TEST_F(SecurityTest, IngestedKvNeverPoisonsABuild) {
  Start({});
  Caller anyone(server_.address(), Creds{});
  v1::BuildProgress probe;
  ASSERT_TRUE(anyone.Build(Tokens(16, 9), &probe).ok());
  const v1::ModelSpec hosted = probe.context().model();
  const auto victim_prompt = Tokens(64, 77);
  // Same-shape attack: fake KV of 0.25 everywhere.
  v1::ContextInfo fake;
  ASSERT_TRUE(anyone.Ingest(hosted, victim_prompt, 0.25f, &fake).ok()) << server_.log();
  EXPECT_EQ(fake.provenance(), v1::PROVENANCE_INGESTED);
  // Wrong-shape ingests under the hosted model's name are rejected.
  for (uint32_t bad_dim : {16u, 128u}) {
    v1::ModelSpec wrong = hosted;
    wrong.set_head_dim(bad_dim);
    v1::ContextInfo info;
    grpc::Status s = anyone.Ingest(wrong, victim_prompt, 0.25f, &info);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad_dim;
    EXPECT_NE(s.error_message().find("head_dim"), std::string::npos) << s.error_message();
  }
  v1::ModelSpec wrong_fp = hosted;
  wrong_fp.set_fingerprint("not-the-weights");
  v1::ContextInfo info;
  EXPECT_EQ(anyone.Ingest(wrong_fp, victim_prompt, 0.25f, &info).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // The victim's build computes its own KV.
  v1::BuildProgress victim;
  ASSERT_TRUE(anyone.Build(victim_prompt, &victim).ok());
  EXPECT_FALSE(victim.reused());
  EXPECT_NE(victim.context().context_id(), fake.context_id());
  EXPECT_EQ(victim.context().provenance(), v1::PROVENANCE_BUILT);
  std::vector<v1::Page> fake_pages, real_pages;
  ASSERT_TRUE(anyone.FetchPages(fake.context_id(), &fake_pages).ok());
  ASSERT_TRUE(anyone.FetchPages(victim.context().context_id(), &real_pages).ok());
  ASSERT_EQ(fake_pages.size(), 1u);
  ASSERT_EQ(real_pages.size(), 1u);
  EXPECT_NE(fake_pages[0].k(), real_pages[0].k());
  // And a second build of it reuses the server-built one, not the ingest.
  v1::BuildProgress again;
  ASSERT_TRUE(anyone.Build(victim_prompt, &again).ok());
  EXPECT_TRUE(again.reused());
  EXPECT_EQ(again.context().context_id(), victim.context().context_id());
}

// ---- quotas -------------------------------------------------------------------------

TEST_F(SecurityTest, EachQuotaRefusesWithItsNameAndLeavesNothingHalfWritten) {
  const std::string tenants = tmp_.path() + "/tenants";
  {
    std::ofstream f(tenants);
    f << "[tenant.q]\nmax_contexts = 2\nmax_sessions = 1\nbuild_tokens_per_minute = 1000\n"
         "max_builds = 1\n";
  }
  const std::string q = CreateKey(keys_file_, "q", "builder");
  const std::string qr = CreateKey(keys_file_, "q", "reader");
  const std::string admin = CreateKey(keys_file_, "", "operator");
  const std::string r = CreateKey(keys_file_, "r", "builder");
  const std::string rr = CreateKey(keys_file_, "r", "reader");
  StartTlsWithKeys({"--tenants-file", tenants});
  Caller qb(server_.address(), Tls(q)), qread(server_.address(), Tls(qr));
  Caller ad(server_.address(), Tls(admin));
  v1::BuildProgress d1, d2;
  ASSERT_TRUE(qb.Build(Tokens(40, 1), &d1).ok());
  ASSERT_TRUE(qb.Build(Tokens(40, 2), &d2).ok());
  v1::ServerStats before;
  ASSERT_TRUE(ad.Stats(&before).ok());
  grpc::Status s = qb.Build(Tokens(40, 3), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_contexts=2"), std::string::npos) << s.error_message();
  v1::ServerStats after;
  ASSERT_TRUE(ad.Stats(&after).ok());
  EXPECT_EQ(after.n_contexts(), before.n_contexts());
  EXPECT_EQ(after.stored_bytes(), before.stored_bytes());
  v1::ListContextsResponse list;
  ASSERT_TRUE(qread.List(&list).ok());
  EXPECT_EQ(list.contexts_size(), 2);

  // Sessions: one at a time.
  const std::string id = d1.context().context_id();
  ASSERT_TRUE(qread.OpenSession(id, /*keep_open=*/true).ok());
  s = qread.OpenSession(id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_sessions=1"), std::string::npos) << s.error_message();
  qread.CloseSessions();
  bool reopened = false;
  for (int i = 0; i < 50 && !reopened; ++i) {  // the server releases on stream end
    reopened = qread.OpenSession(id).ok();
    if (!reopened) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(reopened);

  // Stored bytes: measured from one context, set by a reload (SIGHUP).
  const uint64_t one = d1.context().stored_bytes();
  {
    std::ofstream f(tenants);
    f << "[tenant.q]\nmax_stored_bytes = " << (2 * one + one / 2) << "\n";
  }
  kill(server_.pid(), SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  s = qb.Build(Tokens(40, 4), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_stored_bytes="), std::string::npos) << s.error_message();
  ASSERT_TRUE(ad.Stats(&after).ok());
  EXPECT_EQ(after.n_contexts(), before.n_contexts());
  EXPECT_EQ(after.stored_bytes(), before.stored_bytes());
  // Ingests count too, and are refused at commit with nothing stored.
  v1::ContextInfo info;
  v1::ModelSpec spec = d1.context().model();
  spec.set_name("external-model");
  s = qb.Ingest(spec, Tokens(40, 5), 0.5f, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  ASSERT_TRUE(ad.Stats(&after).ok());
  EXPECT_EQ(after.stored_bytes(), before.stored_bytes());

  // Build tokens per minute and concurrent builds.
  {
    std::ofstream f(tenants);
    f << "[tenant.r]\nbuild_tokens_per_minute = 100\n";
  }
  kill(server_.pid(), SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  Caller rb(server_.address(), Tls(r));
  ASSERT_TRUE(rb.Build(Tokens(80, 6), nullptr).ok());
  s = rb.Build(Tokens(80, 7), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("build_tokens_per_minute=100"), std::string::npos)
      << s.error_message();
  {
    std::ofstream f(tenants);
    f << "[tenant.q]\nmax_builds = 1\n";
  }
  kill(server_.pid(), SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::atomic<bool> started{false};
  grpc::Status long_build;
  std::thread t([&] {
    Caller c(server_.address(), Tls(q));
    long_build = c.Build(Tokens(30000, 8), nullptr, "", [&](const v1::BuildProgress& p) {
      if (p.phase() == v1::BuildProgress::PREFILL) started = true;
    });
  });
  for (int i = 0; i < 600 && !started; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  s = qb.Build(Tokens(40, 9), nullptr);
  t.join();
  EXPECT_TRUE(long_build.ok()) << long_build.error_message();
  if (started) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(s.error_message().find("max_builds=1"), std::string::npos) << s.error_message();
  }
  // Streams and message rate.
  {
    std::ofstream f(tenants);
    f << "[tenant.r]\nmax_streams = 1\n";
  }
  kill(server_.pid(), SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  Caller rread(server_.address(), Tls(rr));
  std::vector<v1::ContextEvent> ev;
  std::mutex ev_mu;
  ASSERT_TRUE(rread.StartWatch(&ev, &ev_mu).ok());  // holds r's one stream
  s = Caller(server_.address(), Tls(rr)).FetchIndex(id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_streams=1"), std::string::npos) << s.error_message();
  rread.StopWatch();
  {
    std::ofstream f(tenants);
    f << "[tenant.r]\nmax_messages_per_second = 5\n";
  }
  kill(server_.pid(), SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int limited = 0;
  for (int i = 0; i < 20; ++i) {
    grpc::Status st = rread.Stats();
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++limited;
      EXPECT_NE(st.error_message().find("max_messages_per_second=5"), std::string::npos);
    }
  }
  EXPECT_GE(limited, 10);
  // Per-tenant metrics.
  std::string metrics = testing::HttpGet(server_.metrics_port(), "/metrics");
  EXPECT_NE(metrics.find("ctxcache_tenant_rejected_total{reason=\"max_contexts\",tenant=\"q\"}"),
            std::string::npos)
      << metrics.substr(0, 2000);
  EXPECT_NE(metrics.find("ctxcache_tenant_contexts{tenant=\"q\"}"), std::string::npos);
  EXPECT_NE(metrics.find("ctxcache_tenant_sessions{tenant=\"q\"}"), std::string::npos);
}

// ---- audit log and metrics token ------------------------------------------------------

TEST_F(SecurityTest, AuditLogNamesWhoAndWhatButNeverAKeyOrPrompt) {
  const std::string builder = CreateKey(keys_file_, "acme", "builder");
  const std::string reader = CreateKey(keys_file_, "acme", "reader");
  const std::string token_file = tmp_.path() + "/metrics-token";
  {
    std::ofstream f(token_file);
    f << "metrics-token-0123456789\n";
  }
  const std::string audit = tmp_.path() + "/audit.log";
  StartTlsWithKeys({"--audit-log", audit, "--metrics-token-file", token_file});
  Caller b(server_.address(), Tls(builder)), r(server_.address(), Tls(reader));
  v1::BuildContextRequest req;
  v1::BuildProgress done;
  ASSERT_TRUE(b.Build(Tokens(32, 3), &done).ok());
  EXPECT_EQ(r.Evict(done.context().context_id()).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  const std::string log = ReadFile(audit);
  EXPECT_NE(log.find("\"rpc\":\"BuildContext\",\"who\":\"" + KeyId(builder) +
                     "\",\"role\":\"builder\",\"tenant\":\"acme\",\"context\":\"" +
                     done.context().context_id()),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("\"rpc\":\"EvictContext\",\"who\":\"" + KeyId(reader)), std::string::npos)
      << log;
  EXPECT_NE(log.find("PERMISSION_DENIED"), std::string::npos) << log;
  for (const auto& k : {builder, reader}) {
    EXPECT_EQ(log.find(k.substr(16)), std::string::npos);
    EXPECT_EQ(server_.log().find(k.substr(16)), std::string::npos);
  }
  // Metrics: 401 without the bearer token.
  EXPECT_NE(testing::HttpGet(server_.metrics_port(), "/metrics").find("401"), std::string::npos);
  EXPECT_NE(testing::HttpGet(server_.metrics_port(), "/metrics",
                             "Authorization: Bearer metrics-token-0123456789")
                .find("ctxcache_build_info"),
            std::string::npos);
}

// ---- hostile clients -------------------------------------------------------------

long RssKiB(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return -1;
}

// Clients that open streams asking for ~GBs of pages and never read must
// not pin server memory without bound: flow control stalls the server's
// writes, so each stream holds at most about one page batch (4 MiB) plus
// its HTTP/2 window.
TEST_F(SecurityTest, StreamsThatNeverReadDoNotPinServerMemory) {
  Start({});
  Caller c(server_.address(), Creds{});
  v1::BuildProgress done;
  ASSERT_TRUE(c.Build(Tokens(2048, 5), &done).ok());
  const std::string id = done.context().context_id();
  const uint32_t blocks = static_cast<uint32_t>((2048 + 15) / 16);
  v1::FetchPagesRequest req;
  req.set_context_id(id);
  for (int rep = 0; rep < 64; ++rep) {
    for (uint32_t l = 0; l < done.context().model().n_layers(); ++l) {
      for (uint32_t h = 0; h < done.context().model().n_kv_heads(); ++h) {
        auto* t = req.add_tables();
        t->set_layer(l);
        t->set_kv_head(h);
        for (uint32_t b = 0; b < blocks; ++b) t->add_blocks(b);
      }
    }
  }
  // What one stream would be sent in full.
  const double per_stream_mib = 64.0 * done.context().raw_kv_bytes() / (1 << 20);
  const long before = RssKiB(server_.pid());
  constexpr int kStreams = 16;
  auto stub = v1::DecodeService::NewStub(
      grpc::CreateChannel(server_.address(), grpc::InsecureChannelCredentials()));
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::PageBatch>>> readers;
  for (int i = 0; i < kStreams; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    readers.push_back(stub->FetchPages(ctxs.back().get(), req));  // never Read
  }
  long peak = before;
  for (int i = 0; i < 30; ++i) {  // 3 s
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    peak = std::max(peak, RssKiB(server_.pid()));
  }
  const double grown_mib = (peak - before) / 1024.0;
  // Bound: 16 streams x (one 4 MiB batch being written + one being built +
  // window) with slack; far below the 16 x per_stream_mib they asked for.
  std::printf("server RSS grew %.1f MiB; the streams asked for %.0f MiB\n", grown_mib,
              kStreams * per_stream_mib);
  EXPECT_LT(grown_mib, 16 * 12.0) << "asked for " << kStreams * per_stream_mib << " MiB";
  EXPECT_GT(kStreams * per_stream_mib, 4 * 16 * 12.0);  // the request is really hostile
  for (auto& ctx : ctxs) ctx->TryCancel();
  for (auto& r : readers) r->Finish();
  // The server still serves.
  EXPECT_TRUE(c.Stats().ok());
}

}  // namespace
}  // namespace ctxcache
