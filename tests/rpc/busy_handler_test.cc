// A handler that keeps its reactor busy must cost its callers time, never
// their connection: a real server process (rpc_server_peer) whose handler
// blocks its reactor, or burns its CPU, while other calls on the same
// connection are in flight. On an RDMA NIC the hardware acknowledges while
// the host is busy; on soft the progress thread takes over a stalled
// reactor's receive and acknowledges for it.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"
#include "tests/rpc/rpc_fixture.h"

namespace coverbs::rpc {
namespace {

using namespace rpc_test_util;  // NOLINT: the fixture and its helpers

// The helper's path: the runfiles path under bazel test, else the binary
// next to this one (the VM harness).
std::string HelperPath() {
  const char* helper = std::getenv("COVERBS_RPC_SERVER_PEER");
  std::string path = helper ? helper : "tests/rpc/rpc_server_peer";
  if (access(path.c_str(), X_OK) != 0) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
      std::string exe(self, n);
      path = exe.substr(0, exe.rfind('/') + 1) + "rpc_server_peer";
    }
  }
  return path;
}

class BusyHandlerTest : public RpcTest {
 protected:
  // Starts rpc_server_peer and reads its port.
  void StartPeer() {
    std::string path = HelperPath();
    ASSERT_EQ(access(path.c_str(), X_OK), 0) << "helper not found: " << path;
    int fds[2];
    ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
    std::string provider = GetParam();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], 3);  // without CLOEXEC: the child keeps the write end
      execl(path.c_str(), path.c_str(), provider.c_str(), addr_.c_str(), "3",
            nullptr);
      _exit(127);
    }
    ASSERT_GT(pid_, 0);
    close(fds[1]);
    std::string port_text;
    char ch;
    for (int i = 0; i < 16 && read(fds[0], &ch, 1) == 1 && ch != '\n'; ++i) {
      port_text.push_back(ch);
    }
    close(fds[0]);
    port_ = static_cast<uint16_t>(std::atoi(port_text.c_str()));
    ASSERT_NE(port_, 0) << "the server helper did not report a port";
  }

  void TearDown() override {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    RpcTest::TearDown();
  }

  // `method` ("Block" or "Burn") runs for `ms` on the server's only reactor
  // while kInFlight callers keep echo calls going on the same connection
  // until it answered: every call succeeds.
  void BusyWhileCallsInFlight(const char* method, int ms) {
    StartPeer();
    if (HasFatalFailure()) return;
    Run(
        [](BusyHandlerTest* t, const char* method, int ms) -> Task<void> {
          auto c =
              co_await Client::Connect(*t->client_ctx_, t->addr_, t->port_);
          CO_ASSERT_OK(c);
          Client* client = c->get();
          constexpr int kInFlight = 16;
          std::atomic<bool> stop{false};
          std::vector<absl::Status> results(kInFlight);
          std::vector<int> calls(kInFlight, 0);
          WaitGroup wg;
          wg.Add(kInFlight);
          for (int i = 0; i < kInFlight; ++i) {
            Reactor::Current()->Spawn(
                [](Client* c, std::atomic<bool>* stop, absl::Status* out,
                   int* calls, WaitGroup* wg, uint32_t seed) -> Task<void> {
                  while (!stop->load()) {
                    auto req = Pattern(64, seed + *calls);
                    auto r = co_await c->Call("Echo", req);
                    if (!r.ok()) {
                      *out = r.status();
                      break;
                    }
                    if (!Same(r->data(), req)) {
                      *out = absl::DataLossError("echo differs");
                      break;
                    }
                    ++*calls;
                  }
                  wg->Done();
                }(client, &stop, &results[i], &calls[i], &wg, i * 1000));
          }
          // The echo calls run before the server's reactor stops.
          EXPECT_TRUE(co_await Eventually([&calls] {
            for (int n : calls) {
              if (n == 0) return false;
            }
            return true;
          }));
          std::string arg = std::to_string(ms);
          auto busy = co_await client->Call(
              method, std::as_bytes(std::span(arg.data(), arg.size())));
          stop.store(true);
          CO_ASSERT_OK(co_await wg.Wait());
          EXPECT_TRUE(busy.ok()) << method << ": " << busy.status();
          for (int i = 0; i < kInFlight; ++i) {
            EXPECT_TRUE(results[i].ok())
                << "caller " << i << ": " << results[i];
          }
          EXPECT_TRUE(client->connection().status().ok())
              << client->connection().status();
          CO_ASSERT_OK(co_await client->Close());
        }(this, method, ms),
        absl::Seconds(50));
  }

  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

TEST_P(BusyHandlerTest, HandlerBlockingFiveSecondsCostsNoCall) {
  BusyWhileCallsInFlight("Block", 5000);
}

TEST_P(BusyHandlerTest, CpuHeavyHandlerCostsNoCall) {
  BusyWhileCallsInFlight("Burn", 1500);
}

// The server reports the stall (its log names the handler's method) and
// counts it in its stats.
TEST_P(BusyHandlerTest, AStalledHandlerIsLoggedAndCounted) {
  std::mutex mu;
  std::vector<std::string> lines;
  SetLogSink([&](const LogRecord& r) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(std::string(r.message));
  });
  server_ = std::make_unique<Server>();
  ASSERT_TRUE(server_
                  ->Register("Block",
                             [](Request) -> Task<absl::StatusOr<Payload>> {
                               std::this_thread::sleep_for(
                                   std::chrono::milliseconds(300));
                               co_return Payload::Copy("done");
                             })
                  .ok());
  std::vector<cm::Worker*> ctxs;
  for (auto& c : server_ctxs_) ctxs.push_back(c.get());
  ASSERT_TRUE(server_->Start(ctxs, addr_, 0).ok());
  EXPECT_EQ(server_->stats().reactor_stalls, 0u);
  Run([](BusyHandlerTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    CO_ASSERT_OK(co_await (*c)->Call("Block", {}));
    // The server counts the connection's end by its cause.
    CO_ASSERT_OK(co_await (*c)->Close());
    Server* s = t->server_.get();
    const size_t peer = static_cast<size_t>(cm::CloseCause::kPeerClosed);
    EXPECT_TRUE(co_await Eventually(
        [s, peer] { return s->stats().closed_by_cause[peer] == 1; }));
  }(this));
  SetLogSink(nullptr);
  EXPECT_EQ(server_->stats().reactor_stalls, 1u);
  std::lock_guard<std::mutex> lock(mu);
  int found = 0;
  for (const std::string& l : lines) {
    if (l.find("reactor stalled: task 'Block' ran ") != std::string::npos) {
      ++found;
    }
  }
  EXPECT_EQ(found, 1);
}

INSTANTIATE_TEST_SUITE_P(Providers, BusyHandlerTest,
                         ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::rpc
