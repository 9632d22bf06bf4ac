#include "core/reactor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"
#include "core/log.h"
#include "core/stall_watchdog.h"

namespace coverbs {
namespace {

using internal::tls_reactor;

// user_data values that are not IoSlot pointers (slots are 8-byte aligned).
constexpr uint64_t kIgnoreTag = 0;
constexpr uint64_t kWakeTag = 1;
constexpr uint64_t kAlarmTag = 2;

// Sets the thread's current reactor for the duration of a loop call and
// restores the previous one (a Reactor may be driven by a thread that also
// drives another one, e.g. the Asio bridge in tests).
class CurrentScope {
 public:
  explicit CurrentScope(Reactor* r) : prev_(tls_reactor) { tls_reactor = r; }
  ~CurrentScope() { tls_reactor = prev_; }

 private:
  Reactor* prev_;
};

}  // namespace

const char* PollModeName(PollMode m) {
  switch (m) {
    case PollMode::kEvent:
      return "event";
    case PollMode::kBusy:
      return "busy";
    case PollMode::kAdaptive:
      return "adaptive";
  }
  return "?";
}

absl::StatusOr<PollMode> ParsePollMode(std::string_view s) {
  if (s == "event") return PollMode::kEvent;
  if (s == "busy") return PollMode::kBusy;
  if (s == "adaptive") return PollMode::kAdaptive;
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown polling mode '%s' (expected event, busy or adaptive)", s));
}

SteadyTime SteadyNow() { return std::chrono::steady_clock::now(); }
SteadyTime SteadyAfter(absl::Duration d) {
  return SteadyNow() + absl::ToChronoNanoseconds(d);
}

// ---------------------------------------------------------------------------
// CancellableOp

namespace internal {

void CancellableOp::Finish() {
  completed_ = true;
  uint8_t expected = kWaiting;
  if (state_.compare_exchange_strong(expected, kDone,
                                     std::memory_order_acq_rel)) {
    done_first_ = true;
    reactor_->Schedule(waiter_);
    return;
  }
  // A stop request is in progress; whoever of {this completion, the cancel
  // processing} comes second resumes the coroutine.
  if (cancel_seen_) reactor_->Schedule(waiter_);
}

void CancellableOp::RequestCancel() {
  uint8_t expected = kWaiting;
  if (!state_.compare_exchange_strong(expected, kCancelling,
                                      std::memory_order_acq_rel)) {
    return;  // already completed
  }
  if (reactor_->InLoopThread()) {
    ProcessCancel();
  } else {
    reactor_->PostCancel(this);
  }
}

void CancellableOp::ProcessCancel() {
  cancel_seen_ = true;
  if (completed_) {
    reactor_->Schedule(waiter_);
    return;
  }
  DoCancel();
}

void FinishDetached(DetachedRecord* r) noexcept {
  Reactor* reactor = r->reactor;
  reactor->detached_.erase(r);
  --reactor->detached_count_;
  delete r;
}

}  // namespace internal

// ---------------------------------------------------------------------------
// Reactor

absl::StatusOr<std::unique_ptr<Reactor>> Reactor::Create(
    ReactorOptions options) {
  std::unique_ptr<Reactor> r(new Reactor(options));
  absl::Status s = r->Init();
  if (!s.ok()) return s;
  return r;
}

Reactor::Reactor(ReactorOptions options) : options_(options) {
  ready_.reserve(1024);
  running_.reserve(1024);
}

absl::Status Reactor::Init() {
  int rc = io_uring_queue_init(options_.ring_entries, &ring_, 0);
  if (rc < 0) {
    return absl::InternalError(absl::StrFormat(
        "io_uring_queue_init(%u entries) failed: %s", options_.ring_entries,
        strerror(-rc)));
  }
  ring_ok_ = true;
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    return absl::InternalError(
        absl::StrFormat("eventfd for reactor wake-ups: %s", strerror(errno)));
  }
  if (options_.stall_threshold > absl::ZeroDuration()) {
    stall_ = std::make_unique<internal::StallState>();
    stall_->threshold_ns = std::max<int64_t>(
        1, absl::ToInt64Nanoseconds(options_.stall_threshold));
    internal::AddStallWatch(stall_.get());
  }
  return absl::OkStatus();
}

Reactor::~Reactor() {
  if (stall_) internal::RemoveStallWatch(stall_.get());
  {
    CurrentScope scope(this);
    // Tasks still suspended: destroying their frames runs the awaiters'
    // destructors, which unregister timers, fd polls and sync waiters.
    while (internal::DetachedRecord* rec = detached_.front()) {
      std::coroutine_handle<> h = rec->handle;
      detached_.erase(rec);
      --detached_count_;
      delete rec;
      h.destroy();
    }
    // Destroyed outside the lock: a posted function may own the last
    // reference to something whose destructor posts again (rpc::Server
    // hands connections to their reactors that way), and posted Tasks.
    std::vector<absl::AnyInvocable<void()>> fns;
    {
      std::lock_guard<std::mutex> lock(remote_mu_);
      fns.swap(remote_fns_);
      remote_handles_.clear();
      remote_cancels_.clear();
    }
    fns.clear();
  }
  if (ring_ok_) io_uring_queue_exit(&ring_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Reactor::Run() {
  CurrentScope scope(this);
  in_loop_ = true;
  last_progress_ = SteadyNow();
  while (!stop_.load(std::memory_order_acquire)) Iterate(/*may_block=*/true);
  stop_.store(false, std::memory_order_release);  // Stop() is consumed
  in_loop_ = false;
}

void Reactor::RunUntilDone(std::coroutine_handle<> start, const bool& done,
                           std::stop_source& source) {
  CurrentScope scope(this);
  ready_.push_back(start);
  bool cancel_sent = false;
  while (!done) {
    if (!cancel_sent && stop_.load(std::memory_order_acquire)) {
      source.request_stop();
      cancel_sent = true;
    }
    Iterate(/*may_block=*/true);
  }
  // A Stop() during BlockOn was consumed by cancelling the task.
  if (cancel_sent) stop_.store(false, std::memory_order_release);
}

bool Reactor::RunOnce() {
  CurrentScope scope(this);
  return Iterate(/*may_block=*/false);
}

void Reactor::Stop() {
  stop_.store(true, std::memory_order_release);
  Wake();
}

void Reactor::ScheduleRemote(std::coroutine_handle<> h) {
  std::lock_guard<std::mutex> lock(remote_mu_);
  remote_handles_.push_back(h);
  SignalRemoteLocked();
}

void Reactor::Post(absl::AnyInvocable<void()> fn) {
  std::lock_guard<std::mutex> lock(remote_mu_);
  remote_fns_.push_back(std::move(fn));
  SignalRemoteLocked();
}

void Reactor::PostCancel(internal::CancellableOp* op) {
  std::lock_guard<std::mutex> lock(remote_mu_);
  remote_cancels_.push_back(op);
  SignalRemoteLocked();
}

void Reactor::Spawn(Task<void> task, std::stop_token token) {
  if (!InLoopThread()) {
    Post([this, t = std::move(task), tok = std::move(token)]() mutable {
      Spawn(std::move(t), std::move(tok));
    });
    return;
  }
  if (!task.valid()) return;
  // The task runs as it is: its frame frees itself at its final suspend
  // (PromiseBase::FinalAwaiter), so a spawn costs no wrapper coroutine.
  Task<void>::Handle h = task.Release();
  auto* rec = new internal::DetachedRecord;
  rec->reactor = this;
  rec->handle = h;
  detached_.push_back(rec);
  ++detached_count_;
  h.promise().inherit_stop_token(std::move(token));
  h.promise().set_detached(rec);
  ready_.push_back(h);
}

void Reactor::SignalRemoteLocked() {
  remote_pending_.store(true, std::memory_order_release);
  if (wake_signalled_) return;
  wake_signalled_ = true;
  // The eventfd write happens under remote_mu_: the loop takes remote_mu_
  // to drain what was pushed, so once it has run a remote handle (and its
  // owner may destroy the reactor) no other thread is still about to write
  // to wake_fd_. Waking after unlocking raced with ~Reactor's close().
  Wake();
}

void Reactor::Wake() {
  uint64_t one = 1;
  // EAGAIN means the counter is saturated: a wake-up is pending anyway.
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;
}

void Reactor::ArmWake() {
  if (wake_armed_) return;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return;
  }
  io_uring_prep_read(sqe, wake_fd_, &wake_buf_, sizeof(wake_buf_), 0);
  io_uring_sqe_set_data64(sqe, kWakeTag);
  wake_armed_ = true;
}

void Reactor::AddPoller(Poller* p) {
  pollers_.push_back(p);
  // Keeps the calls paired: the iterations under way end it too.
  for (int i = 0; i < iteration_depth_; ++i) p->BeginIteration();
}
void Reactor::RemovePoller(Poller* p) {
  auto it = std::remove(pollers_.begin(), pollers_.end(), p);
  if (it == pollers_.end()) return;
  pollers_.erase(it, pollers_.end());
  for (int i = 0; i < iteration_depth_; ++i) p->EndIteration();
}

void Reactor::AddTimer(internal::TimerNode* t) {
  t->seq = timer_seq_++;
  timers_.push(t);
}

void Reactor::CancelTimer(internal::TimerNode* t) {
  if (t->armed()) timers_.erase(t);
}

internal::IoSlot* Reactor::AllocSlot() {
  if (free_slots_ == nullptr) {
    constexpr size_t kChunk = 256;
    auto chunk = std::make_unique<internal::IoSlot[]>(kChunk);
    for (size_t i = 0; i < kChunk; ++i) {
      chunk[i].next_free = free_slots_;
      free_slots_ = &chunk[i];
    }
    slot_chunks_.push_back(std::move(chunk));
  }
  internal::IoSlot* s = free_slots_;
  free_slots_ = s->next_free;
  s->next_free = nullptr;
  return s;
}

void Reactor::FreeSlot(internal::IoSlot* s) {
  s->target = nullptr;
  s->next_free = free_slots_;
  free_slots_ = s;
}

io_uring_sqe* Reactor::PrepareIo(internal::IoCompletion* target,
                                 internal::IoSlot** slot) {
  if (!ring_ok_) return nullptr;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return nullptr;
  }
  internal::IoSlot* s = AllocSlot();
  s->target = target;
  io_uring_sqe_set_data(sqe, s);
  *slot = s;
  return sqe;
}

void Reactor::CancelIo(internal::IoSlot* slot, bool detach) {
  if (detach) slot->target = nullptr;
  if (!ring_ok_) return;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return;
  }
  io_uring_prep_cancel(sqe, slot, 0);
  io_uring_sqe_set_data64(sqe, kIgnoreTag);
}

bool Reactor::PrepareForExternalWait() {
  CurrentScope scope(this);
  for (Poller* p : pollers_) {
    if (!p->PrepareToSleep()) return false;
  }
  ArmWake();
  io_uring_submit(&ring_);
  return !HasReadyWork();
}

bool Reactor::HasReadyWork() const {
  if (!ready_.empty()) return true;
  if (remote_pending_.load(std::memory_order_acquire)) return true;
  if (io_uring_cq_ready(&ring_) > 0) return true;
  if (!timers_.empty() && timers_.top()->deadline <= SteadyNow()) return true;
  return false;
}

std::optional<SteadyTime> Reactor::NextDeadline() const {
  if (timers_.empty()) return std::nullopt;
  return timers_.top()->deadline;
}

bool Reactor::DrainRemote() {
  if (!remote_pending_.load(std::memory_order_acquire)) return false;
  std::vector<absl::AnyInvocable<void()>> fns;
  std::vector<std::coroutine_handle<>> handles;
  std::vector<internal::CancellableOp*> cancels;
  {
    std::lock_guard<std::mutex> lock(remote_mu_);
    fns.swap(remote_fns_);
    handles.swap(remote_handles_);
    cancels.swap(remote_cancels_);
    remote_pending_.store(false, std::memory_order_release);
    wake_signalled_ = false;
  }
  for (auto h : handles) ready_.push_back(h);
  for (auto* op : cancels) op->ProcessCancel();
  for (auto& fn : fns) fn();
  return !fns.empty() || !handles.empty() || !cancels.empty();
}

int Reactor::ReapCqes() {
  unsigned head;
  io_uring_cqe* cqe;
  int n = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++n;
    uint64_t tag = cqe->user_data;
    if (tag == kIgnoreTag) continue;
    if (tag == kWakeTag) {
      wake_armed_ = false;
      continue;
    }
    if (tag == kAlarmTag) {
      // Whichever pending alarm this was, the next FireTimers reads the
      // clock (an older, later one ringing only costs that read).
      alarm_rang_ = true;
      continue;
    }
    auto* slot = reinterpret_cast<internal::IoSlot*>(tag);
    internal::IoCompletion* target = slot->target;
    int32_t res = cqe->res;
    uint32_t flags = cqe->flags;
    FreeSlot(slot);
    if (target != nullptr) target->OnIoComplete(res, flags);
  }
  if (n > 0) io_uring_cq_advance(&ring_, n);
  return n;
}

int Reactor::FireTimers() {
  if (timers_.empty()) return 0;
  // A spinning reactor (busy, adaptive) comes here on every loop iteration,
  // and reading the clock each time is a system call where the clocksource
  // has no vDSO read (a VM on the HPET: 0.6 us of a 15 us round trip on rxe
  // under emulation, bench/RESULTS.md). So it arms an io_uring timeout for
  // the earliest deadline and reads the clock only once that rang or an
  // earlier timer came: until then nothing is due. (Not from the clock:
  // the cheap coarse clock lags by up to a second on a nohz_full core.)
  const bool spinning = options_.poll_mode != PollMode::kEvent && ring_ok_;
  if (spinning && alarm_armed_ && !alarm_rang_ &&
      alarm_at_ <= timers_.top()->deadline) {
    return 0;
  }
  SteadyTime now = SteadyNow();
  int n = 0;
  while (!timers_.empty() && timers_.top()->deadline <= now) {
    internal::TimerNode* t = timers_.pop();
    t->OnTimer();
    ++n;
  }
  if (spinning && !timers_.empty()) ArmAlarm(timers_.top()->deadline);
  return n;
}

void Reactor::ArmAlarm(SteadyTime at) {
  if (alarm_armed_ && !alarm_rang_ && alarm_at_ <= at) return;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
    // None: no alarm, so FireTimers goes on reading the clock.
    if (sqe == nullptr) return;
  }
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                at.time_since_epoch())
                .count();
  if (ns < 0) ns = 0;
  alarm_ts_.tv_sec = ns / 1000000000;
  alarm_ts_.tv_nsec = ns % 1000000000;
  // Absolute CLOCK_MONOTONIC, steady_clock's clock.
  io_uring_prep_timeout(sqe, &alarm_ts_, 0, IORING_TIMEOUT_ABS);
  io_uring_sqe_set_data64(sqe, kAlarmTag);
  alarm_armed_ = true;
  alarm_rang_ = false;
  alarm_at_ = at;
}

int Reactor::RunReady() {
  if (ready_.empty()) return 0;
  running_.swap(ready_);
  int n = static_cast<int>(running_.size());
  // One trampoline for the whole batch (ResumeOnTrampoline per handle
  // saved and restored it each time).
  internal::Trampoline& t = internal::tls_trampoline;
  internal::Trampoline saved = t;
  t.active = true;
  if (stall_ == nullptr) {
    for (std::coroutine_handle<> h : running_) internal::RunOnTrampoline(t, h);
  } else {
    // The watchdog sees seq odd while a task runs; whether it flagged this
    // one is checked after it returns (one load), so no clock is read here.
    // seq only grows (a flag names one task); inside a task (a BlockOn in
    // a task nests a loop) it goes back to odd: the outer task still runs.
    std::atomic<uint64_t>& seq = stall_->seq;
    auto next = [](uint64_t v, uint64_t parity) {
      return v + 1 + (((v + 1) & 1) != parity ? 1 : 0);
    };
    for (std::coroutine_handle<> h : running_) {
      task_name_ = {};
      const uint64_t before = seq.load(std::memory_order_relaxed);
      const uint64_t mine = next(before, 1);
      seq.store(mine, std::memory_order_relaxed);
      internal::RunOnTrampoline(t, h);
      seq.store(next(seq.load(std::memory_order_relaxed), before & 1),
                std::memory_order_relaxed);
      if (stall_->flagged.load(std::memory_order_acquire) == mine) {
        ReportStall(stall_->since_ns.load(std::memory_order_relaxed));
      }
    }
  }
  t = saved;
  running_.clear();
  return n;
}

void Reactor::ReportStall(int64_t since_ns) {
  stalls_.fetch_add(1, std::memory_order_relaxed);
  const int64_t ms = (internal::StallClockNs() - since_ns) / 1'000'000;
  COVERBS_LOG(kWarning, "core",
              "reactor stalled: %s ran %d ms without yielding (threshold %d "
              "ms); every other task of this reactor waited. Move blocking "
              "or CPU-heavy work off the reactor (coverbs::Offload)",
              task_name_.empty() ? std::string("an unnamed task")
                                 : absl::StrFormat("task '%s'", task_name_),
              ms, absl::ToInt64Milliseconds(options_.stall_threshold));
}

int Reactor::PollAll() {
  int n = 0;
  for (Poller* p : pollers_) n += p->Poll();
  return n;
}

void Reactor::Sleep(std::optional<SteadyTime> deadline) {
  io_uring_cqe* cqe = nullptr;
  if (!deadline) {
    io_uring_submit_and_wait(&ring_, 1);
    return;
  }
  auto left = *deadline - SteadyNow();
  if (left.count() < 0) left = left.zero();
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  __kernel_timespec ts;
  ts.tv_sec = ns / 1000000000;
  ts.tv_nsec = ns % 1000000000;
  io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr);
}

bool Reactor::Iterate(bool may_block) {
  int work = 0;
  ++iteration_depth_;
  for (Poller* p : pollers_) p->BeginIteration();
  work += DrainRemote() ? 1 : 0;
  work += ReapCqes();
  if (options_.poll_mode != PollMode::kEvent && !pollers_.empty()) {
    work += PollAll();
  }
  work += FireTimers();
  work += RunReady();
  // Before anything may sleep: what the pollers held back goes out now.
  --iteration_depth_;
  for (Poller* p : pollers_) p->EndIteration();
  if (work > 0 && options_.poll_mode == PollMode::kAdaptive) {
    last_progress_ = SteadyNow();
  }

  bool more = !ready_.empty() ||
              remote_pending_.load(std::memory_order_acquire) ||
              io_uring_cq_ready(&ring_) > 0;
  // Work done in this pass may have changed the caller's loop condition
  // (Stop, a BlockOn task finishing): return before deciding to sleep.
  if (!may_block || more || work > 0 ||
      stop_.load(std::memory_order_acquire)) {
    // Keep the wake-up read armed so cross-thread posts make the ring fd
    // readable for an external driver (Asio bridge).
    ArmWake();
    io_uring_submit(&ring_);
    return work > 0;
  }
  if (options_.poll_mode == PollMode::kBusy) {
    io_uring_submit(&ring_);
    return work > 0;
  }
  if (options_.poll_mode == PollMode::kAdaptive) {
    SteadyTime now = SteadyNow();
    bool in_flight = false;
    for (Poller* p : pollers_) in_flight |= p->InFlight();
    if (in_flight &&
        now - last_progress_ <
            absl::ToChronoNanoseconds(options_.adaptive_spin)) {
      io_uring_submit(&ring_);
      return work > 0;
    }
  }
  for (Poller* p : pollers_) {
    if (!p->PrepareToSleep()) {
      io_uring_submit(&ring_);
      return true;
    }
  }
  ArmWake();
  // A post that raced with the checks above has written the eventfd, so the
  // armed read completes at once and the sleep returns.
  Sleep(NextDeadline());
  // Whatever woke us (a completion, a timer) usually means more is coming:
  // the adaptive spin budget starts again.
  last_progress_ = SteadyNow();
  return work > 0;
}

absl::StatusOr<uint32_t> Reactor::FdAwaiter::await_resume() {
  cb_.reset();
  if (res_ == -ECANCELED) {
    return absl::CancelledError(
        absl::StrFormat("wait for readiness of fd %d cancelled", fd_));
  }
  if (res_ < 0) {
    return absl::InternalError(absl::StrFormat(
        "poll on fd %d failed: %s", fd_, strerror(-res_)));
  }
  return static_cast<uint32_t>(res_);
}

}  // namespace coverbs
