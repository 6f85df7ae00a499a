// Integration test of the real ctxcached binary on loopback: health,
// reflection, metrics endpoint, SIGTERM drain and the data-dir lock.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <set>
#include <string>

#include "ctxcache/v1/ctxcache_service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "tests/service/http_get.h"
#include "tests/service/server_process.h"

namespace ctxcache {
namespace {

using testing::HttpGet;
using testing::ServerProcess;
using testing::TempDir;

// The health status of `service` on `server` (a fresh channel, 5 s deadline).
grpc::health::v1::HealthCheckResponse::ServingStatus HealthOf(const ServerProcess& server,
                                                              const std::string& service) {
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.status();
}

class CtxcachedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = tmp_.path() + "/data";
    ASSERT_TRUE(server_.Start(data_dir_)) << server_.log();
    channel_ = grpc::CreateChannel(server_.address(), grpc::InsecureChannelCredentials());
  }

  grpc::health::v1::HealthCheckResponse::ServingStatus Health(const std::string& service) {
    return HealthOf(server_, service);
  }

  TempDir tmp_;
  std::string data_dir_;
  ServerProcess server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(CtxcachedTest, HealthIsServing) {
  EXPECT_EQ(Health(""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Health("ctxcache.v1.ContextAdmin"), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(CtxcachedTest, ReflectionListsServices) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("*");
  ASSERT_TRUE(stream->Write(req));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  std::set<std::string> names;
  for (const auto& s : resp.list_services_response().service()) names.insert(s.name());
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(names.count("ctxcache.v1.ContextAdmin")) << resp.DebugString();
  EXPECT_TRUE(names.count("ctxcache.v1.DecodeService")) << resp.DebugString();
  EXPECT_TRUE(names.count("grpc.health.v1.Health")) << resp.DebugString();
  EXPECT_TRUE(names.count("grpc.reflection.v1alpha.ServerReflection")) << resp.DebugString();
}

// Sends one reflection request and returns the server's one answer.
grpc::Status Reflect(const std::shared_ptr<grpc::Channel>& channel,
                     const grpc::reflection::v1alpha::ServerReflectionRequest& req,
                     grpc::reflection::v1alpha::ServerReflectionResponse* resp) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&ctx);
  stream->Write(req);
  stream->WritesDone();
  stream->Read(resp);
  return stream->Finish();
}

// docs/api.md's grpcurl example: reflection must describe the health service
// (gRPC's health service is upb-based and adds nothing to protobuf's pool).
TEST_F(CtxcachedTest, ReflectionDescribesHealthService) {
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_file_containing_symbol("grpc.health.v1.Health");
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  ASSERT_TRUE(Reflect(channel_, req, &resp).ok());
  ASSERT_FALSE(resp.has_error_response()) << resp.DebugString();
  ASSERT_GT(resp.file_descriptor_response().file_descriptor_proto_size(), 0);
  EXPECT_NE(resp.file_descriptor_response().file_descriptor_proto(0).find("HealthCheckRequest"),
            std::string::npos);
}

TEST_F(CtxcachedTest, StartupLogListsServicesServed) {
  std::string log = server_.log();
  EXPECT_NE(log.find("grpc.health.v1.Health"), std::string::npos) << log;
  EXPECT_NE(log.find("grpc.reflection.v1alpha.ServerReflection"), std::string::npos) << log;
}

// Regression: linking grpc++_reflection registered its plugin at static
// initialisation, so --reflection false still served reflection.
TEST(CtxcachedFlagsTest, ReflectionFalseTurnsReflectionOff) {
  TempDir tmp;
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data", {"--reflection", "false"})) << server.log();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("*");
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  grpc::Status s = Reflect(channel, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << resp.DebugString();
  std::string log = server.log();
  EXPECT_NE(log.find("grpc.health.v1.Health"), std::string::npos) << log;
  EXPECT_EQ(log.find("ServerReflection"), std::string::npos) << log;
}

TEST_F(CtxcachedTest, MetricsEndpointServesBuildInfo) {
  std::string resp = HttpGet(server_.metrics_port(), "/metrics");
  EXPECT_NE(resp.find("HTTP/1.1 200 OK"), std::string::npos) << resp;
  EXPECT_NE(resp.find("ctxcache_build_info{"), std::string::npos) << resp;
  EXPECT_NE(resp.find("ctxcache_uptime_seconds"), std::string::npos) << resp;
  EXPECT_NE(resp.find("ctxcache_storage_bytes{kind=\"pages\"}"), std::string::npos) << resp;
  EXPECT_NE(resp.find("# TYPE ctxcache_policy_evictions_total counter"), std::string::npos) << resp;
  EXPECT_NE(HttpGet(server_.metrics_port(), "/nope").find("404"), std::string::npos);
}

// Regression: no process_* metrics; the block-cache hit ratio was a gauge
// since start (counters let PromQL take it over a window); rpc_errors_total
// repeated rpc_total{code}; ctxcache_evictions_total appeared only after the
// first eviction.
TEST_F(CtxcachedTest, MetricsFollowPrometheusConventions) {
  // One failed call, which used to add an rpc_errors_total series.
  auto stub = v1::ContextAdmin::NewStub(channel_);
  grpc::ClientContext ctx;
  v1::GetContextRequest req;
  req.set_context_id(std::string(32, '0'));
  v1::ContextInfo info;
  EXPECT_EQ(stub->GetContext(&ctx, req, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  const std::string resp = HttpGet(server_.metrics_port(), "/metrics");
  for (const char* line : {"# TYPE process_cpu_seconds_total counter",
                           "# TYPE process_resident_memory_bytes gauge",
                           "# TYPE process_virtual_memory_bytes gauge",
                           "# TYPE process_open_fds gauge", "# TYPE process_max_fds gauge",
                           "# TYPE process_start_time_seconds gauge",
                           "# TYPE ctxcache_block_cache_hits_total counter",
                           "# TYPE ctxcache_block_cache_misses_total counter",
                           "ctxcache_evictions_total 0",
                           "ctxcache_rpc_total{code=\"NOT_FOUND\",method=\"GetContext\"} 1"}) {
    EXPECT_NE(resp.find(line), std::string::npos) << line << "\n" << resp;
  }
  EXPECT_EQ(resp.find("ctxcache_block_cache_hit_ratio"), std::string::npos) << resp;
  EXPECT_EQ(resp.find("ctxcache_rpc_errors_total"), std::string::npos) << resp;
  EXPECT_EQ(resp.find("process_resident_memory_bytes 0\n"), std::string::npos) << resp;
  EXPECT_EQ(resp.find("process_open_fds 0\n"), std::string::npos) << resp;
}

TEST_F(CtxcachedTest, SigtermExitsZeroWithinFiveSeconds) {
  auto start = std::chrono::steady_clock::now();
  int code = server_.Stop(SIGTERM, std::chrono::seconds(5));
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(code, 0) << server_.log();
  EXPECT_LT(elapsed, std::chrono::seconds(5));
  std::string log = server_.log();
  EXPECT_NE(log.find("draining"), std::string::npos) << log;
  EXPECT_NE(log.find("store closed"), std::string::npos) << log;
}

TEST_F(CtxcachedTest, SecondInstanceOnSameDirFailsFastNamingTheLock) {
  ServerProcess second;
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(second.Start(data_dir_, {}, std::chrono::seconds(20)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  std::string log = second.log();
  EXPECT_NE(log.find("LOCK"), std::string::npos) << log;
  EXPECT_NE(log.find("another process"), std::string::npos) << log;
  EXPECT_NE(second.Stop(), 0);
  // The first one is unaffected.
  EXPECT_EQ(Health(""), grpc::health::v1::HealthCheckResponse::SERVING);
}

// One Decode stream on a shared channel, answered once by the handler (an
// Open of an unknown context: an error response, the stream stays open).
struct DecodeStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw;

  // True when the server's handler answered (it admitted the stream).
  bool OpenUnknown(v1::DecodeService::Stub* stub) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    rw = stub->Decode(&ctx);
    v1::DecodeRequest req;
    req.set_request_id(1);
    req.mutable_open()->set_context_id(std::string(32, '0'));
    req.mutable_open()->set_method("full");
    v1::DecodeResponse resp;
    return rw->Write(req) && rw->Read(&resp) && resp.has_error();
  }
  grpc::Status Close() {
    rw->WritesDone();
    v1::DecodeResponse resp;
    while (rw->Read(&resp)) {
    }
    return rw->Finish();
  }
};

// Regression: with HTTP/2's limit alone, the stream past
// --max-streams-per-connection waited in the client (7 s and more) with no
// error. It must fail at once with RESOURCE_EXHAUSTED naming the flag.
TEST(CtxcachedFlagsTest, StreamPastMaxStreamsPerConnectionFailsFast) {
  TempDir tmp;
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data", {"--max-streams-per-connection", "2"}))
      << server.log();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::DecodeService::NewStub(channel);
  DecodeStream first, second, third, fourth;
  ASSERT_TRUE(first.OpenUnknown(stub.get()));
  ASSERT_TRUE(second.OpenUnknown(stub.get()));
  EXPECT_FALSE(third.OpenUnknown(stub.get()));
  grpc::Status refused = third.rw->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("--max-streams-per-connection=2"), std::string::npos)
      << refused.error_message();
  // Unary calls still pass on the same connection.
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext hctx;
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  EXPECT_TRUE(health->Check(&hctx, hreq, &hresp).ok());
  // A closed stream gives its place back.
  EXPECT_TRUE(first.Close().ok());
  EXPECT_TRUE(fourth.OpenUnknown(stub.get()));
  EXPECT_TRUE(second.Close().ok());
  EXPECT_TRUE(fourth.Close().ok());
}

// Regression: a missing or empty --model-dir reported SERVING with no word.
// It warns, and the "ctxcache.prefill" health status says builds cannot run
// (sessions, reads and ingests need no model, so the server still serves).
TEST(CtxcachedFlagsTest, MissingOrEmptyModelDirWarnsAndPrefillIsNotServing) {
  TempDir tmp;
  for (const std::string& dir : {tmp.path() + "/no-such-dir", tmp.path()}) {
    ServerProcess server;
    ASSERT_TRUE(server.Start(tmp.path() + "/data", {"--model-dir", dir})) << server.log();
    const std::string log = server.log();
    EXPECT_NE(log.find(" W [ctxcached] --model-dir '" + dir + "'"), std::string::npos) << log;
    EXPECT_EQ(HealthOf(server, "ctxcache.prefill"),
              grpc::health::v1::HealthCheckResponse::NOT_SERVING);
    EXPECT_EQ(HealthOf(server, ""), grpc::health::v1::HealthCheckResponse::SERVING);
    EXPECT_EQ(server.Stop(), 0);
  }
}

TEST(CtxcachedFlagsTest, HostedDefaultModelMakesPrefillServing) {
  TempDir tmp;
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data",
                           {"--model-dir", testing::SourceDir() + "/tests/data/golden",
                            "--default-model", "llama3"}))
      << server.log();
  EXPECT_EQ(HealthOf(server, "ctxcache.prefill"), grpc::health::v1::HealthCheckResponse::SERVING)
      << server.log();
  EXPECT_NE(server.log().find("(default llama3)"), std::string::npos) << server.log();
}

// docs/api.md: ctxcache_evictions_total counts contexts evicted by EvictContext.
TEST(CtxcachedFlagsTest, ExplicitEvictionCountsInEvictionsTotal) {
  TempDir tmp;
  ServerProcess server;
  ASSERT_TRUE(server.Start(tmp.path() + "/data",
                           {"--model-dir", testing::SourceDir() + "/tests/data/golden",
                            "--default-model", "llama3"}))
      << server.log();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::ContextAdmin::NewStub(channel);
  v1::BuildContextRequest build;
  for (uint32_t t = 1; t <= 40; ++t) build.mutable_tokens()->add_ids(t);
  grpc::ClientContext bctx;
  bctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub->BuildContext(&bctx, build);
  v1::BuildProgress progress, last;
  while (reader->Read(&progress)) last = progress;
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(last.phase(), v1::BuildProgress::DONE);
  const std::string before = HttpGet(server.metrics_port(), "/metrics");
  EXPECT_NE(before.find("\nctxcache_evictions_total 0\n"), std::string::npos) << before;
  grpc::ClientContext ectx;
  v1::EvictContextRequest evict;
  evict.set_context_id(last.context().context_id());
  v1::EvictContextResponse evicted;
  ASSERT_TRUE(stub->EvictContext(&ectx, evict, &evicted).ok());
  const std::string after = HttpGet(server.metrics_port(), "/metrics");
  EXPECT_NE(after.find("\nctxcache_evictions_total 1\n"), std::string::npos) << after;
  EXPECT_NE(after.find("\nctxcache_policy_evictions_total 0\n"), std::string::npos) << after;
}

TEST(CtxcachedFlagsTest, VersionPrintsVersionAndRevision) {
  std::string out;
  int code = ServerProcess::RunCapture({testing::BinDir() + "/ctxcached", "--version"}, &out);
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(out.rfind("ctxcached ", 0), 0u) << out;
  EXPECT_NE(out.find("(revision "), std::string::npos) << out;
  EXPECT_EQ(out.find("effective config"), std::string::npos) << out;
}

TEST(CtxcachedFlagsTest, BadFlagIsAClearError) {
  std::string out;
  int code =
      ServerProcess::RunCapture({testing::BinDir() + "/ctxcached", "--high-watermark", "3"}, &out);
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("--high-watermark"), std::string::npos) << out;
}

}  // namespace
}  // namespace ctxcache
