#include "cm/large_memory_cache.h"

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "cm/page_memory.h"
#include "gtest/gtest.h"
#include "tests/resident_pages.h"
#include "transport/device.h"

namespace coverbs::cm::internal {
namespace {

TEST(LargeMemoryCacheTest, RoundsUpToPowerOfTwoPageAligned) {
  LargeMemoryCache cache(1 << 20);
  for (size_t size : {size_t{1}, size_t{4096}, size_t{4097}, size_t{65536},
                      size_t{100000}}) {
    LargeMemoryCache::Block b = cache.Get(size);
    ASSERT_NE(b.mem, nullptr);
    EXPECT_GE(b.capacity, size);
    EXPECT_GE(b.capacity, 4096u);
    EXPECT_EQ(b.capacity & (b.capacity - 1), 0u) << b.capacity;
    EXPECT_LT(b.capacity, 2 * size + 4096);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.mem) % 4096, 0u);
    cache.Put(std::move(b));
  }
}

TEST(LargeMemoryCacheTest, ReusesTheSameClass) {
  LargeMemoryCache cache(1 << 20);
  LargeMemoryCache::Block a = cache.Get(40000);
  std::byte* const a_mem = a.mem;
  const size_t a_capacity = a.capacity;
  cache.Put(std::move(a));
  EXPECT_EQ(cache.idle_bytes(), a_capacity);
  LargeMemoryCache::Block b = cache.Get(33000);  // same 64 KiB class
  EXPECT_EQ(b.mem, a_mem);
  EXPECT_EQ(cache.idle_bytes(), 0u);
  LargeMemoryCache::Block c = cache.Get(33000);  // none idle: a new one
  EXPECT_NE(c.mem, b.mem);
  cache.Put(std::move(b));
  cache.Put(std::move(c));
}

TEST(LargeMemoryCacheTest, KeepsAtMostTheIdleLimit) {
  LargeMemoryCache cache(128 * 1024);
  // In use the whole time, so that only the limit bounds what is idle.
  LargeMemoryCache::Block held = cache.Get(1 << 20);
  LargeMemoryCache::Block a = cache.Get(65536);
  LargeMemoryCache::Block b = cache.Get(65536);
  LargeMemoryCache::Block c = cache.Get(65536);
  cache.Put(std::move(a));
  cache.Put(std::move(b));
  cache.Put(std::move(c));  // over the limit: freed
  EXPECT_EQ(cache.idle_bytes(), 128u * 1024);
  cache.Put(std::move(held));
  LargeMemoryCache none(0);
  LargeMemoryCache::Block d = none.Get(8192);
  none.Put(std::move(d));
  EXPECT_EQ(none.idle_bytes(), 0u);
}

// Idle blocks beyond the bytes in use go back to the kernel, except one
// per size class: after a burst, an idle cache keeps one block per size it
// served, whatever its limit.
TEST(LargeMemoryCacheTest, IdleMemoryFollowsTheWorkingSet) {
  const size_t mapped = MappedPageBytes();
  LargeMemoryCache cache(64 << 20);
  std::vector<LargeMemoryCache::Block> burst;
  for (int i = 0; i < 16; ++i) burst.push_back(cache.Get(65536));
  for (int i = 0; i < 4; ++i) burst.push_back(cache.Get(8192));
  EXPECT_EQ(cache.in_use_bytes(), 16u * 65536 + 4 * 8192);
  EXPECT_EQ(MappedPageBytes() - mapped, 16u * 65536 + 4 * 8192);
  // Half of them back: the idle ones fit within what is still in use.
  for (int i = 0; i < 8; ++i) {
    cache.Put(std::move(burst.back()));
    burst.pop_back();
  }
  EXPECT_EQ(cache.idle_bytes(), 4u * 8192 + 4 * 65536);
  EXPECT_EQ(cache.in_use_bytes(), 12u * 65536);
  for (LargeMemoryCache::Block& b : burst) cache.Put(std::move(b));
  EXPECT_EQ(cache.in_use_bytes(), 0u);
  EXPECT_EQ(cache.idle_bytes(), 65536u + 8192);
  EXPECT_EQ(MappedPageBytes() - mapped, 65536u + 8192);
  // The kept ones serve the next transfers.
  LargeMemoryCache::Block again = cache.Get(65536);
  EXPECT_EQ(MappedPageBytes() - mapped, 65536u + 8192);
  cache.Put(std::move(again));
}

// The idle blocks kept follow the most in use at once over the last
// second, not the bytes in use at the instant of a Put: a client with 16
// calls of 1 MiB in flight holds 0 to 4 response blocks from moment to
// moment, and trimming to the instant mapped fresh pages for ~1 transfer
// in 5. When nothing is in use, one block per class stays, as before.
TEST(LargeMemoryCacheTest, ADipInUseKeepsTheWorkingSet) {
  const size_t mapped = MappedPageBytes();
  // A window no run of this test outlasts: no clock decides anything.
  LargeMemoryCache cache(64 << 20, false, std::chrono::hours(1));
  std::vector<LargeMemoryCache::Block> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(cache.Get(1 << 20));
  // Down to one in use: the seven idle ones stay (the instant's rule kept
  // one).
  for (int i = 0; i < 7; ++i) {
    cache.Put(std::move(blocks.back()));
    blocks.pop_back();
  }
  EXPECT_EQ(cache.in_use_bytes(), 1u << 20);
  EXPECT_EQ(cache.idle_bytes(), 7u << 20);
  // The next burst is served from them: nothing new is mapped.
  for (int i = 0; i < 7; ++i) blocks.push_back(cache.Get(1 << 20));
  EXPECT_EQ(MappedPageBytes() - mapped, 8u << 20);
  for (LargeMemoryCache::Block& b : blocks) cache.Put(std::move(b));
  EXPECT_EQ(cache.in_use_bytes(), 0u);
  EXPECT_EQ(cache.idle_bytes(), 1u << 20);
  EXPECT_EQ(MappedPageBytes() - mapped, 1u << 20);
}

// A connection's landing grants are 32 blocks of 128 KiB, mapped side by
// side (the kernel merges them into one area), of which a medium message
// writes a few pages. With transparent huge pages ("always"), the first
// write faulted in and zeroed a whole 2 MiB page: 4 MiB resident per
// connection. Only the written pages may become resident.
TEST(LargeMemoryCacheTest, OnlyWrittenPagesBecomeResident) {
  LargeMemoryCache cache(64 << 20);
  std::vector<LargeMemoryCache::Block> blocks;
  for (int i = 0; i < 32; ++i) blocks.push_back(cache.Get(128 * 1024));
  for (LargeMemoryCache::Block& b : blocks) {
    ASSERT_NE(b.mem, nullptr);
    b.mem[0] = std::byte{1};
    b.mem[4096] = std::byte{1};
  }
  for (LargeMemoryCache::Block& b : blocks) {
    EXPECT_EQ(testing::ResidentPages(b.mem, b.capacity), 2u);
  }
  for (LargeMemoryCache::Block& b : blocks) cache.Put(std::move(b));
}

// Landing memory on a device with memory windows: a block comes back with
// the registration its user kept, and one freed beyond the cap is
// deregistered first (a registration must never outlive its memory).
TEST(LargeMemoryCacheTest, KeepsARegistrationWithItsBlock) {
  auto device = transport::Device::Open({.kind = transport::ProviderKind::kSoft});
  ASSERT_TRUE(device.ok()) << device.status();
  auto pd = (*device)->AllocPd();
  ASSERT_TRUE(pd.ok()) << pd.status();
  LargeMemoryCache cache(64 * 1024, /*keep_registrations=*/true);
  LargeMemoryCache::Block a = cache.Get(65536);
  auto mr = (*pd)->Register(a.mem, a.capacity, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_TRUE(mr.ok()) << mr.status();
  a.mr = *std::move(mr);
  const uint32_t lkey = a.mr.lkey();
  LargeMemoryCache::Block b = cache.Get(65536);
  mr = (*pd)->Register(b.mem, b.capacity, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_TRUE(mr.ok()) << mr.status();
  b.mr = *std::move(mr);
  cache.Put(std::move(a));
  cache.Put(std::move(b));  // over the cap: freed (its registration with it)
  LargeMemoryCache::Block again = cache.Get(65536);
  ASSERT_TRUE(again.mr.valid());
  EXPECT_EQ(again.mr.lkey(), lkey);
  LargeMemoryCache::Block fresh = cache.Get(65536);  // none idle
  EXPECT_FALSE(fresh.mr.valid());
  cache.Put(std::move(again));
  cache.Put(std::move(fresh));
}

// Rendezvous memory: the cache deregisters what it is given, so that no
// rkey outlives its transfer however the buffer's owner let go of it.
TEST(LargeMemoryCacheTest, DropsRegistrationsUnlessItKeepsThem) {
  auto device =
      transport::Device::Open({.kind = transport::ProviderKind::kSoft});
  ASSERT_TRUE(device.ok()) << device.status();
  auto pd = (*device)->AllocPd();
  ASSERT_TRUE(pd.ok()) << pd.status();
  LargeMemoryCache cache(1 << 20);
  LargeMemoryCache::Block a = cache.Get(65536);
  auto mr = (*pd)->Register(a.mem, a.capacity, IBV_ACCESS_REMOTE_WRITE);
  ASSERT_TRUE(mr.ok()) << mr.status();
  a.mr = *std::move(mr);
  std::byte* const mem = a.mem;
  cache.Put(std::move(a));
  LargeMemoryCache::Block again = cache.Get(65536);
  EXPECT_EQ(again.mem, mem);
  EXPECT_FALSE(again.mr.valid());
  cache.Put(std::move(again));
}

}  // namespace
}  // namespace coverbs::cm::internal
