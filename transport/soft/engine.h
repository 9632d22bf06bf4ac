// The soft provider's progress engine: one thread per process, on io_uring.
//
// It owns the sockets of all soft QPs. Application threads hand it work
// through a mutex-protected inbox (QP kicks after posts, functions) and wake
// it through an eventfd (a reactor thread mostly sends its posts itself at
// the end of its loop iteration, see qp_core.h's BeginPostBatch); it watches sockets with io_uring polls, serves
// receive and transmit on them with non-blocking syscalls, runs the RNR and
// close timers and produces every completion. It is created by the first QP
// and joined when the last reference goes away (or at process exit). Its
// descriptors (an io_uring and an eventfd) are made ahead of it: see
// HoldReserve.
#ifndef COVERBS_TRANSPORT_SOFT_ENGINE_H_
#define COVERBS_TRANSPORT_SOFT_ENGINE_H_

#include <liburing.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "transport/soft/qp_core.h"

namespace coverbs::transport::soft {

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // The process's engine, started on first use.
  static absl::StatusOr<std::shared_ptr<Engine>> Get();

  // The descriptor reserve: while any holder remains (each soft provider,
  // from creation to destruction), the io_uring and eventfd of the next
  // engine exist whenever no engine runs -- made by HoldReserve, and by an
  // engine that ends right after it closed its own -- and Get starts the
  // engine on them. So a peer that makes the process run out of
  // descriptors (EMFILE) cannot keep a later connection from getting a QP:
  // the first QP no longer creates them. (Best effort: if they cannot be
  // made then, Get makes them as before.) DropReserve by the last holder
  // closes them.
  static void HoldReserve();
  static void DropReserve();
  struct Rings;  // an engine's descriptors (engine.cc)
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  uint64_t NewId() { return next_id_.fetch_add(1); }

  // ---- Any thread.
  // Queues a QP for service (after a post or SetError). The QP must have been
  // added with AddConn; a kick that reaches a removed QP does nothing (the
  // inbox holds a reference, so that is safe).
  void Kick(std::shared_ptr<QpCore> qp);
  // Runs `fn` on the progress thread, in order with kicks.
  void Post(absl::AnyInvocable<void()> fn);
  // Post and wait until `fn` has run.
  void RunSync(absl::AnyInvocable<void()> fn);

  // ---- Progress thread (or inside Post/RunSync functions).
  void AddConn(std::shared_ptr<QpCore> qp);
  void RemoveConn(QpCore* qp);
  void Activate(QpCore* qp);
  void WatchIn(QpCore* qp);
  void WatchOut(QpCore* qp);
  void UnwatchIn(QpCore* qp);
  void Unwatch(QpCore* qp);
  void AddTimer(QpCore* qp, SteadyTime when);
  // A QP now receives on its receive CQ's reactor (QpCore::EnterReactorRx):
  // starts the periodic check of such reactors (CheckReactors).
  void WatchReactorRx();
  char* discard_buffer() { return discard_.get(); }
  static constexpr size_t kDiscardSize = 64 * 1024;

  // Stops the thread at process exit if objects are still alive; later
  // requests run on the calling thread.
  void StopForExit();

 private:
  Engine() = default;
  absl::Status Start(Rings rings);
  void Loop();
  void ReapCqes();
  bool DrainInbox();
  void FireTimers();
  void ServiceActive();
  void CheckReactors();
  void ArmWake();
  io_uring_sqe* Sqe();
  void Stop();

  struct Item {
    std::shared_ptr<QpCore> kick;
    absl::AnyInvocable<void()> fn;
  };
  void Enqueue(Item item);
  struct Timer {
    SteadyTime when;
    uint64_t id;
    bool operator>(const Timer& o) const { return when > o.when; }
  };

  std::atomic<uint64_t> next_id_{1};
  std::thread thread_;
  std::thread::id thread_id_;
  io_uring ring_{};
  bool ring_ok_ = false;
  int wake_fd_ = -1;
  uint64_t wake_buf_ = 0;
  bool wake_armed_ = false;

  std::mutex inbox_mu_;
  std::vector<Item> inbox_;       // guarded by inbox_mu_
  bool wake_pending_ = false;     // guarded by inbox_mu_
  bool stopped_ = false;          // guarded by inbox_mu_: thread gone
  std::mutex inline_mu_;          // serializes work run after stop
  std::vector<Item> work_;        // progress thread

  absl::flat_hash_map<uint64_t, std::shared_ptr<QpCore>> conns_;
  std::vector<QpCore*> active_;
  std::vector<QpCore*> servicing_;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_;
  std::unique_ptr<char[]> discard_;
  bool stop_ = false;
  // CheckReactors: armed (a timer with id 0), and each driven CQ's
  // heartbeat at the last check.
  bool reactor_check_armed_ = false;
  absl::flat_hash_map<CqCore*, uint64_t> rx_beats_;
};

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_ENGINE_H_
