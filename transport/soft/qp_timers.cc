// QpCore's timers (progress thread): RC's transport timer (timeout,
// retry_cnt: fails the oldest request of a QP whose peer stopped taking or
// sending bytes), the end of an RNR wait, and the close deadline of a QP in
// the error state -- all three served by OnTimer. Also the RNR timer scale.
#include <algorithm>
#include <chrono>
#include <mutex>

#include "absl/strings/str_format.h"
#include "transport/soft/engine.h"
#include "transport/soft/qp_core.h"

namespace coverbs::transport::soft {
namespace {

// IB min_rnr_timer encoding in units of 10 us.
constexpr uint32_t kRnrTable[32] = {
    65536, 1,    2,    3,    4,    6,    8,     12,    16,    24,   32,
    48,    64,   96,   128,  192,  256,  384,   512,   768,   1024, 1536,
    2048,  3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152};

}  // namespace

std::chrono::microseconds RnrDelay(uint8_t code) {
  return std::chrono::microseconds(kRnrTable[code & 31]);
}

std::chrono::nanoseconds QpCore::AckTimeout() const {
  // IB: 4.096 us x 2^timeout per attempt, retry_cnt retries; 0 = infinite.
  uint8_t t = cfg_.init.timeout;
  if (t == 0) return std::chrono::nanoseconds(0);
  int64_t attempt = int64_t{4096} << std::min<uint8_t>(t, 31);
  return std::chrono::nanoseconds(attempt * (cfg_.init.retry_cnt + 1));
}

void QpCore::NoteProgress() {
  progress_at_ = std::chrono::steady_clock::now();
  ArmAckTimer();
}

void QpCore::ArmAckTimer() {
  if (err_ || removed_ || ack_timer_armed_ || comp_ptr_ >= send_ptr_) return;
  auto t = AckTimeout();
  if (t.count() == 0) return;
  if (inline_) {
    need_engine_ = true;  // OnKick arms it
    return;
  }
  ack_timer_armed_ = true;
  ack_due_ = progress_at_ + t;
  engine_->AddTimer(this, ack_due_);
}

void QpCore::OnTimer(SteadyTime now) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (removed_) return;
  if (ack_timer_armed_ && now >= ack_due_) {
    ack_timer_armed_ = false;
    if (!err_ && comp_ptr_ < send_ptr_) {
      if (now >= progress_at_ + AckTimeout()) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
            now - progress_at_);
        CompleteWqe(comp_ptr_, IBV_WC_RETRY_EXC_ERR);
        EnterError(Cause::kFault,
                   absl::StrFormat(
                       "transport retry counter exceeded: nothing from the "
                       "peer for %d ms with requests outstanding (timeout "
                       "%u, retry_cnt %u)",
                       ms.count(), cfg_.init.timeout, cfg_.init.retry_cnt));
        return;
      }
      ArmAckTimer();  // progress since: wait from the latest
    }
  }
  if (rnr_wait_ && now >= rnr_until_) {
    rnr_wait_ = false;
    engine_->Activate(this);
  }
  if (err_ && !closed_ && now >= close_deadline_) CloseNow();
}

}  // namespace coverbs::transport::soft
