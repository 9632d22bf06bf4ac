#include "cm/large_memory_cache.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <utility>

#include "cm/page_memory.h"

namespace coverbs::cm::internal {
namespace {

void Free(LargeMemoryCache::Block& b) {
  b.mr.Deregister();  // before the memory goes: no key outlives it
  UnmapPages(b.mem, b.capacity);
}

}  // namespace

LargeMemoryCache::LargeMemoryCache(
    size_t max_idle_bytes, bool keep_registrations,
    std::chrono::steady_clock::duration working_set_window)
    : max_idle_bytes_(max_idle_bytes),
      keep_registrations_(keep_registrations),
      window_(working_set_window),
      window_start_(std::chrono::steady_clock::now()) {}

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
      peak_now_ = std::max(peak_now_, in_use_bytes_);
      return b;
    }
  }
  Block b;
  b.mem = MapPages(capacity);
  if (b.mem == nullptr) return b;
  b.capacity = capacity;
  std::lock_guard<std::mutex> l(mu_);
  in_use_bytes_ += capacity;
  peak_now_ = std::max(peak_now_, in_use_bytes_);
  return b;
}

void LargeMemoryCache::Put(Block b) {
  if (b.mem == nullptr) return;
  if (!keep_registrations_) b.mr.Deregister();
  // The working set: the most in use at once in this window and the one
  // before it (a clock read per Put; Put is once per large message).
  const auto now = std::chrono::steady_clock::now();
  std::vector<Block> drop;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (now - window_start_ >= window_) {
      // (This block was in use until now: counted in the new window.)
      peak_before_ =
          now - window_start_ < 2 * window_ ? peak_now_ : 0;
      peak_now_ = in_use_bytes_;
      window_start_ = now;
    }
    in_use_bytes_ -= b.capacity;
    if (idle_bytes_ + b.capacity <= max_idle_bytes_) {
      idle_bytes_ += b.capacity;
      free_[ClassOf(b.capacity)].push_back(std::move(b));
    } else {
      drop.push_back(std::move(b));
    }
    // Idle and in use together within the working set, or idle within
    // what is in use when that is more; nothing in use: one block of each
    // class stays.
    const size_t working_set = std::max(peak_now_, peak_before_);
    const size_t keep =
        in_use_bytes_ == 0
            ? 0
            : std::max(in_use_bytes_, working_set > in_use_bytes_
                                          ? working_set - in_use_bytes_
                                          : 0);
    for (int c = kClasses - 1; c >= 0 && idle_bytes_ > keep; --c) {
      const size_t capacity = size_t{1} << (c + kMinShift);
      while (free_[c].size() > 1 && idle_bytes_ > keep) {
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
