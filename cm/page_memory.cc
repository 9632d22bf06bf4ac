#include "cm/page_memory.h"

#include <sys/mman.h>

#include <atomic>

namespace coverbs::cm::internal {
namespace {

std::atomic<size_t> g_mapped_bytes{0};

size_t PageRound(size_t bytes) { return (bytes + 4095) & ~size_t{4095}; }

}  // namespace

std::byte* MapPages(size_t bytes) {
  const size_t len = PageRound(bytes);
  if (len == 0) return nullptr;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  g_mapped_bytes.fetch_add(len, std::memory_order_relaxed);
  return static_cast<std::byte*>(m);
}

void UnmapPages(std::byte* mem, size_t bytes) {
  if (mem == nullptr) return;
  const size_t len = PageRound(bytes);
  munmap(mem, len);
  g_mapped_bytes.fetch_sub(len, std::memory_order_relaxed);
}

size_t MappedPageBytes() {
  return g_mapped_bytes.load(std::memory_order_relaxed);
}

}  // namespace coverbs::cm::internal
