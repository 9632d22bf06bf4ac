#include "cm/recv_buffers.h"

#include "cm/connection_impl.h"
#include "cm/srq_pool.h"

namespace coverbs::cm::internal {

void RecvSlot::OnRecv(const ibv_wc& wc) {
  if (pool != nullptr) {
    pool->OnRecv(this, wc);
  } else if (ring->conn != nullptr) {
    ring->conn->OnRecv(this, wc);
  }
}

void RecvSlot::Release() {
  if (pool != nullptr) {
    pool->Release(this);
    return;
  }
  RecvRing* r = ring;
  --r->held;
  if (r->conn != nullptr) {
    r->conn->ReturnSlot(this);
  } else {
    r->MaybeDelete();
  }
}

}  // namespace coverbs::cm::internal
