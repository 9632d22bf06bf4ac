// Registered memory off the hot path: a pool of fixed-size registered
// buffers, and a bounded registration cache for user buffers.
#ifndef COVERBS_TRANSPORT_MEMORY_H_
#define COVERBS_TRANSPORT_MEMORY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/sync.h"
#include "core/task.h"
#include "transport/device.h"

namespace coverbs::transport {

// Fixed-size buffers carved from one registration (hugepage-backed when the
// system has free hugepages, else ordinary pages). Get/put are O(1); Get()
// waits (FIFO, cancellable) when the pool is exhausted instead of failing.
// Thread-safe. The pool must outlive its buffers.
class BufferPool {
 public:
  struct Options {
    size_t buffer_size = 8192;
    size_t count = 1024;
    int access = IBV_ACCESS_LOCAL_WRITE;
    bool try_hugepages = true;
    // Ordinary pages only. false: the kernel never backs the pool with
    // transparent huge pages, so a page becomes resident when it is first
    // written, not its whole 2 MiB neighbourhood, zeroed at once. For
    // pools of large buffers that are mostly written in part (the staging
    // buffers of medium messages).
    bool transparent_hugepages = true;
  };

  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& o) noexcept
        : pool_(std::exchange(o.pool_, nullptr)), index_(o.index_) {}
    Buffer& operator=(Buffer&& o) noexcept {
      if (this != &o) {
        Reset();
        pool_ = std::exchange(o.pool_, nullptr);
        index_ = o.index_;
      }
      return *this;
    }
    ~Buffer() { Reset(); }

    bool valid() const { return pool_ != nullptr; }
    std::byte* data() const;
    size_t size() const;
    uint32_t index() const { return index_; }
    // The whole buffer, or its first `len` bytes, as a local SGE.
    LocalBuffer Local(size_t len = static_cast<size_t>(-1)) const;
    // For one-sided access by the peer (needs the matching access flags).
    RemoteRegion Remote() const;
    // Returns the buffer to the pool now.
    void Reset();

   private:
    friend class BufferPool;
    Buffer(BufferPool* p, uint32_t i) : pool_(p), index_(i) {}
    BufferPool* pool_ = nullptr;
    uint32_t index_ = 0;
  };

  static absl::StatusOr<std::unique_ptr<BufferPool>> Create(
      ProtectionDomain& pd, Options options);
  ~BufferPool();

  std::optional<Buffer> TryGet();
  // Yields a buffer, or Cancelled.
  Task<absl::StatusOr<Buffer>> Get();

  size_t available() const { return sem_.available(); }
  size_t capacity() const { return options_.count; }
  size_t buffer_size() const { return options_.buffer_size; }
  bool hugepage_backed() const { return hugepages_; }
  const MemoryRegion& region() const { return mr_; }

 private:
  BufferPool(Options o) : options_(o), sem_(0) {}
  void Put(uint32_t index);
  void Push(uint32_t index);
  uint32_t Pop();

  Options options_;
  void* mem_ = nullptr;
  size_t mapped_ = 0;
  bool hugepages_ = false;
  MemoryRegion mr_;
  // Free indices: a lock-free stack (memory.cc says why and how).
  std::atomic<uint64_t> head_{0};
  std::unique_ptr<std::atomic<uint32_t>[]> next_;
  Semaphore sem_;               // counts free buffers; waiters queue FIFO
};

// A bounded cache of registrations for caller-owned buffers, keyed by
// address range and access. A lookup that falls inside an existing
// registration with at least the requested access is a hit. Registrations
// are handed out as shared_ptr: evicting or invalidating one that an
// operation still uses defers the deregistration until it is released.
// Call Invalidate() before freeing / unmapping registered memory.
// Not thread-safe: one cache per reactor.
class RegistrationCache {
 public:
  RegistrationCache(ProtectionDomain& pd, size_t max_entries = 256)
      : pd_(pd), max_entries_(max_entries) {}

  absl::StatusOr<std::shared_ptr<const MemoryRegion>> Get(const void* addr,
                                                          size_t length,
                                                          int access);
  // Drops every registration overlapping [addr, addr+length).
  size_t Invalidate(const void* addr, size_t length);

  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  uint64_t evictions() const { return evictions_; }
  size_t size() const { return lru_.size(); }

 private:
  struct Entry {
    uintptr_t start;
    size_t length;
    int access;
    std::shared_ptr<const MemoryRegion> mr;
  };
  ProtectionDomain& pd_;
  size_t max_entries_;
  std::list<Entry> lru_;  // most recently used first
  uint64_t hits_ = 0, misses_ = 0, evictions_ = 0;
};

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_MEMORY_H_
