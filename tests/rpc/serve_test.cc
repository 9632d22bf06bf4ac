// coverbs::Serve with ServeOptions::setup: the service registers memory in
// the PD Serve hands out (shared by every reactor's Worker), its handlers
// expose it to their callers, and Serve releases what setup kept after
// the server shut down. A process-wide SIGTERM (blocked in every thread,
// so Serve's sigwait takes it) ends Serve.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "coverbs/coverbs.h"
#include "gtest/gtest.h"
#include "tests/co_assert.h"

namespace coverbs {
namespace {

// A port nobody listens on now (bound once, released).
uint16_t FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

class ServeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);  // threads started later too
  }
};

Task<absl::StatusOr<std::unique_ptr<rpc::Client>>> ConnectRetrying(
    cm::Worker& worker, uint16_t port) {
  absl::Status last;
  for (int i = 0; i < 500; ++i) {  // until Serve listens (bounded: 5 s)
    auto c = co_await rpc::Client::Connect(worker, "127.0.0.1", port);
    if (c.ok()) co_return c;
    last = c.status();
    (void)co_await worker.reactor().Sleep(absl::Milliseconds(10));
  }
  co_return last;
}

TEST_F(ServeTest, SetupRegistersInTheSharedPdAndHandlersExposeIt) {
  const uint16_t port = FreePort();
  static const std::string kText = "registered once in setup";
  std::atomic<transport::MemoryRegion*> region{nullptr};
  std::atomic<bool> one_pd{false};
  std::atomic<int> released{0};
  rpc::Server server;
  ASSERT_TRUE(server
                  .Register("Where",
                            [&region](rpc::Context& ctx, int32_t)
                                -> Task<absl::StatusOr<RemoteRegion>> {
                              co_return ctx.Expose(*region.load());
                            })
                  .ok());
  ServeOptions o;
  o.threads = 2;
  o.setup = [&](const ServeContext& ctx) -> absl::Status {
    bool same = ctx.pool.size() == 2;
    for (size_t i = 0; i < ctx.pool.size(); ++i) {
      same = same && &ctx.pool.worker(i).pd() == &ctx.pd;
    }
    one_pd = same;
    auto mr = ctx.pd.Register(
        std::as_writable_bytes(std::span(const_cast<std::string&>(kText))),
        Access::kRemoteRead);
    if (!mr.ok()) return mr.status();
    auto owned = std::shared_ptr<transport::MemoryRegion>(
        new transport::MemoryRegion(*std::move(mr)),
        [&released](transport::MemoryRegion* m) {
          released.fetch_add(1);
          delete m;
        });
    region = owned.get();
    ctx.keep.push_back(owned);
    return absl::OkStatus();
  };
  int rc = -1;
  std::thread serving([&] { rc = Serve(server, "127.0.0.1", port, o); });

  // Two clients: the server spreads them over its two reactors, and both
  // read the one region through their own connection.
  int client_rc = RunMain([port](cm::Worker& worker) -> Task<absl::Status> {
    for (int i = 0; i < 2; ++i) {
      CO_ASSIGN_OR_RETURN(auto client, co_await ConnectRetrying(worker, port));
      CO_ASSIGN_OR_RETURN(auto where,
                          co_await client->Call<RemoteRegion>("Where", 0));
      std::string copy(where.length, '\0');
      CO_RETURN_IF_ERROR(
          co_await client->connection().Read(AsBytes(copy), where));
      if (copy != kText) co_return absl::InternalError("read " + copy);
      CO_RETURN_IF_ERROR(co_await client->Close());
    }
    co_return absl::OkStatus();
  });
  EXPECT_EQ(client_rc, 0);
  EXPECT_TRUE(one_pd.load());
  EXPECT_EQ(released.load(), 0);
  kill(getpid(), SIGTERM);
  serving.join();
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(released.load(), 1);  // released by Serve, after the shutdown
  EXPECT_EQ(server.stats().connections, 2u);
}

TEST_F(ServeTest, FailingSetupEndsServe) {
  rpc::Server server;
  ServeOptions o;
  o.setup = [](const ServeContext&) {
    return absl::UnavailableError("no metrics port");
  };
  EXPECT_EQ(Serve(server, "127.0.0.1", 0, o), 1);
}

}  // namespace
}  // namespace coverbs
