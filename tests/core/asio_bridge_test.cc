#include "core/asio_bridge.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

namespace asio = boost::asio;

std::unique_ptr<Reactor> MakeReactor() {
  auto r = Reactor::Create();
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

Task<absl::StatusOr<int>> SleepThenValue(Reactor* r, int v) {
  absl::Status s = co_await r->Sleep(absl::Milliseconds(20));
  if (!s.ok()) co_return s;
  co_return v * 2;
}

TEST(AsioBridgeTest, AwaitableAwaitsTaskOnDrivenReactor) {
  auto r = MakeReactor();
  asio::io_context io;
  AsioDriver driver(io, *r);
  ASSERT_TRUE(driver.Start().ok());
  std::thread::id asio_thread = std::this_thread::get_id();
  int got = 0;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        absl::StatusOr<int> v =
            co_await AwaitTask(*r, SleepThenValue(r.get(), 21));
        EXPECT_TRUE(v.ok()) << v.status();
        EXPECT_EQ(std::this_thread::get_id(), asio_thread);
        got = v.ok() ? *v : -1;
        driver.Stop();
      },
      asio::detached);
  io.run();  // no other thread drives the reactor: the io_context does
  EXPECT_EQ(got, 42);
  EXPECT_GT(driver.pumps(), 0u);
}

TEST(AsioBridgeTest, CrossThreadPostReachesAsioDrivenReactor) {
  auto r = MakeReactor();
  asio::io_context io;
  AsioDriver driver(io, *r);
  ASSERT_TRUE(driver.Start().ok());
  Event posted;
  bool ran_on_loop = false;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        auto wait = [](Event* e) -> Task<absl::Status> {
          co_return co_await e->Wait();
        };
        absl::Status s = co_await AwaitTask(*r, wait(&posted));
        EXPECT_TRUE(s.ok());
        driver.Stop();
      },
      asio::detached);
  std::thread other([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    r->Post([&] {
      ran_on_loop = Reactor::Current() == r.get();
      posted.Set();
    });
  });
  io.run();
  other.join();
  EXPECT_TRUE(ran_on_loop);
}

TEST(AsioBridgeTest, TaskAwaitsAsioAwaitable) {
  auto r = MakeReactor();
  asio::io_context io;
  AsioDriver driver(io, *r);
  ASSERT_TRUE(driver.Start().ok());
  auto timer_value = [&io]() -> asio::awaitable<int> {
    asio::steady_timer t(io, std::chrono::milliseconds(10));
    co_await t.async_wait(asio::use_awaitable);
    co_return 7;
  };
  absl::StatusOr<int> result = 0;
  auto task = [](asio::io_context* io, asio::awaitable<int> aw,
                 absl::StatusOr<int>* out, AsioDriver* d) -> Task<void> {
    *out = co_await AwaitAsio(io->get_executor(), std::move(aw));
    d->Stop();
  };
  r->Spawn(task(&io, timer_value(), &result, &driver));
  io.run();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(*result, 7);
}

}  // namespace
}  // namespace coverbs
