// Whether a soft QP's early transmits may pay (QpCore::PostSend): they
// start the peer's work before the posting reactor's batch ends, which
// pays only while the peer has a CPU of its own to work on what arrives.
#ifndef COVERBS_TRANSPORT_SOFT_EARLY_TX_GATE_H_
#define COVERBS_TRANSPORT_SOFT_EARLY_TX_GATE_H_

#include <cstdint>
#include <string_view>

namespace coverbs::transport::soft {

// The runnable tasks in /proc/loadavg's text ("0.52 0.58 0.59 3/512
// 12345": the number before the slash, the fourth field), or 0 when the
// text is not of that shape (then no sample counts as busy).
int ParseLoadavgRunnable(std::string_view text);

// The decision, per posting thread. A process allowed on one CPU (taskset,
// a 1-CPU container) never overlaps with its peer (echo with both
// processes on one core: 0.53x at 64 B with early transmits); nor, for the
// moment, does a host whose CPUs other processes keep busy (one core of two
// held by another process: 0.50x at 64 B, 0.58x at 4 KiB; the extra
// sendmsgs and sleeps cost the CPU the peer needed). So every
// kSampleEvery-th check samples the host's runnable tasks; a sample is busy
// when they outnumber the CPUs this process may use (the sampling thread
// counts itself), and early transmits stop while a quarter or more of the
// recent samples were busy (an average decaying by 1/4 per sample).
class EarlyTxGate {
 public:
  static constexpr uint32_t kSampleEvery = 64;

  // `runnable` is called for a sample (every kSampleEvery-th call, the
  // first included) and returns the host's runnable tasks now.
  template <typename Runnable>
  bool MayOverlap(int cpus, Runnable&& runnable) {
    if (cpus <= 1) return false;
    if (checks_++ % kSampleEvery == 0) {
      const uint32_t busy = runnable() > cpus ? 64 : 0;
      busy_score_ = (busy_score_ * 3 + busy) / 4;
    }
    return busy_score_ < 16;
  }

 private:
  uint32_t checks_ = 0;
  uint32_t busy_score_ = 0;  // 0..64: recent busy samples, decaying
};

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_EARLY_TX_GATE_H_
