// Internal: per-Context state owned by the messaging half of the cm layer
// (buffer pools, the shared receive queue, connection ids). Created empty by
// Context::Create; connection.cc fills it lazily.
#ifndef COVERBS_CM_CONTEXT_SHARED_H_
#define COVERBS_CM_CONTEXT_SHARED_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "cm/context.h"
#include "cm/large_memory_cache.h"
#include "transport/memory.h"

namespace coverbs::cm {
namespace internal {
struct SrqPool;  // connection.cc
// Destroys the SRQ; the buffers go with the last Message holding one.
void DetachSrqPool(SrqPool* pool);
}  // namespace internal

struct Context::Shared {
  ~Shared() {
    if (srq_pool != nullptr) internal::DetachSrqPool(srq_pool);
  }
  uint64_t next_connection_id = 1;
  // Registered send buffers, by buffer size, shared by the connections.
  std::map<size_t, std::unique_ptr<transport::BufferPool>> send_pools;
  // Rendezvous receive memory (a Message holding some may outlive the
  // Context, hence shared).
  std::shared_ptr<internal::LargeMemoryCache> large_memory;
  // The shared receive queue and its buffers (ConnectionOptions::use_srq);
  // created by the first connection that asks for it.
  internal::SrqPool* srq_pool = nullptr;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_CONTEXT_SHARED_H_
