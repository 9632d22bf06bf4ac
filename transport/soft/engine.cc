#include "transport/soft/engine.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"

namespace coverbs::transport::soft {
namespace {

// How often reactors that receive for their QPs are checked for having
// stopped turning (CheckReactors): 10 ms. COVERBS_SOFT_REACTOR_CHECK_MS
// overrides it for tests that hold a batch open on purpose and must not
// see the check serve it, however loaded the host (soft_batch_test).
std::chrono::milliseconds ReactorCheckPeriod() {
  static const std::chrono::milliseconds period = [] {
    const char* v = std::getenv("COVERBS_SOFT_REACTOR_CHECK_MS");
    const long ms = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
    return std::chrono::milliseconds(ms > 0 ? ms : 10);
  }();
  return period;
}
// The timer id of that check (connection ids start at 1).
constexpr uint64_t kReactorCheckId = 0;

// io_uring user_data: (connection id << 8) | (generation << 3) | tag.
constexpr uint64_t kTagIgnore = 0;
constexpr uint64_t kTagWake = 1;
constexpr uint64_t kTagIn = 2;
constexpr uint64_t kTagOut = 3;
// POLLIN polls: a QP's socket is watched and unwatched more than once (bulk
// receive, QpCore::StartBulkRx), so each new poll takes the next generation
// (mod 32) and CQEs of a poll already removed are told apart and ignored.
constexpr uint8_t kInGenerations = 32;

uint64_t InData(uint64_t id, uint8_t gen) {
  return (id << 8) | (uint64_t{gen} << 3) | kTagIn;
}
uint64_t OutData(uint64_t id) { return (id << 8) | kTagOut; }

}  // namespace

// An engine's descriptors: its io_uring and the eventfd that wakes it.
struct Engine::Rings {
  io_uring ring{};
  int wake_fd = -1;

  static absl::StatusOr<Rings> Make() {
    Rings r;
    int rc = io_uring_queue_init(256, &r.ring, 0);
    if (rc < 0) {
      return absl::InternalError(absl::StrFormat(
          "soft: io_uring_queue_init for the progress thread: %s",
          strerror(-rc)));
    }
    r.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (r.wake_fd < 0) {
      const int err = errno;
      io_uring_queue_exit(&r.ring);
      return absl::InternalError(absl::StrFormat(
          "soft: eventfd for the progress thread: %s", strerror(err)));
    }
    return r;
  }
  static void Close(Rings& r) {
    io_uring_queue_exit(&r.ring);
    close(r.wake_fd);
  }
};

namespace {

struct Global {
  std::mutex mu;
  std::condition_variable cv;
  std::weak_ptr<Engine> engine;
  bool alive = false;  // an engine exists (possibly shutting down)
  bool atexit_registered = false;
  // The descriptor reserve (Engine::HoldReserve): its holders, and the next
  // engine's descriptors while no engine runs.
  int reserve_holders = 0;
  std::unique_ptr<Engine::Rings> spare;
};

Global& G() {
  static Global* g = new Global();
  return *g;
}

void StopAtExit() {
  std::shared_ptr<Engine> e;
  {
    std::lock_guard<std::mutex> lock(G().mu);
    e = G().engine.lock();
  }
  if (e) e->StopForExit();
}

}  // namespace

absl::StatusOr<std::shared_ptr<Engine>> Engine::Get() {
  Global& g = G();
  std::unique_lock<std::mutex> lock(g.mu);
  if (std::shared_ptr<Engine> e = g.engine.lock()) return e;
  // One progress thread at a time: wait for a previous engine to finish.
  g.cv.wait(lock, [&] { return !g.alive; });
  // The reserve's descriptors, else new ones.
  absl::StatusOr<Rings> rings = absl::UnknownError("");
  if (g.spare != nullptr) {
    rings = std::move(*g.spare);
    g.spare.reset();
  } else {
    rings = Rings::Make();
    if (!rings.ok()) return rings.status();
  }
  std::shared_ptr<Engine> e(new Engine(), [](Engine* p) {
    delete p;  // closes its descriptors
    Global& g = G();
    std::lock_guard<std::mutex> lock(g.mu);
    g.alive = false;
    // The next engine's, made now that this one's are closed.
    if (g.reserve_holders > 0 && g.spare == nullptr) {
      absl::StatusOr<Rings> next = Rings::Make();
      if (next.ok()) g.spare = std::make_unique<Rings>(*std::move(next));
    }
    g.cv.notify_all();
  });
  g.alive = true;
  absl::Status s = e->Start(*std::move(rings));
  if (!s.ok()) {
    lock.unlock();
    return s;
  }
  g.engine = e;
  if (!g.atexit_registered) {
    g.atexit_registered = true;
    std::atexit(&StopAtExit);
  }
  return e;
}

void Engine::HoldReserve() {
  Global& g = G();
  std::lock_guard<std::mutex> lock(g.mu);
  ++g.reserve_holders;
  if (g.spare == nullptr && !g.alive) {
    absl::StatusOr<Rings> r = Rings::Make();
    if (r.ok()) g.spare = std::make_unique<Rings>(*std::move(r));
  }
}

void Engine::DropReserve() {
  Global& g = G();
  std::lock_guard<std::mutex> lock(g.mu);
  if (--g.reserve_holders > 0 || g.spare == nullptr) return;
  Rings::Close(*g.spare);
  g.spare.reset();
}

absl::Status Engine::Start(Rings rings) {
  ring_ = rings.ring;  // liburing's handle: plain data, no self-references
  ring_ok_ = true;
  wake_fd_ = rings.wake_fd;
  discard_ = std::make_unique<char[]>(kDiscardSize);
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

Engine::~Engine() {
  Stop();
  // Connections left here belong to objects leaked past exit; close them.
  for (auto& [id, qp] : conns_) qp->Destroy();
  conns_.clear();
  if (ring_ok_) io_uring_queue_exit(&ring_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Engine::Stop() {
  if (!thread_.joinable()) return;
  if (std::this_thread::get_id() == thread_.get_id()) {
    thread_.detach();  // cannot join ourselves; never expected
    return;
  }
  Post([this] { stop_ = true; });
  thread_.join();
  std::lock_guard<std::mutex> lock(inbox_mu_);
  stopped_ = true;
  // Anything queued after the stop item runs here.
  for (Item& item : inbox_) {
    if (item.kick) {
      item.kick->OnKick();
    } else {
      item.fn();
    }
  }
  inbox_.clear();
}

void Engine::StopForExit() { Stop(); }

void Engine::Kick(std::shared_ptr<QpCore> qp) {
  Enqueue(Item{std::move(qp), nullptr});
}

void Engine::Post(absl::AnyInvocable<void()> fn) {
  Enqueue(Item{nullptr, std::move(fn)});
}

void Engine::Enqueue(Item item) {
  bool wake;
  {
    std::unique_lock<std::mutex> lock(inbox_mu_);
    if (stopped_) {
      // After exit-time stop: run here, one caller at a time.
      lock.unlock();
      std::lock_guard<std::mutex> inline_lock(inline_mu_);
      AccessEpoch::Enter();
      if (item.kick) {
        item.kick->OnKick();
        item.kick->Service();
      } else {
        item.fn();
      }
      AccessEpoch::Exit();
      return;
    }
    inbox_.push_back(std::move(item));
    wake = !wake_pending_;
    wake_pending_ = true;
  }
  if (wake) {
    uint64_t one = 1;
    ssize_t n = write(wake_fd_, &one, sizeof(one));
    (void)n;
  }
}

void Engine::RunSync(absl::AnyInvocable<void()> fn) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Post([&] {
    fn();
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    cv.notify_one();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
}

void Engine::AddConn(std::shared_ptr<QpCore> qp) {
  uint64_t id = qp->id();
  conns_.emplace(id, std::move(qp));
}

void Engine::RemoveConn(QpCore* qp) {
  active_.erase(std::remove(active_.begin(), active_.end(), qp), active_.end());
  conns_.erase(qp->id());
}

void Engine::Activate(QpCore* qp) {
  if (qp->in_active_ || qp->removed_) return;
  qp->in_active_ = true;
  active_.push_back(qp);
}

io_uring_sqe* Engine::Sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  while (sqe == nullptr) {
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  return sqe;
}

void Engine::WatchIn(QpCore* qp) {
  if (qp->watching_in_ || qp->fd_ < 0 || !ring_ok_) return;
  io_uring_sqe* sqe = Sqe();
  // POLLRDHUP: a CQE that finds the peer's end queued says so (OnReadable).
  io_uring_prep_poll_multishot(sqe, qp->fd_, POLLIN | POLLRDHUP);
  io_uring_sqe_set_data64(sqe, InData(qp->id(), qp->in_gen_));
  qp->watching_in_ = true;
}

void Engine::UnwatchIn(QpCore* qp) {
  if (!qp->watching_in_ || !ring_ok_) return;
  io_uring_sqe* sqe = Sqe();
  io_uring_prep_poll_remove(sqe, InData(qp->id(), qp->in_gen_));
  io_uring_sqe_set_data64(sqe, kTagIgnore);
  qp->watching_in_ = false;
  qp->in_gen_ = (qp->in_gen_ + 1) % kInGenerations;
}

void Engine::WatchOut(QpCore* qp) {
  if (qp->pollout_armed_ || qp->fd_ < 0 || !ring_ok_) return;
  io_uring_sqe* sqe = Sqe();
  io_uring_prep_poll_add(sqe, qp->fd_, POLLOUT);
  io_uring_sqe_set_data64(sqe, OutData(qp->id()));
  qp->pollout_armed_ = true;
}

void Engine::Unwatch(QpCore* qp) {
  if (!ring_ok_) return;
  UnwatchIn(qp);
  if (qp->pollout_armed_) {
    io_uring_sqe* sqe = Sqe();
    io_uring_prep_poll_remove(sqe, OutData(qp->id()));
    io_uring_sqe_set_data64(sqe, kTagIgnore);
    qp->pollout_armed_ = false;
  }
  // Make the removal reach the kernel now: the socket is closed right after
  // and io_uring holds it open until its polls are gone.
  io_uring_submit(&ring_);
}

void Engine::AddTimer(QpCore* qp, SteadyTime when) {
  timers_.push(Timer{when, qp->id()});
}

void Engine::WatchReactorRx() {
  if (reactor_check_armed_) return;
  reactor_check_armed_ = true;
  timers_.push(
      Timer{std::chrono::steady_clock::now() + ReactorCheckPeriod(), kReactorCheckId});
}

void Engine::CheckReactors() {
  // A reactor that receives for its QPs does so only while it turns: it
  // sleeps on the CQ's fd and wakes for their data, but a thread stuck
  // elsewhere (a blocking call, a loop that stopped running while its QPs
  // live on) would leave the peers without ACKs. A CQ whose reactor has not
  // turned since the last check has its ready sockets received here
  // instead; one no longer driven at all gives its QPs back to this thread.
  reactor_check_armed_ = false;
  enum Verdict { kFine, kTakeReady, kGiveBack };
  absl::flat_hash_map<CqCore*, Verdict> seen;
  std::vector<CqCore::ReadyRx> ready;
  bool any = false;
  for (auto& [id, qp] : conns_) {
    if (!qp->reactor_rx_) continue;
    CqCore* cq = qp->cfg_.recv_cq.get();
    auto [it, fresh] = seen.try_emplace(cq, kFine);
    if (fresh) {
      if (!cq->driven()) {
        it->second = kGiveBack;
      } else {
        uint64_t beat = cq->heartbeat();
        auto [b, first] = rx_beats_.try_emplace(cq, beat);
        if (!first && b->second == beat) {
          it->second = kTakeReady;
          cq->TakeReady(&ready);
        }
        b->second = beat;
      }
    }
    if (it->second == kGiveBack) {
      qp->TakeBackRx();
    } else {
      any = true;
    }
    // A reactor stuck in the middle of an iteration (a handler computing
    // or blocking) holds what that iteration owes its peers -- the ACKs of
    // what it received, the responses it posted -- until its EndPostBatch;
    // the peer's transport timer would fail the connection. Send them from
    // here, as a NIC acknowledges while its host is busy. (A reactor
    // asleep has flushed its batch: nothing is deferred then.)
    if (it->second == kTakeReady &&
        qp->deferred_.load(std::memory_order_relaxed)) {
      qp->Nudge();
    }
    // An ACK a reactor held back (EndPostBatch) a whole period ago: that
    // reactor stopped running batches; send it from here.
    if (qp->ack_held_.load(std::memory_order_relaxed)) {
      uint32_t gen = qp->hold_gen_.load(std::memory_order_relaxed);
      if (gen == qp->hold_gen_seen_) qp->Nudge();
      qp->hold_gen_seen_ = gen;
    }
  }
  for (auto it = rx_beats_.begin(); it != rx_beats_.end();) {
    if (seen.contains(it->first)) {
      ++it;
    } else {
      rx_beats_.erase(it++);
    }
  }
  for (const CqCore::ReadyRx& r : ready) {
    auto it = conns_.find(r.id);
    if (it != conns_.end()) it->second->OnReadable(r.ended);
  }
  if (any) WatchReactorRx();
}

void Engine::ArmWake() {
  if (wake_armed_) return;
  io_uring_sqe* sqe = Sqe();
  io_uring_prep_read(sqe, wake_fd_, &wake_buf_, sizeof(wake_buf_), 0);
  io_uring_sqe_set_data64(sqe, kTagWake);
  wake_armed_ = true;
}

void Engine::ReapCqes() {
  unsigned head;
  io_uring_cqe* cqe;
  unsigned n = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++n;
    uint64_t data = cqe->user_data;
    uint64_t tag = data & 7;
    if (tag == kTagIgnore) continue;
    if (tag == kTagWake) {
      wake_armed_ = false;
      continue;
    }
    auto it = conns_.find(data >> 8);
    if (it == conns_.end()) continue;
    QpCore* qp = it->second.get();
    if (tag == kTagOut) {
      qp->pollout_armed_ = false;
      if (qp->fd_ >= 0) qp->OnWritable();
      continue;
    }
    // A POLLIN poll: only the current one counts.
    if (!qp->watching_in_ || data != InData(qp->id(), qp->in_gen_)) continue;
    bool more = (cqe->flags & IORING_CQE_F_MORE) != 0;
    if (!more) qp->watching_in_ = false;
    if (qp->fd_ < 0) continue;
    if (cqe->res != -ECANCELED) {
      qp->OnReadable(cqe->res > 0 &&
                     (cqe->res & (POLLRDHUP | POLLHUP | POLLERR)) != 0);
    }
    if (!qp->watching_in_ && qp->progress_watches_in()) WatchIn(qp);
  }
  if (n > 0) io_uring_cq_advance(&ring_, n);
}

bool Engine::DrainInbox() {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    work_.swap(inbox_);
    wake_pending_ = false;
  }
  for (Item& item : work_) {
    if (item.kick) {
      item.kick->OnKick();
    } else {
      item.fn();
    }
  }
  work_.clear();
  return stop_;
}

void Engine::FireTimers() {
  if (timers_.empty()) return;
  SteadyTime now = std::chrono::steady_clock::now();
  while (!timers_.empty() && timers_.top().when <= now) {
    uint64_t id = timers_.top().id;
    timers_.pop();
    if (id == kReactorCheckId) {
      CheckReactors();
      continue;
    }
    auto it = conns_.find(id);
    if (it != conns_.end()) it->second->OnTimer(now);
  }
}

void Engine::ServiceActive() {
  servicing_.swap(active_);
  for (QpCore* qp : servicing_) qp->in_active_ = false;
  for (QpCore* qp : servicing_) {
    if (!qp->removed_) qp->Service();
  }
  servicing_.clear();
}

void Engine::Loop() {
  pthread_setname_np(pthread_self(), "coverbs-soft");
  for (;;) {
    AccessEpoch::Enter();
    ReapCqes();
    bool stop = DrainInbox();
    FireTimers();
    ServiceActive();
    AccessEpoch::Exit();
    if (stop) break;
    ArmWake();
    if (!active_.empty() || io_uring_cq_ready(&ring_) > 0) {
      io_uring_submit(&ring_);
      continue;
    }
    if (timers_.empty()) {
      io_uring_submit_and_wait(&ring_, 1);
      continue;
    }
    auto left = timers_.top().when - std::chrono::steady_clock::now();
    if (left.count() < 0) left = left.zero();
    int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    __kernel_timespec ts;
    ts.tv_sec = ns / 1000000000;
    ts.tv_nsec = ns % 1000000000;
    io_uring_cqe* cqe = nullptr;
    io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr);
  }
  // Leave nothing in flight in the kernel that could touch a socket.
  for (auto& [id, qp] : conns_) Unwatch(qp.get());
  io_uring_submit(&ring_);
}

}  // namespace coverbs::transport::soft
