// BufferPool's free list is lock-free and buffers come back from any thread
// (transport/memory.cc): many threads taking and returning buffers of a
// small pool must never hold the same buffer at once, and every buffer must
// be back, once, at the end. A pool for partly written buffers faults in
// only the pages written.
#include <atomic>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/resident_pages.h"
#include "transport/device.h"
#include "transport/memory.h"
#include "transport/provider.h"

namespace coverbs::transport {
namespace {

// A soft device and a protection domain for the pools.
class BufferPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProviderOptions po;
    po.kind = ProviderKind::kSoft;
    auto device = Device::Open(po);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    auto pd = device_->AllocPd();
    ASSERT_TRUE(pd.ok()) << pd.status();
    pd_ = *std::move(pd);
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<ProtectionDomain> pd_;
};

TEST_F(BufferPoolTest, GetAndPutFromManyThreads) {
  BufferPool::Options o;
  o.buffer_size = 64;
  o.count = 8;
  auto pool = BufferPool::Create(*pd_, o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<std::atomic<int>> owners(o.count);
  std::atomic<bool> clash{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, &owners, &clash] {
      BufferPool::Buffer kept;  // returned by the next move assignment
      for (int i = 0; i < 20000; ++i) {
        auto b = (*pool)->TryGet();
        if (!b.has_value()) continue;
        if (owners[b->index()].fetch_add(1) != 0) clash = true;
        owners[b->index()].fetch_sub(1);
        if (i % 3 == 0) kept = std::move(*b);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(clash.load());
  EXPECT_EQ((*pool)->available(), o.count);
  std::set<uint32_t> seen;
  std::vector<BufferPool::Buffer> all;
  for (size_t i = 0; i < o.count; ++i) {
    auto b = (*pool)->TryGet();
    ASSERT_TRUE(b.has_value());
    EXPECT_TRUE(seen.insert(b->index()).second);
    all.push_back(std::move(*b));
  }
  EXPECT_FALSE((*pool)->TryGet().has_value());
}

// A pool made for buffers that are mostly written in part (the staging
// buffers of medium messages): a page becomes resident when it is written,
// not the 2 MiB transparent huge page around it.
TEST_F(BufferPoolTest, PartlyUsedPoolFaultsInOnlyWrittenPages) {
  BufferPool::Options o;
  o.buffer_size = 128 * 1024;
  o.count = 32;
  o.try_hugepages = false;
  o.transparent_hugepages = false;
  auto pool = BufferPool::Create(*pd_, o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<BufferPool::Buffer> all;
  for (size_t i = 0; i < o.count; ++i) {
    auto b = (*pool)->TryGet();
    ASSERT_TRUE(b.has_value());
    b->data()[0] = std::byte{1};
    all.push_back(std::move(*b));
  }
  EXPECT_EQ(
      testing::ResidentPages((*pool)->region().addr(), o.buffer_size * o.count),
      o.count);
}

}  // namespace
}  // namespace coverbs::transport
