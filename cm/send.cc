// Sending: the FIFO send turn (turn, credit, buffer, post), eager data,
// control and CTS messages.

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"
#include "cm/worker_shared.h"

namespace coverbs::cm::internal {

void ConnectionImpl::FillHeader(WireHeader& h, MsgType type, uint32_t length,
                                uint32_t cookie, uint16_t flags) {
  FillHeaderBody(h, type, length, cookie, flags);
}

// Always inline into the small-message path (a call there per message).
[[gnu::always_inline]] inline void ConnectionImpl::FillHeaderBody(
    WireHeader& h, MsgType type, uint32_t length, uint32_t cookie,
    uint16_t flags) {
  h.type = type;
  h.flags = static_cast<uint8_t>(flags);
  uint32_t give = std::min<uint32_t>(to_return_, 0xffff);
  h.credits = static_cast<uint16_t>(give);
  to_return_ -= give;
  outstanding_ += give;
  // Spending our last credit: tell a receiver that lends (SRQ) that we
  // would use a larger window.
  bool spends = type != kCredit && type != kCts;
  if (spends && credits_.available() == 0) h.flags |= kFlagCreditLow;
  h.length = length;
  h.credit_acks = credit_msgs_seen_;
  h.cookie = cookie;
}

size_t ConnectionImpl::WriteFrame(std::byte* dst, MsgType type, uint32_t cookie,
                                  uint16_t flags,
                                  std::span<const std::byte> payload) {
  WireHeader h;
  FillHeader(h, type, static_cast<uint32_t>(payload.size()), cookie, flags);
  std::memcpy(dst, &h, kHeaderSize);
  if (!payload.empty()) {
    std::memcpy(dst + kHeaderSize, payload.data(), payload.size());
  }
  return kHeaderSize + payload.size();
}

// Always inline: its two callers (below) run once per small message.
[[gnu::always_inline]] inline size_t ConnectionImpl::WriteFrame(
    std::byte* dst, MsgType type, uint32_t length, uint32_t cookie,
    std::span<const std::span<const std::byte>> parts) {
  WireHeader h;
  FillHeaderBody(h, type, length, cookie, 0);
  std::memcpy(dst, &h, kHeaderSize);
  return kHeaderSize + CopyParts(dst + kHeaderSize, parts);
}

void ConnectionImpl::FailInternalSend(const absl::Status& s, const char* what) {
  if (!s.ok() && status_.ok() && !closing_) {
    Fail(CauseOfWc(s),
         absl::UnavailableError(absl::StrCat(what, " failed: ", s.message())));
  }
}

Task<absl::Status> ConnectionImpl::TakeCredit() {
  if (!may_send_.is_set()) {
    absl::Status s = co_await may_send_.Wait();
    if (!s.ok()) co_return s;
  }
  absl::Status s = CheckUp("send");
  if (!s.ok()) co_return s;
  if (!credits_.TryAcquire(1)) {
    ++stats_.credit_waits;
    s = co_await credits_.Acquire(1);
    if (!s.ok()) co_return s;
  }
  // Fail() releases every waiter with permits that are not credits.
  s = CheckUp("send");
  co_return s;
}

bool ConnectionImpl::TryAcquireSend(
    std::optional<transport::BufferPool::Buffer>& out) {
  if (!status_.ok() || closing_ || !started_ || !may_send_.is_set()) {
    return false;
  }
  if (!send_turn_.TryAcquire(1)) return false;
  if (credits_.TryAcquire(1)) {
    // The pool once known, without a StatusOr per message.
    transport::BufferPool* pool = send_pool_;
    if (pool == nullptr) {
      auto found = SendPool();
      if (found.ok()) pool = *found;
    }
    if (pool != nullptr) {
      out = pool->TryGet();
      if (out.has_value()) return true;
    }
    credits_.Release(1);
  }
  send_turn_.Release(1);
  return false;
}

Task<absl::StatusOr<transport::BufferPool::Buffer>>
ConnectionImpl::AcquireSend() {
  absl::Status s = co_await send_turn_.Acquire(1);
  if (!s.ok()) co_return s;
  s = co_await TakeCredit();
  if (!s.ok()) {
    send_turn_.Release(1);
    co_return s;
  }
  // Buffers are only ever held by posted sends, which complete: waiting
  // for one here cannot deadlock with credits.
  auto buf = co_await GetSendBuffer();
  if (!buf.ok()) {
    AbandonTurn();
    co_return OpError("send", buf.status());
  }
  co_return std::move(*buf);
}

void ConnectionImpl::AbandonTurn() {
  if (status_.ok()) credits_.Release(1);
  send_turn_.Release(1);
}

absl::StatusOr<transport::BufferPool*> ConnectionImpl::SendPool() {
  if (send_pool_ != nullptr) return send_pool_;
  auto pool = PoolOf(kHeaderSize + options_.rendezvous_threshold, 256);
  if (pool.ok()) {
    send_pool_ = *pool;
    send_lkey_ = send_pool_->region().lkey();
  }
  return pool;
}

absl::StatusOr<transport::BufferPool*> ConnectionImpl::PoolOf(
    size_t size, size_t count, bool partly_used) {
  WorkerShared& sh = SharedOf(ctx_);
  size = (size + 63) & ~size_t{63};
  auto it = sh.send_pools.find(size);
  if (it != sh.send_pools.end()) return it->second.get();
  transport::BufferPool::Options po;
  po.buffer_size = size;
  po.count = count;
  po.access = IBV_ACCESS_LOCAL_WRITE;
  po.transparent_hugepages = !partly_used;
  auto pool = transport::BufferPool::Create(ctx_.pd(), po);
  if (!pool.ok()) return pool.status();
  transport::BufferPool* p = pool->get();
  sh.send_pools.emplace(size, std::move(*pool));
  return p;
}

Task<absl::StatusOr<transport::BufferPool::Buffer>>
ConnectionImpl::GetSendBuffer() {
  auto pool = SendPool();
  if (!pool.ok()) co_return pool.status();
  if (auto b = (*pool)->TryGet()) co_return std::move(*b);
  co_return co_await (*pool)->Get();
}

// Always inline: once per small message (TrySendInline, SendSmall).
[[gnu::always_inline]] inline absl::Status ConnectionImpl::PostFrameInline(
    MsgType type, size_t total, const LocalBuffer& frame) {
  absl::Status s = qp_->PostInlineSend({&frame, 1});
  if (!s.ok()) return OpError("send", s);
  if (type == kData) {
    ++stats_.messages_sent;
    stats_.bytes_sent += total;
  }
  return absl::OkStatus();
}

// Always inline: once per small message (SendAwaiter::Start, TrySendNow).
[[gnu::always_inline]] inline std::optional<absl::Status>
ConnectionImpl::TrySendInline(MsgType type, uint32_t cookie,
                              std::span<const std::span<const std::byte>> parts,
                              size_t total, const LocalBuffer* extra) {
  // Stack room for the frame: what a small message needs, while the
  // device's inline limit may be larger.
  constexpr size_t kMaxFrame = 256;
  const size_t len = kHeaderSize + total;
  // Down first: a connection whose Worker is gone has no QP to ask.
  if (!status_.ok() || closing_ || !started_ || !may_send_.is_set()) {
    return std::nullopt;
  }
  if (len > kMaxFrame || len > qp_->max_inline_data()) return std::nullopt;
  // Checked before the header takes the credits it returns to the peer: a
  // post refused for room would lose them.
  if (!CanSendInlineNow()) return std::nullopt;
  // The turn is free and nobody waits for it: the frame is posted before
  // anything else runs, so it is not taken and given back.
  if (!send_turn_.WouldAcquire(1)) return std::nullopt;
  if (!credits_.TryAcquire(1)) return std::nullopt;
  alignas(8) std::byte frame[kMaxFrame];
  size_t off =
      WriteFrame(frame, type, static_cast<uint32_t>(total), cookie, parts);
  if (extra != nullptr && extra->length > 0) {
    std::memcpy(frame + off, extra->addr, extra->length);
    off += extra->length;
  }
  return PostFrameInline(type, total,
                         LocalBuffer{frame, static_cast<uint32_t>(off), 0});
}

Task<absl::Status> ConnectionImpl::SendSmall(
    MsgType type, uint32_t cookie,
    std::span<const std::span<const std::byte>> parts, size_t total,
    std::optional<LocalBuffer> zero_copy) {
  // Nobody waiting and the turn, a credit and a buffer free now: take them
  // without AcquireSend's three nested coroutines (the common case; only
  // uncontended TryAcquires succeed, so FIFO order is kept).
  // (SendAwaiter::Start tried TrySendInline just before.)
  std::optional<transport::BufferPool::Buffer> buf;
  if (!TryAcquireSend(buf)) {
    auto got = co_await AcquireSend();
    if (!got.ok()) co_return got.status();
    buf = *std::move(got);
  }
  std::byte* d = buf->data();
  size_t off = WriteFrame(d, type, static_cast<uint32_t>(total), cookie, parts);
  // A payload that fits inline goes inline even when the caller registered
  // it: one SGE copied at post time beats a second SGE the NIC must fetch.
  if (zero_copy.has_value() &&
      off + zero_copy->length <= qp_->max_inline_data()) {
    if (zero_copy->length > 0)
      std::memcpy(d + off, zero_copy->addr, zero_copy->length);
    off += zero_copy->length;
    zero_copy.reset();
  }
  // Waited for the turn or a credit, but fits inline now: posted without
  // an operation to wait for (the buffer is copied at post; ours again at
  // once).
  if (!zero_copy.has_value() && off <= qp_->max_inline_data() &&
      CanSendInlineNow()) {
    send_turn_.Release(1);
    co_return PostFrameInline(
        type, total, LocalBuffer{d, static_cast<uint32_t>(off), send_lkey_});
  }
  // The SGE from the pool's cached key: Buffer::Local's bounds checks and
  // key lookup are two calls per message.
  LocalBuffer sg[2] = {LocalBuffer{d, static_cast<uint32_t>(off), send_lkey_},
                       {}};
  size_t n = 1;
  if (zero_copy.has_value()) sg[n++] = *zero_copy;
  transport::SendOptions so;
  so.inline_data = !zero_copy.has_value() && off <= qp_->max_inline_data();
  // Once posted, the message goes: a cancelled Send still waits for its
  // completion (bounded by the transport's retry timer or a flush) rather
  // than moving the QP to the error state, which would fail the
  // connection for everyone. Waiting for the turn, a credit or a buffer
  // above stays cancellable.
  so.ignore_stop = true;
  send_turn_.Release(1);
  // A named awaiter, not a braced temporary in the co_await: gcc 12
  // mis-copies those (the work request would name a stale address).
  transport::StatusOf op{qp_->Send(std::span<const LocalBuffer>(sg, n), so)};
  absl::Status sent = co_await op;
  if (!sent.ok()) co_return OpError("send", sent);
  if (type == kData) {
    ++stats_.messages_sent;
    stats_.bytes_sent += total;
  }
  co_return absl::OkStatus();
}

}  // namespace coverbs::cm::internal

namespace coverbs::cm {

namespace {
// Builds the operation in an optional in place: QueuePair::Send returns it
// as a prvalue (an Op is neither copied nor moved).
struct MakeSendOp {
  transport::QueuePair* qp;
  const transport::LocalBuffer* sge;
  size_t n;
  transport::SendOptions so;
  operator transport::QueuePair::Op() const {
    if (n == 1) return qp->Send(*sge, so);
    return qp->Send(std::span<const transport::LocalBuffer>(sge, n), so);
  }
};
struct MakeBatchOp {
  transport::QueuePair* qp;
  transport::SendBatch* batch;
  // As SendSmall's ignore_stop: once posted, the message goes.
  operator transport::QueuePair::Op() const {
    return qp->PostBatch(*batch, /*ignore_stop=*/true);
  }
};
}  // namespace

Connection::SendAwaiter::Step Connection::SendAwaiter::Start(
    std::coroutine_handle<> h) {
  internal::ConnectionImpl& c = *impl_;
  size_t total = 0;
  if (registered_) {
    total = reg_.length;
  } else {
    for (auto p : parts_) total += p.size();
  }
  const bool eager = total <= c.eager_max_ && total <= c.peer_max_;
  if (eager) {
    inline_ = c.TrySendInline(internal::kData, 0, parts_, total,
                              registered_ ? &reg_ : nullptr);
    if (inline_.has_value()) return Step::kDone;
  }
  total_ = static_cast<uint32_t>(total);
  if (!eager) {
    // SendBig's landed path without its coroutine frame, when a grant, a
    // staging buffer, the turn, a credit and a header buffer are all free.
    landed_ =
        c.TryStartLanded(parts_, registered_ ? &reg_ : nullptr, total, buf_);
    if (landed_ == nullptr) {
      slow_ = registered_ ? c.SendRegistered(reg_) : c.SendParts(parts_);
      return Step::kSlow;
    }
    c.send_turn_.Release(1);  // posted in order: nothing runs before the post
    op_.emplace(MakeBatchOp{c.qp_.get(), &landed_->batch});
    if (!h) return op_->Post() ? Step::kPosted : Step::kDone;  // PostNow
    return op_->await_suspend(h) ? Step::kPosted : Step::kDone;
  }
  // SendSmall's fast path (TryAcquireSend checks what CheckUp would).
  if (!c.TryAcquireSend(buf_)) {
    slow_ = registered_ ? c.SendRegistered(reg_) : c.SendParts(parts_);
    return Step::kSlow;
  }
  std::byte* d = buf_->data();
  // Registered: parts_ is empty, the header announces reg_'s bytes.
  size_t len = c.WriteFrame(d, internal::kData, total_, 0, parts_);
  transport::LocalBuffer sg[2] = {{}, {}};
  size_t n = 1;
  const size_t max_inline = c.qp_->max_inline_data();
  if (registered_) {
    // As in SendSmall: a payload that fits inline goes inline (one SGE
    // copied at post time beats a second SGE the NIC must fetch).
    if (len + reg_.length <= max_inline) {
      if (reg_.length > 0) std::memcpy(d + len, reg_.addr, reg_.length);
      len += reg_.length;
    } else {
      sg[n++] = reg_;
    }
  }
  sg[0] = transport::LocalBuffer{d, static_cast<uint32_t>(len), c.send_lkey_};
  transport::SendOptions so;
  so.inline_data = n == 1 && len <= max_inline;
  // As in SendSmall: once posted, the message goes (a cancelled caller
  // waits for the completion instead of failing the QP).
  so.ignore_stop = true;
  c.send_turn_.Release(1);  // posted in order: nothing runs before the post
  op_.emplace(MakeSendOp{c.qp_.get(), sg, n, so});
  if (!h) return op_->Post() ? Step::kPosted : Step::kDone;  // PostNow
  return op_->await_suspend(h) ? Step::kPosted : Step::kDone;
}

std::optional<absl::Status> Connection::TrySendNow(
    std::span<const std::span<const std::byte>> parts) {
  internal::ConnectionImpl& c = *impl_;
  size_t total = 0;
  for (auto p : parts) total += p.size();
  if (total > c.eager_max_ || total > c.peer_max_) return std::nullopt;
  return c.TrySendInline(internal::kData, 0, parts, total, nullptr);
}

absl::Status Connection::SendAwaiter::ResumeNotInline() {
  if (slow_.valid()) return std::move(slow_.handle().promise()).result();
  absl::Status s = op_->TakeStatus();
  if (!s.ok()) {
    return impl_->OpError(landed_ ? "send (landing write)" : "send", s);
  }
  if (landed_) ++impl_->stats_.landed_sent;
  ++impl_->stats_.messages_sent;
  impl_->stats_.bytes_sent += total_;
  return absl::OkStatus();
}

}  // namespace coverbs::cm

namespace coverbs::cm::internal {

Task<void> ConnectionImpl::SendControl(MsgType type, uint32_t cookie,
                                       uint16_t flags,
                                       std::vector<std::byte> payload) {
  // Control messages travel like data (a credit each) but are consumed by
  // the peer's connection, never by its application, so they always return.
  absl::Status s;
  do {
    auto buf = co_await AcquireSend();
    if (!buf.ok()) {
      s = buf.status();
      break;
    }
    size_t len = WriteFrame(buf->data(), type, cookie, flags, payload);
    transport::SendOptions so;
    so.inline_data = len <= qp_->max_inline_data();
    // Nothing follows a GOODBYE (the peer fails a connection that sends
    // more): Sends that did not get the turn before it now fail.
    if (type == kGoodbye) closing_ = true;
    send_turn_.Release(1);
    auto wc = co_await qp_->Send(buf->Local(len), so);
    if (!wc.ok()) s = wc.status();
  } while (false);
  FailInternalSend(s, "sending a control message");
}

Task<void> ConnectionImpl::SendCts(uint32_t cookie, uint16_t flags,
                                   std::vector<std::byte> payload) {
  // No credit and no send turn: the CTS lands in one of the kCtsReserve
  // receives the peer posted for the answers to its RTS messages.
  absl::Status s;
  do {
    s = co_await cts_turn_.Acquire(1);
    if (!s.ok()) break;
    // The peer's RTS can overtake our ESTABLISHED on the passive side (on
    // a lossy wire rdma_cm's RTU can take seconds to come again): answer
    // once started, as the owed credits are (Start), instead of failing.
    if (!started_event_.is_set()) s = co_await started_event_.Wait();
    if (s.ok()) s = CheckUp("send");
    if (!s.ok()) {
      cts_turn_.Release(1);
      break;
    }
    auto buf = co_await GetSendBuffer();
    if (!buf.ok()) {
      s = buf.status();
      cts_turn_.Release(1);
      break;
    }
    size_t len = WriteFrame(buf->data(), kCts, cookie, flags, payload);
    transport::SendOptions so;
    so.inline_data = len <= qp_->max_inline_data();
    cts_turn_.Release(1);  // posted in order by the co_await below
    auto wc = co_await qp_->Send(buf->Local(len), so);
    if (!wc.ok()) s = wc.status();
  } while (false);
  FailInternalSend(s, "sending a rendezvous answer");
}

namespace {
Task<absl::Status> Ready(absl::Status s) { co_return s; }
}  // namespace

Task<absl::Status> ConnectionImpl::SendParts(
    std::span<const std::span<const std::byte>> parts) {
  // Not a coroutine: it checks and hands over the Task of the path taken,
  // one coroutine frame less per message (`parts` outlives that Task, as
  // the caller promises for the Send).
  size_t total = 0;
  for (auto p : parts) total += p.size();
  // CheckUp's conditions, tested before it builds a Status (per message).
  if (!status_.ok() || closing_ || !started_) return Ready(CheckUp("send"));
  if (total > peer_max_) {
    return Ready(absl::InvalidArgumentError(absl::StrFormat(
        "send on %s: message of %d bytes exceeds the maximum %d (local %d, "
        "peer %d)",
        name_, total, peer_max_, options_.max_message_size,
        peer_.handshake.max_message_size)));
  }
  if (total <= eager_max_) {
    return SendSmall(kData, 0, parts, total);
  }
  return SendBig(parts, nullptr, total);
}

Task<absl::Status> ConnectionImpl::SendRegistered(LocalBuffer b) {
  // Not a coroutine, like SendParts: a small message hands over
  // SendSmall's Task (which holds `b` by value), one frame less per Send.
  if (!status_.ok() || closing_ || !started_) return Ready(CheckUp("send"));
  if (b.length > peer_max_) {
    return Ready(absl::InvalidArgumentError(absl::StrFormat(
        "send on %s: message of %d bytes exceeds the maximum %d", name_,
        b.length, peer_max_)));
  }
  if (b.length <= eager_max_) {
    return SendSmall(kData, 0, std::span<const std::span<const std::byte>>(),
                     b.length, b);
  }
  return SendRegisteredBig(b);
}

Task<absl::Status> ConnectionImpl::SendRegisteredBig(LocalBuffer b) {
  // A named empty span: gcc 12 mis-copies braced temporaries passed to a
  // coroutine inside co_await.
  std::span<const std::span<const std::byte>> none;
  co_return co_await SendBig(none, &b, b.length);
}

}  // namespace coverbs::cm::internal
