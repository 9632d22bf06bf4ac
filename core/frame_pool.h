// Coroutine frames from per-thread free lists.
//
// Why: every co_await of a coroutine (Task<T>) allocates its frame; a 64 B
// echo RPC runs about 14 of them per side, and under callgrind malloc/free
// (with the arena lock a threaded process takes) cost more instructions per
// call than all of coverbs' own code (bench/RESULTS.md, issue 13). Frames
// of the same few sizes come and go at the message rate, so a free list per
// thread and size class serves them without malloc: a pop to allocate, a
// push to free.
//
// Contract: AllocFrame(n) returns memory for n bytes, aligned like operator
// new; FreeFrame(p, n) takes it back with the same n, on any thread (a frame
// freed on another thread joins that thread's lists -- plain heap memory,
// so it does not matter where it came from). At most kFramesPerClass frames
// per size class stay cached per thread; the rest and frames above
// kMaxPooledFrame go to operator new/delete. A thread's cache is released
// when it exits. Off under AddressSanitizer and ThreadSanitizer, which must
// see every frame's allocation and release.
#ifndef COVERBS_CORE_FRAME_POOL_H_
#define COVERBS_CORE_FRAME_POOL_H_

#include <cstddef>
#include <cstdint>
#include <new>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define COVERBS_FRAME_POOL 0
#else
#define COVERBS_FRAME_POOL 1
#endif

namespace coverbs::internal {

inline constexpr size_t kFrameGranule = 64;
inline constexpr size_t kFrameClasses = 33;  // class c holds c * 64 bytes
inline constexpr size_t kMaxPooledFrame = (kFrameClasses - 1) * kFrameGranule;
inline constexpr uint32_t kFramesPerClass = 64;

struct FrameNode {
  FrameNode* next;
};

// Trivially destructible, so it stays usable while the thread's other
// thread_local objects are destroyed (a frame freed then is still taken).
struct FrameLists {
  FrameNode* head[kFrameClasses];
  uint32_t count[kFrameClasses];
  bool released;  // the thread is exiting: no more caching
};
inline thread_local FrameLists tls_frame_lists{};

// Frees a thread's cached frames when it exits.
struct FrameListsReleaser {
  bool armed = false;
  ~FrameListsReleaser() {
    FrameLists& l = tls_frame_lists;
    l.released = true;
    for (size_t c = 0; c < kFrameClasses; ++c) {
      while (FrameNode* f = l.head[c]) {
        l.head[c] = f->next;
        ::operator delete(f);
      }
      l.count[c] = 0;
    }
  }
};
inline thread_local FrameListsReleaser tls_frame_releaser;

inline void* AllocFrame(size_t n) {
#if COVERBS_FRAME_POOL
  if (n <= kMaxPooledFrame) {
    size_t c = (n + kFrameGranule - 1) / kFrameGranule;
    FrameLists& l = tls_frame_lists;
    if (FrameNode* f = l.head[c]) {
      l.head[c] = f->next;
      --l.count[c];
      return f;
    }
    // The first frame on this thread arms the releaser (a thread_local
    // with a destructor is constructed on first use).
    if (!tls_frame_releaser.armed) tls_frame_releaser.armed = true;
    return ::operator new(c* kFrameGranule);
  }
#endif
  return ::operator new(n);
}

inline void FreeFrame(void* p, size_t n) noexcept {
#if COVERBS_FRAME_POOL
  if (n <= kMaxPooledFrame) {
    size_t c = (n + kFrameGranule - 1) / kFrameGranule;
    FrameLists& l = tls_frame_lists;
    if (!l.released && l.count[c] < kFramesPerClass) {
      auto* f = static_cast<FrameNode*>(p);
      f->next = l.head[c];
      l.head[c] = f;
      ++l.count[c];
      return;
    }
  }
#endif
  ::operator delete(p);
}

// An allocator on the same lists, for allocate_shared of small objects made
// at the message rate (one control block and object per allocation).
template <typename T>
struct FramePoolAllocator {
  using value_type = T;
  FramePoolAllocator() = default;
  template <typename U>
  FramePoolAllocator(const FramePoolAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(AllocFrame(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { FreeFrame(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const FramePoolAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace coverbs::internal

#endif  // COVERBS_CORE_FRAME_POOL_H_
