#include "cm/large_memory_cache.h"

#include <cstdint>

#include "gtest/gtest.h"

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
    cache.Put(b);
  }
}

TEST(LargeMemoryCacheTest, ReusesTheSameClass) {
  LargeMemoryCache cache(1 << 20);
  LargeMemoryCache::Block a = cache.Get(40000);
  cache.Put(a);
  EXPECT_EQ(cache.idle_bytes(), a.capacity);
  LargeMemoryCache::Block b = cache.Get(33000);  // same 64 KiB class
  EXPECT_EQ(b.mem, a.mem);
  EXPECT_EQ(cache.idle_bytes(), 0u);
  LargeMemoryCache::Block c = cache.Get(33000);  // none idle: a new one
  EXPECT_NE(c.mem, b.mem);
  cache.Put(b);
  cache.Put(c);
}

TEST(LargeMemoryCacheTest, KeepsAtMostTheIdleLimit) {
  LargeMemoryCache cache(128 * 1024);
  LargeMemoryCache::Block a = cache.Get(65536);
  LargeMemoryCache::Block b = cache.Get(65536);
  LargeMemoryCache::Block c = cache.Get(65536);
  cache.Put(a);
  cache.Put(b);
  cache.Put(c);  // over the limit: freed
  EXPECT_EQ(cache.idle_bytes(), 128u * 1024);
  LargeMemoryCache none(0);
  LargeMemoryCache::Block d = none.Get(8192);
  none.Put(d);
  EXPECT_EQ(none.idle_bytes(), 0u);
}

}  // namespace
}  // namespace coverbs::cm::internal
