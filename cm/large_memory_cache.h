// Internal: page-aligned memory for rendezvous receive buffers, kept after
// use so that the next transfer of a similar size lands in pages that are
// already mapped.
//
// Why: a fresh 1 MiB allocation is an mmap whose 256 pages fault in while
// the NIC (or the soft provider's progress thread) writes them, and free()
// unmaps them again; measured on the soft provider, page faults were most
// of the CPU time of a 1 MiB echo. Only the memory is cached: each transfer
// still registers its buffer and deregisters it when the transfer ends, so
// an rkey stays valid for exactly one transfer.
//
// Landing grants on a device with memory windows use a second instance
// whose blocks keep their registration (local write and MW_BIND only: no
// remote access but through a window bound per message), so that a medium
// message costs no registration at all.
//
// The memory is mapped (page_memory.h), so a freed block's pages go back to
// the kernel at once.
//
// Thread-safe (a Message, which owns its buffer, may be destroyed on any
// thread). Shared by the connections of a Worker; outlives them through
// shared_ptr because a Message may outlive its Connection and Worker.
#ifndef COVERBS_CM_LARGE_MEMORY_CACHE_H_
#define COVERBS_CM_LARGE_MEMORY_CACHE_H_

#include <cstddef>
#include <chrono>
#include <mutex>
#include <vector>

#include "transport/device.h"

namespace coverbs::cm::internal {

class LargeMemoryCache {
 public:
  struct Block {
    std::byte* mem = nullptr;  // nullptr: out of memory
    size_t capacity = 0;
    // The block's registration, in a cache that keeps them (Put stores
    // it; a block freed beyond the cap is deregistered first).
    transport::MemoryRegion mr;
  };

  // Keeps idle blocks for reuse within two bounds: at most max_idle_bytes
  // in all; and, while blocks are in use (out of Get and not yet Put), the
  // working set: idle and in use together at most the most bytes in use at
  // once over the last second or so (kWorkingSetWindow), or twice what is
  // in use now if that is more. When nothing is in use, one block per size
  // class stays. Put frees what exceeds them, from the largest classes down.
  // Why the working set: a burst of connections (on soft, each landing
  // grant is a block, 32 per connection by default) left max_idle_bytes
  // per Worker mapped after its connections had closed; tied to the
  // working set, the cache shrinks with it, and one transfer after another
  // still reuses its block. Why over a window, not the bytes in use at
  // that instant: a client with 16 calls of 1 MiB in flight holds 0 to 4
  // response blocks from moment to moment; trimmed to the instant, ~1 in 5
  // transfers landed in freshly mapped pages (55 page faults per call, 25 %
  // of the calls/s).
  // A cache made with keep_registrations stores a block's registration
  // with it; any other deregisters what Put is given (a rendezvous
  // buffer's rkey ends with its transfer).
  // `working_set_window`: how long a peak of bytes in use is remembered
  // (one to two windows; tests pass a long one so that no clock matters).
  static constexpr std::chrono::milliseconds kWorkingSetWindow{1000};
  explicit LargeMemoryCache(
      size_t max_idle_bytes, bool keep_registrations = false,
      std::chrono::steady_clock::duration working_set_window =
          kWorkingSetWindow);
  ~LargeMemoryCache();
  LargeMemoryCache(const LargeMemoryCache&) = delete;

  // A block of at least `size` bytes (capacity: size rounded up to a power
  // of two, at least 4 KiB), cached if one is idle; mem is nullptr when no
  // memory could be mapped. Every block from Get goes back through Put.
  Block Get(size_t size);
  void Put(Block b);
  // The capacity Get(size) gives: `size` rounded up to a power of two, at
  // least 4 KiB (what a rendezvous of `size` bytes pins).
  static size_t BlockSize(size_t size) {
    return size_t{1} << (ClassOf(size) + kMinShift);
  }

  size_t idle_bytes() const;
  // Bytes of the blocks out of Get and not yet Put.
  size_t in_use_bytes() const;

 private:
  static int ClassOf(size_t size);
  static constexpr int kMinShift = 12;
  static constexpr int kClasses = 64 - kMinShift;

  const size_t max_idle_bytes_;
  const bool keep_registrations_;
  mutable std::mutex mu_;
  size_t idle_bytes_ = 0;
  size_t in_use_bytes_ = 0;
  // The most bytes in use at once in the current window and in the one
  // before it (the working set), and when the current one began.
  const std::chrono::steady_clock::duration window_;
  size_t peak_now_ = 0;
  size_t peak_before_ = 0;
  std::chrono::steady_clock::time_point window_start_{};
  std::vector<Block> free_[kClasses];
};

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_LARGE_MEMORY_CACHE_H_
