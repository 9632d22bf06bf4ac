// core/frame_pool.h: coroutine frames come back from the thread's free list
// (same size class -> same memory), the cache per class is bounded, frames
// freed on another thread are taken there, large frames bypass the lists,
// and Task frames go through it.
#include "core/frame_pool.h"

#include <set>
#include <thread>
#include <vector>

#include "core/reactor.h"
#include "core/task.h"
#include "gtest/gtest.h"

namespace coverbs::internal {
namespace {

#if COVERBS_FRAME_POOL

TEST(FramePoolTest, AFreedFrameIsReusedForTheSameSizeClass) {
  void* a = AllocFrame(200);
  FreeFrame(a, 200);
  // 200 and 250 share the 256-byte class.
  void* b = AllocFrame(250);
  EXPECT_EQ(a, b);
  // Another class does not take it.
  FreeFrame(b, 250);
  void* c = AllocFrame(600);
  EXPECT_NE(c, b);
  FreeFrame(c, 600);
}

TEST(FramePoolTest, TheCacheIsBoundedPerClass) {
  std::vector<void*> frames;
  for (uint32_t i = 0; i < 3 * kFramesPerClass; ++i) {
    frames.push_back(AllocFrame(128));
  }
  for (void* f : frames) FreeFrame(f, 128);
  EXPECT_EQ(tls_frame_lists.count[2], kFramesPerClass);
  // Taking them all back empties the list; then new memory comes.
  std::set<void*> again;
  for (uint32_t i = 0; i < kFramesPerClass; ++i) again.insert(AllocFrame(128));
  EXPECT_EQ(tls_frame_lists.count[2], 0u);
  for (void* f : again) FreeFrame(f, 128);
}

TEST(FramePoolTest, LargeFramesBypassTheLists) {
  uint32_t before = tls_frame_lists.count[kFrameClasses - 1];
  void* big = AllocFrame(kMaxPooledFrame + 1);
  FreeFrame(big, kMaxPooledFrame + 1);
  EXPECT_EQ(tls_frame_lists.count[kFrameClasses - 1], before);
}

TEST(FramePoolTest, AFrameFreedOnAnotherThreadJoinsThatThreadsList) {
  void* f = AllocFrame(300);
  uint32_t mine = tls_frame_lists.count[5];
  std::thread t([f] {
    FreeFrame(f, 300);
    EXPECT_EQ(tls_frame_lists.count[5], 1u);
    EXPECT_EQ(AllocFrame(300), f);  // reused there
    FreeFrame(f, 300);
  });  // its list is released when it exits
  t.join();
  EXPECT_EQ(tls_frame_lists.count[5], mine);
}

Task<int> Leaf(int v) { co_return v + 1; }

TEST(FramePoolTest, TaskFramesComeFromThePool) {
  auto r = Reactor::Create();
  ASSERT_TRUE(r.ok());
  // A frame's memory returns to the list when the Task is destroyed, and
  // the next Task of the same coroutine gets it again.
  auto run = [](int v) -> Task<int> { co_return co_await Leaf(v); };
  EXPECT_EQ((*r)->BlockOn(run(1)), 2);
  size_t cached = 0;
  for (size_t c = 0; c < kFrameClasses; ++c) cached += tls_frame_lists.count[c];
  EXPECT_GT(cached, 0u);
  EXPECT_EQ((*r)->BlockOn(run(2)), 3);
  size_t after = 0;
  for (size_t c = 0; c < kFrameClasses; ++c) after += tls_frame_lists.count[c];
  EXPECT_EQ(after, cached);  // reused, not grown
}

#else

TEST(FramePoolTest, OffUnderSanitizers) {
  // ASan and TSan must see every frame's allocation and release: the pool
  // hands frames straight to operator new/delete.
  void* a = AllocFrame(200);
  FreeFrame(a, 200);
  EXPECT_EQ(tls_frame_lists.count[4], 0u);
}

#endif

}  // namespace
}  // namespace coverbs::internal
