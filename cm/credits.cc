// The credit window: receives reposted become credits owed to the peer,
// returned on headers or by credit messages (which also carry landing
// grants); with an SRQ, lent and taken back as the peer's demand changes.

#include <algorithm>
#include <array>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cm/connection_impl.h"
#include "cm/recv_buffers.h"
#include "cm/srq_pool.h"

namespace coverbs::cm::internal {

Task<void> ConnectionImpl::SendCreditMessage() {
  // Credit messages use the kCreditReserve receives the peer posted beyond
  // its credits, so returning credits never waits for credits.
  absl::Status s;
  while ((to_return_ > 0 || grants_unsent_ > 0) && status_.ok() && !closing_ &&
         credit_msgs_sent_ - credit_msgs_acked_ < kCreditReserve) {
    if (!may_send_.is_set()) break;
    auto buf = co_await GetSendBuffer();
    if (!buf.ok()) {
      s = buf.status();
      break;
    }
    // Receives released since are posted now and ride along: the credits
    // go back in this message rather than the next one.
    if (!FlushRefill()) break;
    if ((to_return_ == 0 && grants_unsent_ == 0) || !status_.ok()) break;
    s = co_await SendCreditFrame(*buf, 0);
    if (!s.ok()) break;
    // Keep going only if a lot accumulated meanwhile.
    if (to_return_ + refill_n_ < ReturnThreshold() && !GrantsDue()) break;
  }
  credit_msg_running_ = false;
  FailInternalSend(s, "a credit message");
}

Task<absl::Status> ConnectionImpl::SendCreditFrame(
    transport::BufferPool::Buffer& buf, uint8_t flags) {
  // Landing grants not yet announced ride along.
  std::array<std::byte, kMaxGrantsPerMessage * kGrantSize> grants;
  size_t room = std::min(grants.size(), buf.size() - kHeaderSize);
  // Grants by memory window: their binds go first, in the same post. Up
  // to kMaxBindsPerMessage binds outgrow a batch's inline room; the
  // connection's own batch keeps its storage, so a credit message does
  // not allocate (a keepalive's, sent meanwhile, uses one of its own).
  transport::SendBatch spare;
  const bool own = !credit_batch_busy_;
  transport::SendBatch& binds = own ? credit_batch_ : spare;
  credit_batch_busy_ = true;
  absl::Cleanup release = [this, own] {
    if (!own) return;
    credit_batch_.Clear();
    credit_batch_busy_ = false;
  };
  size_t n = WriteGrants(std::span<std::byte>(grants.data(), room), binds);
  size_t len = WriteFrame(buf.data(), kCredit, 0, flags,
                          std::span<const std::byte>(grants.data(), n));
  ++credit_msgs_sent_;
  ++stats_.credit_messages_sent;
  if (binds.size() > 0) {
    binds.AddSend(buf.Local(len));
    auto wc = co_await qp_->PostBatch(binds);
    co_return wc.status();
  }
  transport::SendOptions so;
  so.inline_data = len <= qp_->max_inline_data();
  auto wc = co_await qp_->Send(buf.Local(len), so);
  co_return wc.status();
}

// Repost, Replenish, MaybeSendCredits and ReturnThreshold call their
// bodies, which ReturnSlot (once per released message) has inlined: four
// calls and their prologues were ~45 instructions per message.
void ConnectionImpl::MaybeSendCredits() { MaybeSendCreditsBody(); }
uint32_t ConnectionImpl::ReturnThreshold() const {
  return ReturnThresholdBody();
}
void ConnectionImpl::Replenish() { ReplenishBody(); }
bool ConnectionImpl::Repost(RecvSlot* slot) { return RepostBody(slot); }

bool ConnectionImpl::Spent(bool low) { return SpentBody(low); }

[[gnu::always_inline]] inline void ConnectionImpl::ReplenishBody() {
  if (pool_ == nullptr) {
    ++to_return_;
    return;
  }
  // Additive growth while the sender keeps running out; once a whole
  // window of messages came without it running out, shrink by one per
  // message until it does: the window settles where the sender just stops
  // waiting. Giving back the one credit always fits (its receive was just
  // posted again).
  uint32_t window = RecvWindow();
  uint32_t give = 1;
  bool low = std::exchange(peer_low_, false);
  if (low && window + 2 <= options_.recv_credits && pool_->CanLend(2, ctx_)) {
    // CanLend promised both.
    to_return_ += 2;
    window_peak_ = std::max(window_peak_, window + 2);
    return;
  }
  if (!low && window + 1 > initial_credits_ && since_low_ > window) {
    give = 0;  // and again on the next message, until the sender runs low
  }
  to_return_ += give;
  pool_->committed += give;
}

[[gnu::always_inline]] inline bool ConnectionImpl::RepostBody(RecvSlot* slot) {
  absl::Status s;
  if (pool_ != nullptr) {
    if (pool_->Post(slot)) return true;
    s = absl::UnavailableError("the shared receive queue refused it");
  } else {
    LocalBuffer b = ring_->Buffer(*slot);
    s = qp_->PostRecv(slot, std::span<const LocalBuffer>(&b, 1));
  }
  if (!s.ok()) {
    Fail(absl::UnavailableError(
        absl::StrCat("connection lost: reposting a receive: ", s.message())));
    return false;
  }
  return true;
}

[[gnu::always_inline]] inline void ConnectionImpl::ReturnSlotBody(
    RecvSlot* slot) {
  if (pool_ != nullptr) --held_;
  if (!status_.ok() || qp_->in_error()) {
    // The ring is finished; an SRQ buffer serves the other connections.
    if (pool_ != nullptr) pool_->Post(slot);
    return;
  }
  if (pool_ != nullptr) {
    if (!RepostBody(slot)) return;
    ReplenishBody();
  } else {
    refill_[refill_n_] = slot;
    refill_bufs_[refill_n_++] = ring_->Buffer(*slot);
    // Posted now when the batch is full, or when these credits make the
    // owed ones due (once they are due, a credit message is on its way).
    const uint32_t due = ReturnThresholdBody();
    if (refill_n_ < refill_batch_ &&
        (to_return_ >= due || to_return_ + refill_n_ < due)) {
      return;
    }
    if (!FlushRefill()) return;
  }
  MaybeSendCreditsBody();
}

void ConnectionImpl::ReturnSlot(RecvSlot* slot) { ReturnSlotBody(slot); }

// Here, with ReturnSlot's body inlined (RecvSlot::Release runs once per
// message released).
void RecvSlot::Release() {
  if (pool != nullptr) {
    pool->Release(this);
    return;
  }
  RecvRing* r = ring;
  --r->held;
  if (r->conn != nullptr) {
    r->conn->ReturnSlotBody(this);
  } else {
    r->MaybeDelete();
  }
}

bool ConnectionImpl::FlushRefill() {
  const uint32_t n = std::exchange(refill_n_, 0);
  if (n == 0) return true;
  absl::Status s =
      qp_->PostRecvs(std::span(refill_.data(), n),
                     std::span<const LocalBuffer>(refill_bufs_.data(), n));
  if (!s.ok()) {
    Fail(absl::UnavailableError(
        absl::StrCat("connection lost: reposting receives: ", s.message())));
    return false;
  }
  to_return_ += n;
  return true;
}

}  // namespace coverbs::cm::internal
