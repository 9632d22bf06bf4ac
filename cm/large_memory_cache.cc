#include "cm/large_memory_cache.h"

#include <bit>
#include <cstdlib>
#include <utility>

namespace coverbs::cm::internal {

LargeMemoryCache::LargeMemoryCache(size_t max_idle_bytes,
                                   bool keep_registrations)
    : max_idle_bytes_(max_idle_bytes),
      keep_registrations_(keep_registrations) {}

LargeMemoryCache::~LargeMemoryCache() {
  for (auto& list : free_) {
    for (Block& b : list) {
      b.mr.Deregister();
      std::free(b.mem);
    }
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
      return b;
    }
  }
  Block b;
  b.mem = static_cast<std::byte*>(std::aligned_alloc(4096, capacity));
  b.capacity = capacity;
  return b;
}

void LargeMemoryCache::Put(Block b) {
  if (b.mem == nullptr) return;
  if (!keep_registrations_) b.mr.Deregister();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (idle_bytes_ + b.capacity <= max_idle_bytes_) {
      idle_bytes_ += b.capacity;
      free_[ClassOf(b.capacity)].push_back(std::move(b));
      return;
    }
  }
  b.mr.Deregister();
  std::free(b.mem);
}

size_t LargeMemoryCache::idle_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return idle_bytes_;
}

}  // namespace coverbs::cm::internal
