// cm::WorkerPool: one Worker per reactor, each created on (and used from)
// its own reactor's thread; a failed Create cleans up what it made.
#include "cm/worker_pool.h"

#include <future>
#include <memory>

#include "gtest/gtest.h"
#include "transport/device.h"

namespace coverbs::cm {
namespace {

std::unique_ptr<transport::Device> Soft() {
  transport::ProviderOptions o;
  o.kind = transport::ProviderKind::kSoft;
  auto d = transport::Device::Open(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

TEST(WorkerPoolTest, OneWorkerPerReactorOnItsThread) {
  auto device = Soft();
  ASSERT_NE(device, nullptr);
  WorkerPool::Options o;
  o.threads = 3;
  o.worker.cq_entries = 1024;
  auto pool = WorkerPool::Create(*device, o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_EQ((*pool)->size(), 3u);
  ASSERT_EQ((*pool)->workers().size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    Worker& ctx = (*pool)->worker(i);
    EXPECT_EQ(&ctx.reactor(), &(*pool)->reactors().reactor(i));
    EXPECT_EQ(ctx.cq().capacity() >= 1024, true);
    EXPECT_EQ((*pool)->workers()[i], &ctx);
    // Usable from its own thread.
    std::promise<bool> on_thread;
    auto f = on_thread.get_future();
    (*pool)->reactors().Post(i, [&ctx, &on_thread] {
      on_thread.set_value(ctx.reactor().InLoopThread());
    });
    EXPECT_TRUE(f.get());
  }
  pool->reset();  // workers go on their threads, then the reactors stop
}

TEST(WorkerPoolTest, AFailedWorkerFailsCreateAndCleansUp) {
  auto device = Soft();
  auto other = Soft();
  ASSERT_NE(device, nullptr);
  ASSERT_NE(other, nullptr);
  auto foreign_pd = other->AllocPd();
  ASSERT_TRUE(foreign_pd.ok()) << foreign_pd.status();
  WorkerPool::Options o;
  o.threads = 2;
  o.worker.pd = foreign_pd->get();  // belongs to another device
  auto pool = WorkerPool::Create(*device, o);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument)
      << pool.status();
}

}  // namespace
}  // namespace coverbs::cm
