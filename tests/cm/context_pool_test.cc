// cm::ContextPool: one Context per reactor, each created on (and used from)
// its own reactor's thread; a failed Create cleans up what it made.
#include "cm/context_pool.h"

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

TEST(ContextPoolTest, OneContextPerReactorOnItsThread) {
  auto device = Soft();
  ASSERT_NE(device, nullptr);
  ContextPool::Options o;
  o.threads = 3;
  o.context.cq_entries = 1024;
  auto pool = ContextPool::Create(*device, o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_EQ((*pool)->size(), 3u);
  ASSERT_EQ((*pool)->contexts().size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    Context& ctx = (*pool)->context(i);
    EXPECT_EQ(&ctx.reactor(), &(*pool)->reactors().reactor(i));
    EXPECT_EQ(ctx.cq().capacity() >= 1024, true);
    EXPECT_EQ((*pool)->contexts()[i], &ctx);
    // Usable from its own thread.
    std::promise<bool> on_thread;
    auto f = on_thread.get_future();
    (*pool)->reactors().Post(i, [&ctx, &on_thread] {
      on_thread.set_value(ctx.reactor().InLoopThread());
    });
    EXPECT_TRUE(f.get());
  }
  pool->reset();  // contexts go on their threads, then the reactors stop
}

TEST(ContextPoolTest, AFailedContextFailsCreateAndCleansUp) {
  auto device = Soft();
  auto other = Soft();
  ASSERT_NE(device, nullptr);
  ASSERT_NE(other, nullptr);
  auto foreign_pd = other->AllocPd();
  ASSERT_TRUE(foreign_pd.ok()) << foreign_pd.status();
  ContextPool::Options o;
  o.threads = 2;
  o.context.pd = foreign_pd->get();  // belongs to another device
  auto pool = ContextPool::Create(*device, o);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument)
      << pool.status();
}

}  // namespace
}  // namespace coverbs::cm
