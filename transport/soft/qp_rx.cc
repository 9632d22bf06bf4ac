// QpCore's receive stream (progress thread): reading the socket into the
// staging buffer, cutting it into frame headers and payloads, and placing
// payloads into their destinations (posted receive SGEs, WRITE target, READ
// or atomic result) -- large payloads straight from the socket with readv.
// What each frame means is decided in qp_rx_frames.cc.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/str_format.h"
#include "transport/soft/engine.h"
#include "transport/soft/qp_core.h"
#include "transport/soft/qp_internal.h"

namespace coverbs::transport::soft {
namespace {

constexpr size_t kDirectMin = 4096;  // payload read straight to target

constexpr size_t kRxBudget = 4 * 1024 * 1024;  // bytes per QP per iteration

// Where discarded payloads go: per thread, since a reactor thread receiving
// inline (RxInline) and the progress thread may discard at the same time.
char* DiscardBuffer() {
  thread_local std::unique_ptr<char[]> buf;
  if (!buf) buf = std::make_unique_for_overwrite<char[]>(Engine::kDiscardSize);
  return buf.get();
}

}  // namespace

bool QpCore::RecvResult(ssize_t n) {
  if (n > 0) {
    NoteProgress();
    return true;
  }
  if (inline_ && (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))) {
    // End of stream, an error, EINTR: the progress thread acts on it (the
    // error state and closing are its own).
    rx_fault_ = n == 0 ? -1 : errno == EINTR ? 0 : errno;
    need_engine_ = true;
    return false;
  }
  if (n == 0) {
    if (err_) {
      CloseNow();
    } else {
      ConnectionLost("connection closed by the peer");
    }
    return false;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK) {
    rx_ready_ = false;
    return false;
  }
  if (errno == EINTR) {
    Activate();  // try again next iteration
    return false;
  }
  if (err_) {
    CloseNow();
  } else {
    ConnectionLost(absl::StrFormat("receive failed: %s", strerror(errno)));
  }
  return false;
}

void QpCore::DrainAfterError() {
  // After the error transition nothing more is parsed: bytes are read and
  // dropped until the peer closes (or the close timer fires).
  for (int i = 0; i < 64 && rx_ready_ && fd_ >= 0; ++i) {
    ssize_t n = recv(fd_, DiscardBuffer(), Engine::kDiscardSize, MSG_DONTWAIT);
    if (!RecvResult(n)) return;
  }
  if (rx_ready_) engine_->Activate(this);
}

void QpCore::DoRx() {
  if (rx_fault_ != 0 && !inline_) {
    // What an inline receive met: act on it now.
    errno = rx_fault_ > 0 ? rx_fault_ : 0;
    ssize_t n = rx_fault_ > 0 ? -1 : 0;
    rx_fault_ = 0;
    RecvResult(n);
    return;
  }
  size_t budget = kRxBudget;
  // rx_ready_ says the socket may hold more; a read that returns less than
  // it asked for drained it (anything later raises a new poll event), so
  // it is not asked again just to hear EAGAIN -- unless the peer's end was
  // reported (Drained). Frames already in the staging buffer are parsed
  // either way.
  while (fd_ >= 0 && rx_fault_ == 0) {
    if (err_) {
      if (inline_) {
        need_engine_ = true;  // draining after an error: the engine's
        return;
      }
      if (rx_ready_) DrainAfterError();
      return;
    }
    if (!in_payload_) {
      if (rend_ - rpos_ >= wire::kHeaderSize) {
        wire::Header h = wire::Decode(rbuf_.get() + rpos_);
        rpos_ += wire::kHeaderSize;
        if (bulk_rx_) {
          bulk_small_run_ =
              h.payload_len > kInlineBulk ? 0 : bulk_small_run_ + 1;
        }
        StartFrame(h);
        continue;
      }
      if (!rx_ready_ || budget == 0) break;
      if (rpos_ > 0) {
        std::memmove(rbuf_.get(), rbuf_.get() + rpos_, rend_ - rpos_);
        rend_ -= rpos_;
        rpos_ = 0;
      }
      size_t want = kRbufSize - rend_;
      ssize_t n = recv(fd_, rbuf_.get() + rend_, want, MSG_DONTWAIT);
      if (!RecvResult(n)) break;
      if (Drained(static_cast<size_t>(n), want)) rx_ready_ = false;
      rend_ += n;
      budget -= std::min<size_t>(budget, n);
      continue;
    }
    size_t avail = rend_ - rpos_;
    if (avail > 0) {
      size_t take = std::min<uint64_t>(avail, pay_left_);
      Place(rbuf_.get() + rpos_, take);
      rpos_ += take;
      pay_left_ -= take;
      if (pay_left_ == 0) {
        in_payload_ = false;
        FinishFrame();
      }
      continue;
    }
    if (!rx_ready_ || budget == 0) break;
    if (inline_ && pay_left_ > kInlineBulk) {
      need_engine_ = true;  // rx_ready_ stays: the progress thread reads
      break;
    }
    rpos_ = rend_ = 0;
    ssize_t n;
    if (pay_left_ >= kDirectMin) {
      // Payload straight into its destination; whatever follows it lands in
      // the staging buffer.
      iovec iov[kMaxSge + 1];
      size_t covered = 0;
      int niov = DestIov(iov, kMaxSge, &covered);
      size_t want = covered;
      if (covered == pay_left_) {
        iov[niov].iov_base = rbuf_.get();
        iov[niov].iov_len = kRbufSize;
        ++niov;
        want += kRbufSize;
      }
      n = readv(fd_, iov, niov);
      if (!RecvResult(n)) break;
      if (Drained(static_cast<size_t>(n), want)) rx_ready_ = false;
      size_t placed = std::min<uint64_t>(n, pay_left_);
      AdvanceDest(placed);
      pay_left_ -= placed;
      rend_ = n - placed;
      if (pay_left_ == 0) {
        in_payload_ = false;
        FinishFrame();
      }
    } else {
      n = recv(fd_, rbuf_.get(), kRbufSize, MSG_DONTWAIT);
      if (!RecvResult(n)) break;
      if (Drained(static_cast<size_t>(n), kRbufSize)) rx_ready_ = false;
      rend_ = n;
    }
    budget -= std::min<size_t>(budget, n);
  }
  if (rx_ready_ && fd_ >= 0 && rx_fault_ == 0) {
    // Budget spent: go round the loop first. Inline, the socket's edge was
    // consumed, so the progress thread must go on reading.
    if (inline_) {
      need_engine_ = true;
    } else {
      engine_->Activate(this);
    }
  }
}

void QpCore::BeginPayload(RxKind kind, uint64_t len) {
  rx_kind_ = kind;
  rx_err_ = false;
  dest_idx_ = 0;
  dest_off_ = 0;
  pay_left_ = len;
  if (len == 0) {
    FinishFrame();
  } else {
    in_payload_ = true;
  }
}

void QpCore::Place(const char* src, size_t n) {
  if (rx_kind_ == RxKind::kDiscard || rx_err_) return;
  while (n > 0 && dest_idx_ < ndest_) {
    Dest& d = dests_[dest_idx_];
    if (!d.Usable()) {
      rx_err_ = true;
      return;
    }
    size_t c = std::min(n, d.len - dest_off_);
    std::memcpy(d.p + dest_off_, src, c);
    src += c;
    n -= c;
    dest_off_ += c;
    if (dest_off_ == d.len) {
      ++dest_idx_;
      dest_off_ = 0;
    }
  }
}

int QpCore::DestIov(iovec* iov, int max, size_t* covered) {
  int n = 0;
  *covered = 0;
  if (rx_kind_ != RxKind::kDiscard && !rx_err_) {
    uint64_t left = pay_left_;
    for (uint32_t i = dest_idx_; i < ndest_ && n < max && left > 0; ++i) {
      Dest& d = dests_[i];
      if (!d.Usable()) {
        rx_err_ = true;
        n = 0;
        break;
      }
      size_t off = i == dest_idx_ ? dest_off_ : 0;
      size_t len = std::min<uint64_t>(d.len - off, left);
      iov[n].iov_base = d.p + off;
      iov[n].iov_len = len;
      left -= len;
      *covered += len;
      ++n;
    }
    if (n > 0) return n;
    *covered = 0;
  }
  iov[0].iov_base = DiscardBuffer();
  iov[0].iov_len = std::min<uint64_t>(pay_left_, Engine::kDiscardSize);
  *covered = iov[0].iov_len;
  return 1;
}

void QpCore::AdvanceDest(size_t n) {
  if (rx_kind_ == RxKind::kDiscard || rx_err_) return;
  while (n > 0 && dest_idx_ < ndest_) {
    size_t c = std::min(n, dests_[dest_idx_].len - dest_off_);
    n -= c;
    dest_off_ += c;
    if (dest_off_ == dests_[dest_idx_].len) {
      ++dest_idx_;
      dest_off_ = 0;
    }
  }
}

}  // namespace coverbs::transport::soft
