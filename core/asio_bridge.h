// Boost.Asio bridge.
//
// 1. AsioDriver drives a Reactor from an asio::io_context on the same thread,
//    with no extra thread: it waits for the io_uring fd to become readable
//    (posix::stream_descriptor) and for the reactor's next timer deadline
//    (steady_timer), and calls Reactor::RunOnce() when either fires. Ready
//    work is pumped in bounded batches so neither loop starves the other.
// 2. AwaitTask(reactor, task) lets an asio::awaitable co_await a coverbs Task
//    running on `reactor` (any thread); the result is delivered on the
//    awaitable's executor.
// 3. AwaitAsio(executor, awaitable) lets a coverbs Task co_await an
//    asio::awaitable<T> (T void or default-constructible: Asio's co_spawn
//    needs that). An exception escaping the awaitable becomes an Internal
//    error; it does not cross into coverbs.
#ifndef COVERBS_CORE_ASIO_BRIDGE_H_
#define COVERBS_CORE_ASIO_BRIDGE_H_

// Boost 1.74's awaitable.hpp uses std::exchange without including <utility>.
#include <utility>
// clang-format off
#include <boost/asio.hpp>
// clang-format on

#include <chrono>
#include <coroutine>
#include <exception>
#include <optional>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "core/task.h"

namespace coverbs {

class AsioDriver {
 public:
  AsioDriver(boost::asio::io_context& io, Reactor& reactor)
      : io_(io), reactor_(reactor), fd_(io), timer_(io) {}
  ~AsioDriver() { Stop(); }
  AsioDriver(const AsioDriver&) = delete;

  // Starts driving. Call on the thread that runs io.run().
  absl::Status Start() {
    int fd = dup(reactor_.ring_fd());
    if (fd < 0) return absl::InternalError("dup of io_uring fd failed");
    boost::system::error_code ec;
    fd_.assign(fd, ec);
    if (ec) {
      return absl::InternalError("asio cannot watch the io_uring fd: " +
                                 ec.message());
    }
    running_ = true;
    boost::asio::post(io_, [this] { Pump(); });
    return absl::OkStatus();
  }

  // Stops driving; pending waits are cancelled.
  void Stop() {
    if (!running_) return;
    running_ = false;
    boost::system::error_code ec;
    fd_.cancel(ec);
    fd_.close(ec);
    timer_.cancel();
  }

  size_t pumps() const { return pumps_; }

 private:
  static constexpr int kBatch = 64;

  void Pump() {
    if (!running_) return;
    ++pumps_;
    for (int i = 0; i < kBatch && reactor_.RunOnce(); ++i) {
    }
    if (reactor_.HasReadyWork() || !reactor_.PrepareForExternalWait()) {
      boost::asio::post(io_, [this] { Pump(); });  // yield to other handlers
      return;
    }
    Arm();
  }

  void Arm() {
    if (!fd_wait_pending_) {
      fd_wait_pending_ = true;
      fd_.async_wait(boost::asio::posix::stream_descriptor::wait_read,
                     [this](const boost::system::error_code& ec) {
                       fd_wait_pending_ = false;
                       if (!ec) Pump();
                     });
    }
    std::optional<SteadyTime> next = reactor_.NextDeadline();
    if (next && (!timer_deadline_ || *next != *timer_deadline_)) {
      timer_deadline_ = next;
      timer_.expires_at(*next);
      timer_.async_wait([this](const boost::system::error_code& ec) {
        if (ec == boost::asio::error::operation_aborted) return;
        timer_deadline_.reset();
        Pump();
      });
    }
  }

  boost::asio::io_context& io_;
  Reactor& reactor_;
  boost::asio::posix::stream_descriptor fd_;
  boost::asio::steady_timer timer_;
  std::optional<SteadyTime> timer_deadline_;
  bool fd_wait_pending_ = false;
  bool running_ = false;
  size_t pumps_ = 0;
};

namespace internal {

template <typename T, typename Handler>
Task<void> CompleteAsioHandler(Task<T> task, Handler handler) {
  auto ex = boost::asio::get_associated_executor(handler);
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    boost::asio::post(ex, [h = std::move(handler)]() mutable { std::move(h)(); });
  } else {
    T value = co_await std::move(task);
    boost::asio::post(ex, [h = std::move(handler),
                           v = std::move(value)]() mutable {
      std::move(h)(std::move(v));
    });
  }
}

template <typename T>
struct AsioSignature {
  using type = void(T);
};
template <>
struct AsioSignature<void> {
  using type = void();
};

}  // namespace internal

// co_await from an asio::awaitable: runs `task` on `reactor` (Spawn) and
// resumes the awaitable with its result.
template <typename T>
boost::asio::awaitable<T> AwaitTask(Reactor& reactor, Task<T> task) {
  return boost::asio::async_initiate<
      const boost::asio::use_awaitable_t<>&,
      typename internal::AsioSignature<T>::type>(
      [&reactor](auto handler, Task<T> t) {
        reactor.Spawn(internal::CompleteAsioHandler<T>(std::move(t),
                                                       std::move(handler)));
      },
      boost::asio::use_awaitable, std::move(task));
}

// co_await from a coverbs Task: runs `aw` on `ex` and resumes the task on
// its own reactor.
template <typename T, typename Executor>
class AsioAwaiter {
 public:
  AsioAwaiter(Executor ex, boost::asio::awaitable<T> aw)
      : ex_(std::move(ex)), aw_(std::move(aw)) {}
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    Reactor* r = Reactor::Current();
    auto done = [this, r, h](std::exception_ptr e, auto&&... v) {
      if (!e) {
        if constexpr (sizeof...(v) > 0) {
          (result_.emplace(std::move(v)), ...);
        } else {
          ok_ = true;
        }
      }
      r->Schedule(h);
    };
    boost::asio::co_spawn(ex_, std::move(aw_), std::move(done));
  }
  auto await_resume() {
    if constexpr (std::is_void_v<T>) {
      return ok_ ? absl::OkStatus()
                 : absl::InternalError("asio awaitable ended with an exception");
    } else {
      if (!result_) {
        return absl::StatusOr<T>(
            absl::InternalError("asio awaitable ended with an exception"));
      }
      return absl::StatusOr<T>(std::move(*result_));
    }
  }

 private:
  Executor ex_;
  boost::asio::awaitable<T> aw_;
  std::optional<std::conditional_t<std::is_void_v<T>, int, T>> result_;
  bool ok_ = false;
};

template <typename T, typename Executor>
AsioAwaiter<T, Executor> AwaitAsio(Executor ex, boost::asio::awaitable<T> aw) {
  return AsioAwaiter<T, Executor>(std::move(ex), std::move(aw));
}

}  // namespace coverbs

#endif  // COVERBS_CORE_ASIO_BRIDGE_H_
