// QpCore's receive on a reactor thread (RxInline): when a reactor drives the
// QP's receive CQ, the socket's readiness wakes that reactor (the CQ's
// epoll fd, CqCore) and it runs the receive path itself -- frames parsed,
// payloads placed, completions pushed into its own CQ -- instead of the
// progress thread. Also what the rest of QpCore calls where the progress
// thread would touch the engine (Activate, AddTimer), and the switch of a
// QP between the two modes.
#include <memory>
#include <mutex>
#include <utility>

#include "transport/soft/engine.h"
#include "transport/soft/qp_core.h"

namespace coverbs::transport::soft {

void QpCore::Activate() {
  if (inline_) {
    want_tx_ = true;
  } else {
    engine_->Activate(this);
  }
}

void QpCore::AddTimer(SteadyTime when) {
  if (inline_) {
    need_engine_ = true;
    timers_owed_ = true;
  } else {
    engine_->AddTimer(this, when);
  }
}

void QpCore::EnterReactorRx() {
  if (cfg_.recv_cq->driven() &&
      cfg_.recv_cq->AddRx(id_, fd_, weak_from_this())) {
    reactor_rx_ = true;
    engine_->WatchReactorRx();
    return;
  }
  engine_->WatchIn(this);
}

void QpCore::LeaveReactorRx(bool watch) {
  cfg_.recv_cq->RemoveRx(id_, fd_);
  reactor_rx_ = false;
  bulk_rx_ = false;  // the io_uring poll, if armed, simply stays
  if (!watch) return;
  // An edge the reactor had not taken yet is lost: look at the socket.
  rx_ready_ = true;
  engine_->WatchIn(this);
  engine_->Activate(this);
}

void QpCore::StartBulkRx() {
  // Interest off first, then the poll: data arriving in between is seen by
  // the poll as it is armed.
  cfg_.recv_cq->SetRxInterest(id_, fd_, false);
  bulk_rx_ = true;
  bulk_small_run_ = 0;
  engine_->WatchIn(this);
}

void QpCore::EndBulkRx() {
  // The poll's remaining CQEs are ignored (Engine::UnwatchIn); turning the
  // interest back on reports data already waiting to the reactor.
  engine_->UnwatchIn(this);
  bulk_rx_ = false;
  cfg_.recv_cq->SetRxInterest(id_, fd_, true);
}

void QpCore::TakeBackRx() {
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (reactor_rx_) LeaveReactorRx();
}

void QpCore::Nudge() {
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (!removed_) engine_->Activate(this);
}

void QpCore::RxInline(bool ended) {
  // Before the lock: whoever receives next (this thread, or the progress
  // thread after a kick) reads until the end.
  if (ended) peer_ended_.store(true, std::memory_order_relaxed);
  // Kicks and a batch entry below need the engine; the QP may be destroyed
  // meanwhile by another thread, taking the last other reference with it.
  std::shared_ptr<Engine> engine = engine_weak_.lock();
  if (!engine) return;
  bool kick = false;
  {
    std::unique_lock<std::mutex> lock(progress_mu_, std::try_to_lock);
    if (!lock.owns_lock()) {
      // The progress thread (say, copying a bulk payload) or a poster
      // holds it and may have read only up to before the data whose edge
      // we consumed: the progress thread looks at the socket after it.
      rx_hint_.store(true);
      Kick();
      return;
    }
    if (removed_ || !reactor_rx_ || bulk_rx_ || fd_ < 0 || closed_) return;
    if (err_ || rx_fault_ != 0) {
      // The progress thread's: it takes the QP back (OnKick) and drains it.
      kick = true;
    } else {
      // Placement checks each destination region's valid flag; the shared
      // window makes deregistration wait for us (as TxInline).
      AccessEpoch::EnterShared();
      inline_ = true;
      need_engine_ = false;
      want_tx_ = false;
      rx_ready_ = true;
      DoRx();
      inline_ = false;
      AccessEpoch::ExitShared();
      kick = need_engine_;
      if (!kick && !want_tx_ && ctrl_.empty()) return;
    }
  }
  if (kick) {
    Kick();
  } else {
    DeferTx(std::move(engine));
  }
}

}  // namespace coverbs::transport::soft
