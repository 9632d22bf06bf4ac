// ReactorPool: N threads, each running its own Reactor.
//
// Work reaches a reactor only through its thread-safe entry points (Post,
// Spawn, Schedule), so code running on reactor i stays single-threaded.
// Stop() stops every loop and joins the threads; the reactors (and the
// still-suspended tasks they track) are destroyed with the pool, after the
// threads have ended.
#ifndef COVERBS_CORE_REACTOR_POOL_H_
#define COVERBS_CORE_REACTOR_POOL_H_

#include <memory>
#include <stop_token>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "core/task.h"

namespace coverbs {

class ReactorPool {
 public:
  static absl::StatusOr<std::unique_ptr<ReactorPool>> Create(
      size_t threads, ReactorOptions options = {});
  ~ReactorPool();

  size_t size() const { return reactors_.size(); }
  Reactor& reactor(size_t i) { return *reactors_[i]; }
  void Post(size_t i, absl::AnyInvocable<void()> fn) {
    reactors_[i]->Post(std::move(fn));
  }
  void Spawn(size_t i, Task<void> task, std::stop_token token = {}) {
    reactors_[i]->Spawn(std::move(task), std::move(token));
  }
  // Round-robin choice, e.g. to spread accepted connections.
  size_t Next() { return next_++ % reactors_.size(); }

  // Stops every reactor and joins the threads. Idempotent.
  void Stop();

 private:
  ReactorPool() = default;
  std::vector<std::unique_ptr<Reactor>> reactors_;
  std::vector<std::thread> threads_;
  size_t next_ = 0;
};

}  // namespace coverbs

#endif  // COVERBS_CORE_REACTOR_POOL_H_
