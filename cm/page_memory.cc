#include "cm/page_memory.h"

#include <sys/mman.h>

#include <atomic>

namespace coverbs::cm::internal {
namespace {

std::atomic<size_t> g_mapped_bytes{0};

size_t PageRound(size_t bytes) { return (bytes + 4095) & ~size_t{4095}; }

// A transparent huge page (2 MiB on x86-64) is faulted in and zeroed whole.
constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

std::byte* MapPages(size_t bytes) {
  const size_t len = PageRound(bytes);
  if (len == 0) return nullptr;
  void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  if (len < kHugePage) {
    // Smaller mappings lie next to each other (a connection's 32 landing
    // blocks of 128 KiB, its ring) and the kernel merges them into one
    // area, where with THP "always" the first write into any of them
    // faults in and zeroes a whole huge page, though an 8 KiB message
    // writes 2 pages of its 128 KiB grant: echo_server with 8 connections
    // of 8 KiB echoes held 45 MB resident instead of 15 MB. Faulted page by
    // page, only what is written becomes resident. Advice only: an error
    // is ignored.
    madvise(m, len, MADV_NOHUGEPAGE);
  }
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
