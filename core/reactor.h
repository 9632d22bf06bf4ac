// Reactor: one event loop per thread, on io_uring.
//
// The reactor owns
//  - a ready queue: completions never resume a coroutine inline, they
//    schedule it; the loop resumes ready coroutines in FIFO batches, so a
//    completion handler can never recurse into user code;
//  - an io_uring for fd readiness (poll) and cross-thread wake-ups (an eventfd);
//  - a timer heap (deadline order, FIFO among equal deadlines); the loop sleeps
//    in io_uring with the earliest deadline as timeout;
//  - the pollers registered by the transport layer (completion queues), driven
//    by the polling policy: kEvent (sleep in io_uring until an fd fires),
//    kBusy (spin), kAdaptive (spin for a bounded time while a poller has work
//    in flight, then arm and sleep). Idle CPU is ~0 in kEvent and kAdaptive.
//  - every task started with Spawn: when the reactor is destroyed, the frames
//    of tasks that are still suspended are destroyed (their awaiters
//    unregister themselves), so nothing leaks.
//
// Thread-safety: Schedule, Post, Spawn, Stop are callable from any thread.
// Everything else must be called on the reactor's own thread (the thread that
// runs Run / RunOnce / BlockOn).
#ifndef COVERBS_CORE_REACTOR_H_
#define COVERBS_CORE_REACTOR_H_

#include <liburing.h>

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/intrusive.h"
#include "core/task.h"

namespace coverbs {
class Reactor;
}  // namespace coverbs

namespace coverbs::internal {
struct StallState;  // core/stall_watchdog.h
// The reactor whose loop runs on this thread (Reactor::Current). Inline:
// Schedule asks it once per resumption it queues.
inline thread_local Reactor* tls_reactor = nullptr;
}  // namespace coverbs::internal

namespace coverbs {

class Reactor;

enum class PollMode { kEvent, kBusy, kAdaptive };
const char* PollModeName(PollMode m);
// Parses "event" | "busy" | "adaptive".
absl::StatusOr<PollMode> ParsePollMode(std::string_view s);

struct ReactorOptions {
  unsigned ring_entries = 256;
  PollMode poll_mode = PollMode::kEvent;
  // kAdaptive: how long to keep spinning without progress while a poller
  // reports work in flight before arming and sleeping.
  absl::Duration adaptive_spin = absl::Microseconds(50);
  // Stall reports: a task that runs this long without yielding (a handler
  // computing or blocking on its reactor: every other task and connection
  // of the reactor waits meanwhile) is logged once, at warning level, when
  // it returns -- with how long it ran and its name (NameCurrentTask) --
  // and counted (stalls()). Zero turns them off. 100 ms: ten times the
  // slowest latency a reactor-hosted service normally has budgeted for one
  // step, long enough that page faults, a cold start or a loaded machine do
  // not report, short enough that what a caller feels is reported.
  absl::Duration stall_threshold = absl::Milliseconds(100);
};

// A component that reaps completions by polling (e.g. a CompletionQueue).
class Poller {
 public:
  virtual ~Poller() = default;
  // Reaps what is ready without blocking; returns the number of completions
  // handled. Called every loop iteration in kBusy / kAdaptive.
  virtual int Poll() = 0;
  // True while operations are outstanding, i.e. spinning may pay off.
  virtual bool InFlight() const = 0;
  // Called before the reactor sleeps: arm notifications (e.g.
  // ibv_req_notify_cq) and return false if work arrived meanwhile, in which
  // case the reactor does not sleep.
  virtual bool PrepareToSleep() = 0;
  // Bracket each loop iteration's work (remote work, I/O completions,
  // timers, ready coroutines), in pairs, on the reactor's thread; a poller
  // added or removed inside an iteration gets the missing half then. The
  // poller's device may hold back work posted in between and must have
  // handed it on when EndIteration returns: the soft provider gathers the
  // frames the coroutines of one iteration post into one TCP write.
  virtual void BeginIteration() {}
  virtual void EndIteration() {}
};

using SteadyTime = std::chrono::steady_clock::time_point;
SteadyTime SteadyNow();
SteadyTime SteadyAfter(absl::Duration d);

namespace internal {

// Target of an io_uring completion.
class IoCompletion {
 public:
  virtual void OnIoComplete(int32_t res, uint32_t flags) = 0;

 protected:
  ~IoCompletion() = default;
};

// Indirection between an io_uring user_data and its target, so that an
// awaiter destroyed while its SQE is in flight (frame destroyed at shutdown)
// can detach itself: the late CQE finds a null target and is dropped.
// Slots come from a free list owned by the reactor: no allocation per op.
struct IoSlot {
  IoCompletion* target = nullptr;
  IoSlot* next_free = nullptr;
};

struct TimerNode {
  SteadyTime deadline;
  uint64_t seq = 0;
  size_t heap_index = static_cast<size_t>(-1);
  virtual void OnTimer() = 0;
  bool armed() const { return heap_index != static_cast<size_t>(-1); }

 protected:
  ~TimerNode() = default;
};

struct TimerLess {
  bool operator()(const TimerNode* a, const TimerNode* b) const {
    if (a->deadline != b->deadline) return a->deadline < b->deadline;
    return a->seq < b->seq;
  }
};

// Cancellation handshake for operations whose state lives on the reactor
// thread (timers, io_uring ops) but whose stop may be requested from any
// thread. Exactly one of {completion, cancellation} resumes the coroutine and
// never before a cross-thread cancel request has been processed, so the
// awaiter cannot be destroyed while a posted cancel still points at it.
class CancellableOp {
 public:
  explicit CancellableOp(Reactor* r) : reactor_(r) {}

  // Reactor thread: the underlying operation is done.
  void Finish();
  // Any thread (stop callback).
  void RequestCancel();
  // Reactor thread: a cancel request reached the reactor.
  void ProcessCancel();

  Reactor* reactor() const { return reactor_; }
  bool cancelled_by_stop() const { return cancel_seen_ && !done_first_; }

 protected:
  ~CancellableOp() = default;
  // Reactor thread: stop the underlying op; must eventually call Finish().
  virtual void DoCancel() = 0;

  Reactor* reactor_;
  std::coroutine_handle<> waiter_;

 private:
  enum : uint8_t { kWaiting, kDone, kCancelling };
  std::atomic<uint8_t> state_{kWaiting};
  bool completed_ = false;    // reactor thread only
  bool cancel_seen_ = false;  // reactor thread only
  bool done_first_ = false;   // completion won the race
};

struct CancelCallback {
  CancellableOp* op;
  void operator()() const noexcept { op->RequestCancel(); }
};

// A spawned task on its reactor's list (destroyed with the reactor if it
// is still suspended then). From the frame pool: one per Spawn.
struct DetachedRecord : ListNode<DetachedRecord> {
  Reactor* reactor = nullptr;
  std::coroutine_handle<> handle;
  static void* operator new(size_t n) { return AllocFrame(n); }
  static void operator delete(void* p, size_t n) noexcept { FreeFrame(p, n); }
};

}  // namespace internal

class Reactor {
 public:
  static absl::StatusOr<std::unique_ptr<Reactor>> Create(
      ReactorOptions options = {});
  ~Reactor();
  Reactor(const Reactor&) = delete;
  Reactor& operator=(const Reactor&) = delete;

  // The reactor whose loop is running on this thread, or nullptr.
  static Reactor* Current() { return internal::tls_reactor; }

  // Runs the loop until Stop().
  void Run();
  // One non-blocking iteration: runs what is ready, reaps completions, fires
  // expired timers. Returns true if it did any work.
  bool RunOnce();
  // Makes Run() return (thread-safe). Tasks stay suspended; they are
  // destroyed with the reactor unless the loop runs again.
  void Stop();
  bool stop_requested() const { return stop_.load(std::memory_order_acquire); }

  // Runs the loop until `task` completes and returns its result. Must not be
  // called from inside the loop. A Stop() during BlockOn requests
  // cancellation of the task instead of abandoning it.
  template <typename T>
  T BlockOn(Task<T> task);

  // Resumes `h` from the ready queue (thread-safe; never inline). The
  // reactor's own thread queues it here (once per resumption: a call and
  // another for Current() otherwise).
  void Schedule(std::coroutine_handle<> h) {
    if (InLoopThread()) [[likely]] {
      ready_.push_back(h);
      return;
    }
    ScheduleRemote(h);
  }
  // Runs `fn` on the reactor thread (thread-safe).
  void Post(absl::AnyInvocable<void()> fn);
  // Starts `task` detached. The reactor tracks it until it completes and
  // destroys it if it is still suspended when the reactor is destroyed.
  // Thread-safe. The task gets `token` as its ambient stop token.
  void Spawn(Task<void> task, std::stop_token token = {});
  size_t spawned_alive() const { return detached_count_; }

  // --- Awaitables. Each honours the ambient stop token of the awaiting
  // coroutine and then yields absl::CancelledError.
  class SleepAwaiter;
  class FdAwaiter;
  // Suspends for `d` (absl::Status: OK or Cancelled).
  SleepAwaiter Sleep(absl::Duration d);
  SleepAwaiter SleepUntil(SteadyTime t);
  // Waits until `fd` has one of `events` (POLLIN, POLLOUT, ...). Yields the
  // revents, or Cancelled, or the poll error.
  FdAwaiter WaitFd(int fd, uint32_t events);
  // Reschedules the caller behind everything already ready.
  auto Yield() {
    struct Awaiter {
      Reactor* r;
      bool await_ready() const noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) { r->Schedule(h); }
      void await_resume() const noexcept {}
    };
    return Awaiter{this};
  }

  // --- Pollers (transport layer).
  void AddPoller(Poller* p);
  void RemovePoller(Poller* p);
  PollMode poll_mode() const { return options_.poll_mode; }
  void set_poll_mode(PollMode m) { options_.poll_mode = m; }

  // --- Low-level hooks for the runtime and bridges.
  void AddTimer(internal::TimerNode* t);
  void CancelTimer(internal::TimerNode* t);
  // Returns an SQE whose user_data routes to `target` (submitted by the next
  // loop iteration), or nullptr if the ring is unusable.
  io_uring_sqe* PrepareIo(internal::IoCompletion* target,
                          internal::IoSlot** slot);
  // Detaches `slot` from its target and asks the kernel to cancel it.
  void CancelIo(internal::IoSlot* slot, bool detach);
  // Posts a cancel request to be processed on the reactor thread.
  void PostCancel(internal::CancellableOp* op);

  // The io_uring fd: readable when completions are pending. Used by the Asio
  // bridge to drive the reactor from an io_context.
  int ring_fd() const { return ring_.ring_fd; }
  // For an external event loop about to wait on ring_fd(): arms pollers and
  // the wake-up path. Returns false if work is ready and it must not wait.
  bool PrepareForExternalWait();
  // True if RunOnce would find something to do right away.
  bool HasReadyWork() const;
  // Earliest timer deadline, if any.
  std::optional<SteadyTime> NextDeadline() const;

  bool InLoopThread() const { return Current() == this; }

  // --- Stall reports (ReactorOptions::stall_threshold).
  // Names the task running on this thread's reactor until it next suspends
  // (the next resumption starts unnamed): a stall report names it. `name`
  // must stay valid as long as the task runs (a literal, a registered
  // method name). No effect outside a reactor's loop.
  static void NameCurrentTask(std::string_view name) {
    if (Reactor* r = Current()) r->task_name_ = name;
  }
  // Stalls reported so far (any thread).
  uint64_t stalls() const { return stalls_.load(std::memory_order_relaxed); }

 private:
  friend void internal::FinishDetached(internal::DetachedRecord* r) noexcept;
  void ScheduleRemote(std::coroutine_handle<> h);
  explicit Reactor(ReactorOptions options);
  absl::Status Init();

  bool Iterate(bool may_block);
  void RunUntilDone(std::coroutine_handle<> start, const bool& done,
                    std::stop_source& source);
  bool DrainRemote();
  int ReapCqes();
  int FireTimers();
  // Spinning modes: an io_uring timeout at `at` that rings when the
  // earliest timer is due (FireTimers).
  void ArmAlarm(SteadyTime at);
  int RunReady();
  int PollAll();
  void ArmWake();
  void Wake();
  // With remote_mu_ held: marks remote work pending and wakes the loop once.
  void SignalRemoteLocked();
  void Sleep(std::optional<SteadyTime> deadline);
  internal::IoSlot* AllocSlot();
  void FreeSlot(internal::IoSlot* s);

  ReactorOptions options_;
  io_uring ring_{};
  bool ring_ok_ = false;
  int wake_fd_ = -1;
  uint64_t wake_buf_ = 0;
  bool wake_armed_ = false;
  std::atomic<bool> stop_{false};

  std::vector<std::coroutine_handle<>> ready_;
  std::vector<std::coroutine_handle<>> running_;

  // Cross-thread inbox.
  std::mutex remote_mu_;
  std::vector<absl::AnyInvocable<void()>> remote_fns_;
  std::vector<std::coroutine_handle<>> remote_handles_;
  std::vector<internal::CancellableOp*> remote_cancels_;
  std::atomic<bool> remote_pending_{false};
  bool wake_signalled_ = false;  // guarded by remote_mu_

  internal::IndexedHeap<internal::TimerNode, internal::TimerLess> timers_;
  uint64_t timer_seq_ = 0;
  // The alarm (ArmAlarm): one is pending in the kernel for alarm_at_ (older
  // ones for later times may be too), and whether one rang since it was
  // armed. alarm_ts_ is read by the kernel when the SQE is submitted, at
  // the end of the iteration that prepared it.
  bool alarm_armed_ = false;
  bool alarm_rang_ = false;
  SteadyTime alarm_at_{};
  __kernel_timespec alarm_ts_{};

  std::vector<Poller*> pollers_;
  // Iterations under way (a BlockOn inside a task nests one): each poller
  // has had this many BeginIteration calls not yet matched by an
  // EndIteration.
  int iteration_depth_ = 0;
  SteadyTime last_progress_{};

  std::vector<std::unique_ptr<internal::IoSlot[]>> slot_chunks_;
  internal::IoSlot* free_slots_ = nullptr;

  internal::IntrusiveList<internal::DetachedRecord> detached_;
  size_t detached_count_ = 0;
  bool in_loop_ = false;

  // Stall reports: the watchdog's view (core/stall_watchdog.h), the name
  // of the task now running, and the count.
  void ReportStall(int64_t since_ns);
  std::unique_ptr<internal::StallState> stall_;  // null: reports off
  std::string_view task_name_;
  std::atomic<uint64_t> stalls_{0};
};

// ---------------------------------------------------------------------------
// Awaiters

class Reactor::SleepAwaiter : private internal::TimerNode,
                              private internal::CancellableOp {
 public:
  SleepAwaiter(Reactor* r, SteadyTime deadline) : CancellableOp(r) {
    this->deadline = deadline;
  }
  SleepAwaiter(const SleepAwaiter&) = delete;
  ~SleepAwaiter() {
    cb_.reset();
    if (armed()) reactor_->CancelTimer(this);
  }
  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) {
    std::stop_token token = internal::StopTokenOf(h);
    if (token.stop_requested()) {
      cancelled_ = true;
      return false;
    }
    waiter_ = h;
    reactor_->AddTimer(this);
    if (token.stop_possible()) cb_.emplace(std::move(token), internal::CancelCallback{this});
    return true;
  }
  absl::Status await_resume() {
    cb_.reset();
    if (cancelled_ || cancelled_by_stop()) {
      return absl::CancelledError("sleep cancelled");
    }
    return absl::OkStatus();
  }

 private:
  void OnTimer() override { Finish(); }
  void DoCancel() override {
    if (armed()) reactor_->CancelTimer(this);
    Finish();
  }
  bool cancelled_ = false;
  std::optional<std::stop_callback<internal::CancelCallback>> cb_;
};

class Reactor::FdAwaiter : private internal::IoCompletion,
                           private internal::CancellableOp {
 public:
  FdAwaiter(Reactor* r, int fd, uint32_t events)
      : CancellableOp(r), fd_(fd), events_(events) {}
  FdAwaiter(const FdAwaiter&) = delete;
  ~FdAwaiter() {
    cb_.reset();
    if (slot_) reactor_->CancelIo(slot_, /*detach=*/true);
  }
  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) {
    std::stop_token token = internal::StopTokenOf(h);
    if (token.stop_requested()) {
      res_ = -ECANCELED;
      return false;
    }
    io_uring_sqe* sqe = reactor_->PrepareIo(this, &slot_);
    if (sqe == nullptr) {
      res_ = -ENXIO;
      return false;
    }
    io_uring_prep_poll_add(sqe, fd_, events_);
    waiter_ = h;
    if (token.stop_possible()) cb_.emplace(std::move(token), internal::CancelCallback{this});
    return true;
  }
  absl::StatusOr<uint32_t> await_resume();

 private:
  void OnIoComplete(int32_t res, uint32_t) override {
    res_ = res;
    slot_ = nullptr;
    Finish();
  }
  void DoCancel() override {
    if (slot_) {
      reactor_->CancelIo(slot_, /*detach=*/false);
    } else {
      Finish();
    }
  }
  int fd_;
  uint32_t events_;
  int32_t res_ = 0;
  internal::IoSlot* slot_ = nullptr;
  std::optional<std::stop_callback<internal::CancelCallback>> cb_;
};

inline Reactor::SleepAwaiter Reactor::Sleep(absl::Duration d) {
  return SleepAwaiter(this, SteadyAfter(d));
}
inline Reactor::SleepAwaiter Reactor::SleepUntil(SteadyTime t) {
  return SleepAwaiter(this, t);
}
inline Reactor::FdAwaiter Reactor::WaitFd(int fd, uint32_t events) {
  return FdAwaiter(this, fd, events);
}

// ---------------------------------------------------------------------------
// BlockOn

namespace internal {

// Runs a Task to completion and stores its result (BlockOn).
template <typename T>
struct ResultSlot {
  std::optional<T> value;
};
template <>
struct ResultSlot<void> {
  bool value_set = false;
};

template <typename T>
Task<void> CaptureResult(Task<T> task, ResultSlot<T>* out) {
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    out->value_set = true;
  } else {
    out->value.emplace(co_await std::move(task));
  }
}

}  // namespace internal

template <typename T>
T Reactor::BlockOn(Task<T> task) {
  internal::ResultSlot<T> slot;
  std::stop_source source;
  bool done = false;
  auto wrapper = [](Task<T> t, internal::ResultSlot<T>* s,
                    bool* d) -> Task<void> {
    co_await internal::CaptureResult(std::move(t), s);
    *d = true;
  }(std::move(task), &slot, &done);
  wrapper.SetStopToken(source.get_token());
  RunUntilDone(wrapper.handle(), done, source);
  if constexpr (!std::is_void_v<T>) return std::move(*slot.value);
}

}  // namespace coverbs

#endif  // COVERBS_CORE_REACTOR_H_
