// Internal: per-Context state owned by the messaging half of the cm layer
// (buffer pools, the shared receive queue, connection ids), created empty by
// Context::Create and filled lazily, and the internal accessors of a
// Context.
#ifndef COVERBS_CM_CONTEXT_SHARED_H_
#define COVERBS_CM_CONTEXT_SHARED_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "cm/context.h"
#include "cm/large_memory_cache.h"
#include "transport/connector.h"
#include "transport/memory.h"

namespace coverbs::cm::internal {

struct SrqPool;  // srq_pool.h
// Destroys the SRQ; the buffers go with the last Message holding one.
void DetachSrqPool(SrqPool* pool);

struct ContextShared {
  ~ContextShared() {
    if (srq_pool != nullptr) DetachSrqPool(srq_pool);
  }
  uint64_t next_connection_id = 1;
  // Registered send buffers, by buffer size, shared by the connections.
  std::map<size_t, std::unique_ptr<transport::BufferPool>> send_pools;
  // Rendezvous receive memory (a Message holding some may outlive the
  // Context, hence shared).
  std::shared_ptr<LargeMemoryCache> large_memory;
  // The shared receive queue and its buffers (ConnectionOptions::use_srq);
  // created by the first connection that asks for it.
  SrqPool* srq_pool = nullptr;
  // CQs created when the first one (Context::cq()) had no room; they go
  // with this struct, after every connection.
  std::vector<std::unique_ptr<transport::CompletionQueue>> more_cqs;
  // A trim of empty CQs is posted to the reactor (ScheduleCqTrim); the
  // token tells it whether this Context still exists.
  bool trim_posted = false;
  std::shared_ptr<int> trim_token = std::make_shared<int>(0);
};

// A completion queue of `ctx` with `entries` unreserved: the first one
// with room, else a new one (ContextOptions::max_cqs). ResourceExhausted
// naming the options when none can be had.
absl::StatusOr<transport::CompletionQueue*> CqWithRoom(Context& ctx,
                                                       int entries);
// After a connection went: soon (on the reactor, outside any poll), the
// CQs added by CqWithRoom that no QP uses any more are destroyed, so a
// burst of connections leaves no descriptors or memory behind.
void ScheduleCqTrim(Context& ctx);

// The parts of a Context only the cm layer uses.
class ContextAccess {
 public:
  static ContextShared& Shared(Context& ctx) { return *ctx.shared_; }
  static const ContextShared& Shared(const Context& ctx) {
    return *ctx.shared_;
  }
  // Establishes the Context's connections (its provider's connector).
  static transport::Connector& Connector(Context& ctx) {
    return *ctx.connector_;
  }
};

inline ContextShared& SharedOf(Context& ctx) {
  return ContextAccess::Shared(ctx);
}
inline transport::Connector& ConnectorOf(Context& ctx) {
  return ContextAccess::Connector(ctx);
}

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_CONTEXT_SHARED_H_
