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

struct Context::Shared {
  uint64_t next_connection_id = 1;
  // Registered send buffers, by buffer size, shared by the connections.
  std::map<size_t, std::unique_ptr<transport::BufferPool>> send_pools;
  // Rendezvous receive memory (a Message holding some may outlive the
  // Context, hence shared).
  std::shared_ptr<internal::LargeMemoryCache> large_memory;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_CONTEXT_SHARED_H_
