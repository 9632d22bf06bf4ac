// rpc::ServerMetrics against a real server and client (soft provider,
// loopback): per-method histograms and codes count exactly the calls made,
// the server's counters are exported, and /metrics is served over HTTP
// (scraped with curl).
#include "rpc/metrics.h"

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cm/worker.h"
#include "cm/worker_pool.h"
#include "core/reactor.h"
#include "gtest/gtest.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "transport/device.h"
#include "transport/provider.h"

namespace coverbs::rpc {
namespace {

std::string RunCommand(const std::string& command) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

TEST(ServerMetricsTest, ExportsCallsPerMethodAndServerCounters) {
  transport::ProviderOptions po;
  po.kind = transport::ProviderKind::kSoft;
  auto device = transport::Device::Open(po);
  ASSERT_TRUE(device.ok()) << device.status();
  cm::WorkerPool::Options wo;
  wo.threads = 2;
  auto pool = cm::WorkerPool::Create(**device, wo);
  ASSERT_TRUE(pool.ok()) << pool.status();

  ServerMetrics metrics;
  ServerOptions so;
  so.call_observer = metrics.Observer();
  auto server = std::make_unique<Server>(so);
  ASSERT_TRUE(server
                  ->Register("Echo",
                             [](Request r) -> Task<absl::StatusOr<Payload>> {
                               co_return std::move(r.payload);
                             })
                  .ok());
  ASSERT_TRUE(server
                  ->Register("Fail",
                             [](Request) -> Task<absl::StatusOr<Payload>> {
                               co_return absl::NotFoundError("no such key");
                             })
                  .ok());
  ASSERT_TRUE(server->Start(**pool, "127.0.0.1", 0).ok());
  metrics.Watch(server.get());
  absl::Status listening = metrics.Listen("127.0.0.1", 0);
  ASSERT_TRUE(listening.ok()) << listening;
  ASSERT_NE(metrics.port(), 0);
  EXPECT_EQ(metrics.Listen("127.0.0.1", 0).code(),
            absl::StatusCode::kFailedPrecondition);

  auto reactor = Reactor::Create();
  ASSERT_TRUE(reactor.ok());
  auto worker = cm::Worker::Create(**reactor, **device);
  ASSERT_TRUE(worker.ok());
  const uint16_t port = server->port();
  absl::Status calls = (*reactor)->BlockOn(
      [](cm::Worker& w, uint16_t port) -> Task<absl::Status> {
        auto c = co_await Client::Connect(w, "127.0.0.1", port);
        if (!c.ok()) co_return c.status();
        const std::string msg(100, 'x');
        for (int i = 0; i < 7; ++i) {
          auto r = co_await (*c)->Call("Echo", std::as_bytes(std::span(msg)));
          if (!r.ok()) co_return r.status();
        }
        for (int i = 0; i < 3; ++i) {
          auto r = co_await (*c)->Call("Fail", {});
          if (r.status().code() != absl::StatusCode::kNotFound) {
            co_return absl::InternalError(
                absl::StrCat("Fail returned ", r.status().ToString()));
          }
        }
        co_return co_await (*c)->Close();
      }(**worker, port));
  ASSERT_TRUE(calls.ok()) << calls;

  // The observer runs after the response was posted: the client may see
  // the last response first. Wait (bounded) for the counts to settle.
  std::string text;
  for (int i = 0; i < 200; ++i) {
    text = metrics.Text();
    if (absl::StrContains(
            text,
            "coverbs_rpc_server_method_calls_total{code=\"NOT_FOUND\","
            "method=\"Fail\"} 3")) {
      break;
    }
    usleep(10 * 1000);
  }
  EXPECT_TRUE(absl::StrContains(
      text,
      "coverbs_rpc_server_call_duration_seconds_count{method=\"Echo\"} 7"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text,
      "coverbs_rpc_server_call_duration_seconds_bucket{method=\"Echo\","
      "le=\"+Inf\"} 7"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text,
      "coverbs_rpc_server_method_calls_total{code=\"OK\",method=\"Echo\"} 7"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text,
      "coverbs_rpc_server_method_calls_total{code=\"NOT_FOUND\","
      "method=\"Fail\"} 3"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "coverbs_rpc_server_calls_total 10"))
      << text;
  EXPECT_TRUE(
      absl::StrContains(text, "coverbs_rpc_server_failed_calls_total 3"))
      << text;
  EXPECT_TRUE(
      absl::StrContains(text, "coverbs_rpc_server_request_bytes_total 700"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "coverbs_rpc_server_connections_total 1"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "# TYPE coverbs_rpc_server_open_connections gauge"))
      << text;

  // The same over HTTP, with a real client.
  const std::string scraped = RunCommand(absl::StrCat(
      "curl -sS --max-time 10 http://127.0.0.1:", metrics.port(), "/metrics"));
  EXPECT_TRUE(absl::StrContains(
      scraped,
      "coverbs_rpc_server_call_duration_seconds_count{method=\"Echo\"} 7"))
      << scraped;
  EXPECT_TRUE(absl::StrContains(scraped, "coverbs_rpc_server_calls_total 10"))
      << scraped;

  server->Shutdown();
  metrics.Watch(nullptr);
  EXPECT_FALSE(
      absl::StrContains(metrics.Text(), "coverbs_rpc_server_calls_total"));
  server.reset();
  worker->reset();
  pool->reset();
}

TEST(ServerMetricsTest, ListenFailsOnABusyPort) {
  ServerMetrics a;
  ASSERT_TRUE(a.Listen("127.0.0.1", 0).ok());
  ServerMetrics b;
  absl::Status s = b.Listen("127.0.0.1", a.port());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat(a.port()))) << s;
}

}  // namespace
}  // namespace coverbs::rpc
