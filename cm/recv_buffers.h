// Internal: the memory behind received messages -- a connection's receive
// ring, the slots of the Worker's shared receive queue, rendezvous buffers.
#ifndef COVERBS_CM_RECV_BUFFERS_H_
#define COVERBS_CM_RECV_BUFFERS_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "cm/large_memory_cache.h"
#include "cm/page_memory.h"
#include "core/frame_pool.h"
#include "transport/device.h"
#include "transport/queue_pair.h"

namespace coverbs::cm::internal {

using transport::LocalBuffer;
using transport::MemoryRegion;
using transport::RemoteRegion;

// Memory behind a Message.
class MessageBuffer {
 public:
  virtual void Release() = 0;

 protected:
  ~MessageBuffer() = default;
};

class ConnectionImpl;
struct RecvRing;
struct SrqPool;

// One receive buffer: of a connection's ring, or of the Worker's SRQ pool.
struct RecvSlot final : transport::RecvHandler, MessageBuffer {
  RecvRing* ring = nullptr;  // ring mode
  SrqPool* pool = nullptr;   // SRQ mode
  std::byte* data = nullptr;
  // SRQ mode only.
  uint32_t lkey = 0;
  bool posted = false;   // in the SRQ
  bool held = false;     // owned by a Message
  uint64_t conn_id = 0;  // the connection a held message arrived on
  void OnRecv(const ibv_wc& wc) override;
  void Release() override;
};

// The receive ring: one registration carved into equal slots. Shared by the
// connection and the Messages that still hold slots, so a Message may
// outlive its Connection: the ring goes away with the last of them (the QP
// is closed by then, so the NIC no longer writes into it). Its memory is
// mapped (MapPages), so its pages go back to the kernel with it.
struct RecvRing {
  ConnectionImpl* conn = nullptr;  // null once the connection is gone
  std::byte* mem = nullptr;
  size_t mem_size = 0;
  size_t slot_size = 0;
  MemoryRegion mr;
  std::vector<RecvSlot> slots;
  uint32_t held = 0;  // slots owned by Messages

  // What a receive into `s` (one of `slots`) posts.
  LocalBuffer Buffer(const RecvSlot& s) const {
    return {s.data, static_cast<uint32_t>(slot_size), mr.lkey()};
  }
  ~RecvRing() {
    mr.Deregister();
    UnmapPages(mem, mem_size);
  }
  void MaybeDelete() {
    if (conn == nullptr && held == 0) delete this;
  }
};

// A rendezvous receive buffer. Registered for REMOTE_WRITE only while its
// transfer runs; the Message then owns plain memory.
// The memory comes from (and returns to) the Worker's LargeMemoryCache;
// deregistering first guarantees the NIC no longer touches it.
struct LargeBuffer final : MessageBuffer {
  std::byte* mem = nullptr;
  size_t size = 0;
  MemoryRegion mr;
  std::shared_ptr<LargeMemoryCache> cache;
  size_t capacity = 0;
  // A landing grant by memory window (landing.cc): `window` gives the peer
  // access for one message, and `mr` is the block's lasting registration
  // (local write and MW_BIND only), which goes back to `cache` with it
  // (the Worker's landing cache keeps registrations; the rendezvous cache
  // deregisters them).
  transport::MemoryWindow window;
  ~LargeBuffer() {
    window = {};  // ends the peer's access before the memory is reused
    cache->Put({mem, capacity, std::move(mr)});
  }
  void Release() override { delete this; }
  // One per medium or large message received: from the frame pool's
  // per-thread lists rather than malloc.
  static void* operator new(size_t n) {
    return coverbs::internal::AllocFrame(n);
  }
  static void operator delete(void* p, size_t n) noexcept {
    coverbs::internal::FreeFrame(p, n);
  }
};

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_RECV_BUFFERS_H_
