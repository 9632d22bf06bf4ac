// Internal: page-aligned anonymous memory for the large buffers a
// connection holds -- its receive ring and the landing and rendezvous
// blocks of LargeMemoryCache -- mapped and unmapped directly.
//
// Why not malloc (std::aligned_alloc): glibc serves a request above its
// mmap threshold (128 KiB) with mmap, but the first time such a chunk is
// freed it raises the threshold to that chunk's size. A connection's
// receive ring is 564 KiB with the defaults, so after the first connection
// closed every later ring and every 128 KiB landing block came from the
// per-thread malloc arenas (64 MiB heaps), which keep freed memory
// resident and give it back only from the top of a heap: echo_server's RSS
// climbed 12-17 MB with every round of 224 connections and never came down
// (issue 25; bench/results/rss_rounds_2026-11-27.md). Mapped directly, a
// buffer's pages return to the kernel when it is freed; what is kept for
// reuse is bounded by the cache that keeps it.
//
// Thread-safe. The memory is zero-filled and untouched until written (no
// page is resident before its first use). A mapping below 2 MiB is never
// backed by transparent huge pages, so only the pages written become
// resident (page_memory.cc says why).
#ifndef COVERBS_CM_PAGE_MEMORY_H_
#define COVERBS_CM_PAGE_MEMORY_H_

#include <cstddef>

namespace coverbs::cm::internal {

// `bytes` rounded up to whole 4 KiB pages, page-aligned; nullptr when the
// kernel refuses the mapping (the caller reports ResourceExhausted).
std::byte* MapPages(size_t bytes);
// Gives back what MapPages(bytes) returned (the same `bytes`); nullptr is
// ignored.
void UnmapPages(std::byte* mem, size_t bytes);
// Bytes mapped by MapPages and not yet unmapped, in this process (rounded
// to pages): what the connections and the caches hold.
size_t MappedPageBytes();

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_PAGE_MEMORY_H_
