// Internal, for tests (//cm:internal): what a Connection keeps to itself,
// read by tests that must act as a misbehaving peer would (e.g. reuse an
// rkey after its message).
#ifndef COVERBS_CM_CONNECTION_TEST_PEER_H_
#define COVERBS_CM_CONNECTION_TEST_PEER_H_

#include <span>
#include <vector>

#include "cm/connection.h"
#include "cm/connection_impl.h"
#include "cm/wire.h"
#include "core/task.h"

namespace coverbs::cm::internal {

class ConnectionTestPeer {
 public:
  // The landing grants `c` holds from its peer (sender side), oldest first:
  // the next medium Send writes into the first.
  static std::vector<GrantPayload> Grants(const Connection& c) {
    return {c.impl_->grants_.begin(), c.impl_->grants_.end()};
  }
  // The lkeys of the landing buffers `c` grants to its peer (receiver
  // side), and whether they are grants by memory window.
  static std::vector<uint32_t> GrantedLkeys(const Connection& c) {
    std::vector<uint32_t> v;
    for (const LargeBuffer* lb : c.impl_->granted_) v.push_back(lb->mr.lkey());
    return v;
  }
  static bool LandingWindows(const Connection& c) {
    return c.impl_->landing_windows_;
  }
  // A sender that asks for a rendezvous and never finishes it: posts an
  // RTS for `size` bytes from `c` (in its send turn, with the credits a
  // Send takes) and lets `pr` take its CTS, which nobody acts on -- no
  // WRITE, no DONE. `pr` must outlive `c`'s end (its failure sets it).
  static Task<absl::Status> RequestOnly(Connection& c, PendingRts& pr,
                                        uint32_t size) {
    ConnectionImpl& impl = *c.impl_;
    auto buf = co_await impl.AcquireSend();
    if (!buf.ok()) co_return buf.status();
    pr.cookie = impl.next_cookie_++;
    co_return co_await impl.PostRts(pr, size, *buf);
  }
  // Lets `c` have `n` more RTS waiting for their CTS than the protocol
  // allows (kCtsReserve): a sender that ignores the rule.
  static void WidenRtsWindow(Connection& c, size_t n) {
    c.impl_->rts_window_.Release(n);
  }
  // Sends one small message of any `type` (a GOODBYE, then DATA after it,
  // ...) as a peer breaking the protocol would: no check of what may be
  // sent when. `payload` must fit an eager message and stay valid until
  // the send completes.
  static Task<absl::Status> SendRaw(Connection& c, MsgType type,
                                    std::span<const std::byte> payload) {
    std::span<const std::byte> parts[1] = {payload};
    co_return co_await c.impl_->SendSmall(
        type, 0, std::span<const std::span<const std::byte>>(parts, 1),
        payload.size());
  }
};

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_CONNECTION_TEST_PEER_H_
