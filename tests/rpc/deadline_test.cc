// Issue #36: a caller's deadline costs that call only, never the
// connection. Large calls (rendezvous, 16 MiB) with deadlines so short they
// fire at every step of the transfer -- waiting for the send turn, a credit,
// the CTS, the WRITE, the response -- each end DEADLINE_EXCEEDED, and the
// same client then makes a full 16 MiB call. The server runs on a
// cm::WorkerPool of this process, the client on the test thread.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cm/worker_pool.h"
#include "coverbs/coverbs.h"
#include "gtest/gtest.h"
#include "tests/cm/test_util.h"

namespace coverbs::rpc {
namespace {

class DeadlineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    transport::ProviderOptions o;
    o.kind = *transport::ParseProviderKind(GetParam());
    if (const char* dev = std::getenv("COVERBS_VM_DEV");
        dev && o.kind == transport::ProviderKind::kVerbs) {
      o.device = dev;
    }
    auto d = transport::Device::Open(o);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    cm::WorkerPool::Options po;
    po.threads = 1;
    auto pool = cm::WorkerPool::Create(*device_, po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    server_ = std::make_unique<Server>();
    ASSERT_TRUE(server_
                    ->Register("Echo",
                               [](Request r) -> Task<absl::StatusOr<Payload>> {
                                 co_return std::move(r.payload);
                               })
                    .ok());
    ASSERT_TRUE(server_->Start(*pool_, cm::TestAddress(), 0).ok());
    auto r = Reactor::Create();
    ASSERT_TRUE(r.ok()) << r.status();
    reactor_ = *std::move(r);
    auto w = cm::Worker::Create(*reactor_, *device_);
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = *std::move(w);
    auto c = reactor_->BlockOn(
        Client::Connect(*worker_, cm::TestAddress(), server_->port()));
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  void TearDown() override {
    if (client_) (void)reactor_->BlockOn(client_->Close());
    client_.reset();
    worker_.reset();
    reactor_.reset();
    if (server_) server_->Shutdown();
    server_.reset();
    pool_.reset();
    device_.reset();
  }

  std::unique_ptr<transport::Device> device_;
  std::unique_ptr<cm::WorkerPool> pool_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Reactor> reactor_;
  std::unique_ptr<cm::Worker> worker_;
  std::unique_ptr<Client> client_;
};

// `n` calls of `size` bytes, `at_once` at a time, each with `deadline`:
// every one either succeeds (echo intact) or ends DEADLINE_EXCEEDED; the
// connection stays up throughout.
Task<void> ShortDeadlines(Client* client, size_t size, int n, int at_once,
                          absl::Duration deadline, int* exceeded) {
  std::vector<std::byte> payload(size);
  for (size_t i = 0; i < size; ++i) payload[i] = std::byte(i * 7 + 1);
  static const std::string kEcho = "Echo";
  auto results = co_await ForEachBounded(
      n, at_once, [&](size_t) -> Task<absl::StatusOr<Response>> {
        CallOptions o;
        o.deadline = absl::Now() + deadline;
        co_return co_await client->Call(kEcho, payload, o);
      });
  for (auto& r : results) {
    if (r.ok()) {
      EXPECT_EQ(r->size(), size);
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded)
          << r.status();
      ++*exceeded;
    }
    EXPECT_TRUE(client->status().ok()) << client->status();
  }
}

TEST_P(DeadlineTest, ShortDeadlinesOnLargeCallsCostOnlyThoseCalls) {
  constexpr size_t kSize = 16 << 20;
  int exceeded = 0;
  for (absl::Duration d :
       {absl::Microseconds(1), absl::Microseconds(200), absl::Milliseconds(1),
        absl::Milliseconds(3), absl::Milliseconds(10)}) {
    reactor_->BlockOn(
        ShortDeadlines(client_.get(), kSize, 24, 4, d, &exceeded));
    ASSERT_TRUE(client_->status().ok())
        << "deadline " << d << ": " << client_->status();
    ASSERT_TRUE(client_->connection().status().ok())
        << "deadline " << d << ": " << client_->connection().status();
  }
  EXPECT_GT(exceeded, 0);
  // The connection carries a whole 16 MiB call afterwards.
  int none = 0;
  reactor_->BlockOn(
      ShortDeadlines(client_.get(), kSize, 2, 1, absl::Seconds(60), &none));
  EXPECT_EQ(none, 0);
  EXPECT_TRUE(client_->status().ok()) << client_->status();
}

INSTANTIATE_TEST_SUITE_P(Providers, DeadlineTest,
                         ::testing::ValuesIn(cm::Providers()));

}  // namespace
}  // namespace coverbs::rpc
