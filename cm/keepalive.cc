// Keepalive (ConnectionOptions::keepalive_interval): probe a peer that has
// been silent for an interval, fail the connection when several probes in
// a row go unanswered. Probes and answers are credit messages: they land in
// the reserve receives every peer keeps for credit messages, so they need
// no credit and cannot be starved by application traffic.
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"
#include "core/sync.h"

namespace coverbs::cm::internal {

Task<void> ConnectionImpl::SendKeepalive(uint8_t flags) {
  // At most kCreditReserve credit messages unacknowledged (the peer's
  // reserve receives); a probe that finds them taken is simply skipped --
  // the peer has not answered yet, which the loop counts anyway.
  if (!status_.ok() || closing_ || !may_send_.is_set() ||
      credit_msgs_sent_ - credit_msgs_acked_ >= kCreditReserve) {
    co_return;
  }
  auto buf = co_await GetSendBuffer();
  if (!buf.ok() || !status_.ok() || closing_ ||
      credit_msgs_sent_ - credit_msgs_acked_ >= kCreditReserve) {
    co_return;
  }
  absl::Status s = co_await SendCreditFrame(*buf, flags);
  FailInternalSend(s, "a keepalive message");
}

Task<void> ConnectionImpl::KeepaliveLoop() {
  const absl::Duration interval = options_.keepalive_interval;
  uint64_t seen = rx_count_;
  int unanswered = 0;
  for (;;) {
    auto timed = keepalive_wake_.WaitFor(interval);
    absl::Status woken = co_await std::move(timed);
    if (woken.ok() || !status_.ok() || closing_) co_return;  // going down
    if (rx_count_ != seen) {
      seen = rx_count_;
      unanswered = 0;
      continue;
    }
    if (unanswered >= options_.keepalive_probes) {
      Fail(CloseCause::kKeepalive,
           absl::DeadlineExceededError(
               absl::StrFormat("the peer answered none of %d keepalive probes "
                               "(%s apart): it froze, hung or lost its host",
                               unanswered, absl::FormatDuration(interval))));
      co_return;
    }
    ++unanswered;
    // Not awaited: a send to a frozen peer may never complete (the soft
    // provider waits for its peer's acknowledgement without a retry
    // timeout), and the loop must go on counting.
    SpawnInternal(SendKeepalive(kFlagPing));
  }
}

}  // namespace coverbs::cm::internal
