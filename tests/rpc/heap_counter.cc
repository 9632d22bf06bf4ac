#include "tests/rpc/heap_counter.h"

#include <malloc.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

// What a block takes from the allocator: its usable size and glibc's
// chunk header (the costs rpc/codec_msgpack.h's MallocCost models).
int64_t BlockBytes(void* p) {
  return static_cast<int64_t>(malloc_usable_size(p) + sizeof(size_t));
}

void* CountedNew(size_t n, size_t align) {
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (n + align - 1) / align * align)
                : std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  const int64_t size = BlockBytes(p);
  const int64_t now = g_live.fetch_add(size) + size;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void CountedDelete(void* p) {
  if (p == nullptr) return;
  g_live.fetch_sub(BlockBytes(p));
  std::free(p);
}

}  // namespace

void* operator new(size_t n) { return CountedNew(n, 0); }
void* operator new[](size_t n) { return CountedNew(n, 0); }
void* operator new(size_t n, std::align_val_t a) {
  return CountedNew(n, static_cast<size_t>(a));
}
void* operator new[](size_t n, std::align_val_t a) {
  return CountedNew(n, static_cast<size_t>(a));
}
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return CountedNew(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  try {
    return CountedNew(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { CountedDelete(p); }
void operator delete[](void* p) noexcept { CountedDelete(p); }
void operator delete(void* p, size_t) noexcept { CountedDelete(p); }
void operator delete[](void* p, size_t) noexcept { CountedDelete(p); }
void operator delete(void* p, std::align_val_t) noexcept { CountedDelete(p); }
void operator delete[](void* p, std::align_val_t) noexcept { CountedDelete(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept {
  CountedDelete(p);
}
void operator delete[](void* p, size_t, std::align_val_t) noexcept {
  CountedDelete(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  CountedDelete(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  CountedDelete(p);
}

namespace coverbs::rpc::testing {

int64_t HeapLive() { return g_live.load(); }

int64_t PeakHeapDuring(const std::function<void()>& fn) {
  const int64_t before = g_live.load();
  g_peak.store(before);
  fn();
  return g_peak.load() - before;
}

}  // namespace coverbs::rpc::testing
