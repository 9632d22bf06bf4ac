#include "cm/large_memory_cache.h"

#include <bit>
#include <utility>

#include "cm/page_memory.h"

namespace coverbs::cm::internal {
namespace {

void Free(LargeMemoryCache::Block& b) {
  b.mr.Deregister();  // before the memory goes: no key outlives it
  UnmapPages(b.mem, b.capacity);
}

}  // namespace

LargeMemoryCache::LargeMemoryCache(size_t max_idle_bytes,
                                   bool keep_registrations)
    : max_idle_bytes_(max_idle_bytes),
      keep_registrations_(keep_registrations) {}

LargeMemoryCache::~LargeMemoryCache() {
  for (auto& list : free_) {
    for (Block& b : list) Free(b);
  }
}

int LargeMemoryCache::ClassOf(size_t size) {
  if (size <= (size_t{1} << kMinShift)) return 0;
  return static_cast<int>(std::bit_width(size - 1)) - kMinShift;
}

LargeMemoryCache::Block LargeMemoryCache::Get(size_t size) {
  const int c = ClassOf(size);
  const size_t capacity = size_t{1} << (c + kMinShift);
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!free_[c].empty()) {
      Block b = std::move(free_[c].back());
      free_[c].pop_back();
      idle_bytes_ -= capacity;
      in_use_bytes_ += capacity;
      return b;
    }
  }
  Block b;
  b.mem = MapPages(capacity);
  if (b.mem == nullptr) return b;
  b.capacity = capacity;
  std::lock_guard<std::mutex> l(mu_);
  in_use_bytes_ += capacity;
  return b;
}

void LargeMemoryCache::Put(Block b) {
  if (b.mem == nullptr) return;
  if (!keep_registrations_) b.mr.Deregister();
  std::vector<Block> drop;
  {
    std::lock_guard<std::mutex> l(mu_);
    in_use_bytes_ -= b.capacity;
    if (idle_bytes_ + b.capacity <= max_idle_bytes_) {
      idle_bytes_ += b.capacity;
      free_[ClassOf(b.capacity)].push_back(std::move(b));
    } else {
      drop.push_back(std::move(b));
    }
    // Idle beyond the working set: all but one block of each class goes.
    for (int c = kClasses - 1; c >= 0 && idle_bytes_ > in_use_bytes_; --c) {
      const size_t capacity = size_t{1} << (c + kMinShift);
      while (free_[c].size() > 1 && idle_bytes_ > in_use_bytes_) {
        drop.push_back(std::move(free_[c].back()));
        free_[c].pop_back();
        idle_bytes_ -= capacity;
      }
    }
  }
  for (Block& d : drop) Free(d);  // outside the lock: munmap is a syscall
}

size_t LargeMemoryCache::idle_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return idle_bytes_;
}

size_t LargeMemoryCache::in_use_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return in_use_bytes_;
}

}  // namespace coverbs::cm::internal
