#include "transport/memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"

namespace coverbs::transport {

namespace {
constexpr size_t kHugePage = 2u << 20;
size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }
}  // namespace

absl::StatusOr<std::unique_ptr<BufferPool>> BufferPool::Create(
    ProtectionDomain& pd, Options options) {
  if (options.buffer_size == 0 || options.count == 0 ||
      options.count > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "BufferPool: bad geometry (%u buffers of %u bytes)", options.count,
        options.buffer_size));
  }
  std::unique_ptr<BufferPool> p(new BufferPool(options));
  size_t bytes = options.buffer_size * options.count;
  if (options.try_hugepages) {
    size_t len = RoundUp(bytes, kHugePage);
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (m != MAP_FAILED) {
      p->mem_ = m;
      p->mapped_ = len;
      p->hugepages_ = true;
    }
  }
  if (p->mem_ == nullptr) {  // no hugepages reserved: ordinary pages
    size_t len = RoundUp(bytes, 4096);
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "BufferPool: mmap of %u bytes failed: %s", len, strerror(errno)));
    }
    p->mem_ = m;
    p->mapped_ = len;
    // Advice only: a kernel without THP ignores it or fails it harmlessly.
    if (!options.transparent_hugepages) madvise(m, len, MADV_NOHUGEPAGE);
  }
  auto mr = pd.Register(p->mem_, bytes, options.access);
  if (!mr.ok()) return mr.status();
  p->mr_ = *std::move(mr);
  p->next_ = std::make_unique<std::atomic<uint32_t>[]>(options.count);
  for (size_t i = options.count; i-- > 0;) {
    p->Push(static_cast<uint32_t>(i));
  }
  p->sem_.Release(options.count);
  return p;
}

BufferPool::~BufferPool() {
  mr_.Deregister();
  if (mem_ != nullptr) munmap(mem_, mapped_);
}

// A Treiber stack of indices. The head packs (tag << 32 | index + 1) so
// that a pop racing with a pop + push of the same buffer (ABA) fails its
// compare-and-swap; next_ is a fixed array, so nothing is ever freed under a
// reader. A buffer is taken or returned at the message rate, from the
// owning reactor and (Buffers may be released anywhere) from others: a
// mutex here cost ~70 instructions of its own per get and per put.
void BufferPool::Push(uint32_t index) {
  uint64_t old = head_.load(std::memory_order_relaxed);
  uint64_t next;
  do {
    next_[index].store(static_cast<uint32_t>(old), std::memory_order_relaxed);
    next = (((old >> 32) + 1) << 32) | (uint64_t{index} + 1);
    // Release: whoever pops the index sees what was written before.
  } while (!head_.compare_exchange_weak(old, next, std::memory_order_release,
                                        std::memory_order_relaxed));
}

uint32_t BufferPool::Pop() {
  // The caller holds a permit of sem_, so the stack is not empty: a permit
  // is released only after its index was pushed.
  uint64_t old = head_.load(std::memory_order_acquire);
  for (;;) {
    uint32_t top = static_cast<uint32_t>(old) - 1;
    uint64_t next =
        (((old >> 32) + 1) << 32) | next_[top].load(std::memory_order_relaxed);
    if (head_.compare_exchange_weak(old, next, std::memory_order_acquire,
                                    std::memory_order_acquire)) {
      return top;
    }
  }
}

void BufferPool::Put(uint32_t index) {
  Push(index);
  sem_.Release();
}

std::optional<BufferPool::Buffer> BufferPool::TryGet() {
  if (!sem_.TryAcquire()) return std::nullopt;
  return Buffer(this, Pop());
}

Task<absl::StatusOr<BufferPool::Buffer>> BufferPool::Get() {
  absl::Status s = co_await sem_.Acquire();
  if (!s.ok()) co_return s;
  co_return Buffer(this, Pop());
}

std::byte* BufferPool::Buffer::data() const {
  return static_cast<std::byte*>(pool_->mem_) +
         static_cast<size_t>(index_) * pool_->options_.buffer_size;
}

size_t BufferPool::Buffer::size() const { return pool_->options_.buffer_size; }

LocalBuffer BufferPool::Buffer::Local(size_t len) const {
  return pool_->mr_.Local(
      static_cast<size_t>(index_) * pool_->options_.buffer_size,
      std::min(len, pool_->options_.buffer_size));
}

RemoteRegion BufferPool::Buffer::Remote() const {
  return pool_->mr_.Remote(
      static_cast<size_t>(index_) * pool_->options_.buffer_size,
      pool_->options_.buffer_size);
}

void BufferPool::Buffer::Reset() {
  if (pool_ != nullptr) {
    pool_->Put(index_);
    pool_ = nullptr;
  }
}

absl::StatusOr<std::shared_ptr<const MemoryRegion>> RegistrationCache::Get(
    const void* addr, size_t length, int access) {
  if (access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) {
    access |= IBV_ACCESS_LOCAL_WRITE;
  }
  uintptr_t start = reinterpret_cast<uintptr_t>(addr);
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    if (it->start <= start && start + length <= it->start + it->length &&
        (it->access & access) == access) {
      ++hits_;
      lru_.splice(lru_.begin(), lru_, it);
      return lru_.front().mr;
    }
  }
  ++misses_;
  auto mr = pd_.Register(const_cast<void*>(addr), length, access);
  if (!mr.ok()) return mr.status();
  auto shared = std::make_shared<const MemoryRegion>(*std::move(mr));
  lru_.push_front(Entry{start, length, access, shared});
  while (lru_.size() > max_entries_) {
    lru_.pop_back();  // deregistered when its last user lets go
    ++evictions_;
  }
  return shared;
}

size_t RegistrationCache::Invalidate(const void* addr, size_t length) {
  uintptr_t start = reinterpret_cast<uintptr_t>(addr);
  size_t n = 0;
  for (auto it = lru_.begin(); it != lru_.end();) {
    bool overlap = it->start < start + length && start < it->start + it->length;
    if (overlap) {
      it = lru_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

}  // namespace coverbs::transport
