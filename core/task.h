// Task<T>: the coroutine type every coverbs API returns.
//
// Contract:
//  - Lazy: nothing runs until the Task is co_awaited (or handed to
//    Reactor::Spawn / Reactor::BlockOn).
//  - Move-only; owns its coroutine frame. Destroying a Task that never ran or
//    that is suspended destroys the frame (and, transitively, the frames of the
//    tasks it is awaiting).
//  - Symmetric transfer both ways (start and completion), so arbitrarily deep
//    await chains that complete synchronously use O(1) stack. When the
//    coroutine runs under a Trampoline (the Reactor always resumes through
//    one), the transfer goes through the trampoline loop instead of relying
//    on the compiler to turn `return handle;` into a tail call -- gcc does
//    not at -O0/-O1 or with ASan, and a million-deep chain would overflow.
//  - No allocation beyond the coroutine frame.
//  - Cancellation is ambient: each promise carries a std::stop_token that is
//    inherited by the tasks it awaits, and every waiting awaitable in coverbs
//    reads it from the awaiting promise (see core/cancel.h).
//  - coverbs does not use exceptions: an exception escaping a coroutine body
//    terminates the process.
#ifndef COVERBS_CORE_TASK_H_
#define COVERBS_CORE_TASK_H_

#include <coroutine>
#include <cstdlib>
#include <exception>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>

#include "core/frame_pool.h"

namespace coverbs {

template <typename T = void>
class Task;

namespace internal {

// Per-thread trampoline: while one is active, transfers are handed to its
// loop (next) instead of being resumed by a nested call.
struct Trampoline {
  std::coroutine_handle<> next;
  bool active = false;
};
inline thread_local Trampoline tls_trampoline;

// Transfers control to `h`: via the active trampoline, or by returning the
// handle for symmetric transfer when there is none.
inline std::coroutine_handle<> TransferTo(std::coroutine_handle<> h) noexcept {
  Trampoline& t = tls_trampoline;
  if (t.active) {
    t.next = h;
    return std::noop_coroutine();
  }
  return h;
}

// On an active trampoline `t`: resumes `h` and every coroutine it
// transfers to, with O(1) stack.
inline void RunOnTrampoline(Trampoline& t, std::coroutine_handle<> h) {
  t.next = h;
  while (t.next) {
    std::coroutine_handle<> c = t.next;
    t.next = nullptr;
    c.resume();
  }
}

// Resumes `h` and every coroutine it transfers to, with O(1) stack.
inline void ResumeOnTrampoline(std::coroutine_handle<> h) {
  Trampoline& t = tls_trampoline;
  Trampoline saved = t;
  t.active = true;
  RunOnTrampoline(t, h);
  t = saved;
}

// Reactor::Spawn's record of a task nobody awaits (core/reactor.cc).
struct DetachedRecord;
// A spawned task finished: forgets and frees its record (reactor thread).
void FinishDetached(DetachedRecord* r) noexcept;

// Shared by all promises: continuation + the ambient stop token.
class PromiseBase {
 public:
  // Frames from per-thread free lists (core/frame_pool.h).
  static void* operator new(size_t n) { return AllocFrame(n); }
  static void operator delete(void* p, size_t n) noexcept { FreeFrame(p, n); }

  std::suspend_always initial_suspend() noexcept { return {}; }

  struct FinalAwaiter {
    bool await_ready() const noexcept { return false; }
    template <typename P>
    std::coroutine_handle<> await_suspend(
        std::coroutine_handle<P> h) noexcept {
      PromiseBase& p = h.promise();
      if (p.continuation_) return TransferTo(p.continuation_);
      if (DetachedRecord* r = p.detached_) {
        // Spawned (Reactor::Spawn runs the task itself, without a wrapper
        // coroutine per spawn): nobody else will free the frame.
        FinishDetached(r);
        h.destroy();
      }
      return std::noop_coroutine();
    }
    void await_resume() const noexcept {}
  };
  FinalAwaiter final_suspend() noexcept { return {}; }

  [[noreturn]] void unhandled_exception() noexcept { std::terminate(); }

  void set_continuation(std::coroutine_handle<> c) noexcept {
    continuation_ = c;
  }
  const std::stop_token& stop_token() const noexcept { return stop_token_; }
  void set_stop_token(std::stop_token t) noexcept {
    stop_token_ = std::move(t);
    has_own_token_ = true;
  }
  // Inherit the awaiting coroutine's token unless one was set explicitly.
  void inherit_stop_token(const std::stop_token& t) noexcept {
    if (!has_own_token_) stop_token_ = t;
  }
  void inherit_stop_token(std::stop_token&& t) noexcept {
    if (!has_own_token_) stop_token_ = std::move(t);
  }
  // Reactor::Spawn: the frame frees itself when the task finishes.
  void set_detached(DetachedRecord* r) noexcept { detached_ = r; }

 private:
  std::coroutine_handle<> continuation_;
  DetachedRecord* detached_ = nullptr;
  std::stop_token stop_token_;
  bool has_own_token_ = false;
};

template <typename T>
class Promise : public PromiseBase {
 public:
  Task<T> get_return_object() noexcept;

  template <typename U>
    requires std::is_convertible_v<U&&, T>
  void return_value(U&& v) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    value_.emplace(std::forward<U>(v));
  }
  T& result() & noexcept { return *value_; }
  T&& result() && noexcept { return std::move(*value_); }

 private:
  std::optional<T> value_;
};

template <>
class Promise<void> : public PromiseBase {
 public:
  Task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void result() noexcept {}
};

// Concept: a promise type that carries an ambient stop token. Awaitables use
// it to honour cancellation without an explicit token argument.
template <typename P>
concept HasStopToken = requires(const P& p) {
  { p.stop_token() } -> std::convertible_to<const std::stop_token&>;
};

template <typename P>
std::stop_token StopTokenOf(std::coroutine_handle<P> h) noexcept {
  if constexpr (HasStopToken<P>) {
    return h.promise().stop_token();
  } else {
    return {};
  }
}

}  // namespace internal

template <typename T>
class [[nodiscard]] Task {
 public:
  using promise_type = internal::Promise<T>;
  using value_type = T;
  using Handle = std::coroutine_handle<promise_type>;

  Task() noexcept = default;
  explicit Task(Handle h) noexcept : handle_(h) {}
  Task(Task&& o) noexcept : handle_(std::exchange(o.handle_, {})) {}
  Task& operator=(Task&& o) noexcept {
    if (this != &o) {
      Reset();
      handle_ = std::exchange(o.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() { Reset(); }

  bool valid() const noexcept { return static_cast<bool>(handle_); }
  bool done() const noexcept { return handle_ && handle_.done(); }

  // Gives the task its own stop token instead of inheriting the awaiter's.
  void SetStopToken(std::stop_token t) noexcept {
    handle_.promise().set_stop_token(std::move(t));
  }

  // Low-level access for schedulers (Reactor::Spawn, WhenAll, bridges).
  Handle handle() const noexcept { return handle_; }
  Handle Release() noexcept { return std::exchange(handle_, {}); }

  struct Awaiter {
    Handle h;
    // Awaiting a Task that already finished resumes without suspending.
    bool await_ready() const noexcept { return !h || h.done(); }
    template <typename P>
    std::coroutine_handle<> await_suspend(
        std::coroutine_handle<P> awaiting) noexcept {
      h.promise().set_continuation(awaiting);
      h.promise().inherit_stop_token(internal::StopTokenOf(awaiting));
      return internal::TransferTo(h);
    }
    decltype(auto) await_resume() noexcept {
      if constexpr (std::is_void_v<T>) {
        return;
      } else {
        return std::move(h.promise()).result();
      }
    }
  };

  // co_await consumes the result (moves it out); the frame is freed when the
  // Task object (a temporary, usually) is destroyed.
  Awaiter operator co_await() && noexcept { return Awaiter{handle_}; }
  Awaiter operator co_await() & noexcept { return Awaiter{handle_}; }

 private:
  void Reset() noexcept {
    if (handle_) {
      handle_.destroy();
      handle_ = {};
    }
  }
  Handle handle_;
};

namespace internal {
template <typename T>
Task<T> Promise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<Promise<T>>::from_promise(*this));
}
inline Task<void> Promise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<Promise<void>>::from_promise(*this));
}
}  // namespace internal

// co_await CurrentStopToken() yields the ambient stop token of the calling
// coroutine without suspending.
struct CurrentStopToken {
  std::stop_token token;
  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    token = internal::StopTokenOf(h);
    return false;  // resume immediately
  }
  std::stop_token await_resume() noexcept { return std::move(token); }
};

namespace internal {

// co_await SwapStopToken{&t} exchanges the calling coroutine's (a Task's)
// ambient stop token with `t`, without suspending: what it awaits from then
// on sees the new token. For a coroutine that must run part of its body
// under another token without wrapping that part in a Task of its own (a
// frame per call); a second swap restores both. It holds a pointer, not a
// token: gcc 12 may destroy a co_await operand's temporaries twice.
struct SwapStopToken {
  std::stop_token* token;
  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) noexcept {
    std::stop_token old = h.promise().stop_token();
    h.promise().set_stop_token(std::move(*token));
    *token = std::move(old);
    return false;  // resume immediately
  }
  void await_resume() const noexcept {}
};

// Runs `t` with no stop token: teardown steps and posted work must finish
// even when the coroutine doing them was asked to stop (they are bounded on
// their own). `t` itself gets the empty token, so awaiting it does not
// inherit the awaiter's: no frame of its own.
template <typename T>
Task<T> Unstoppable(Task<T> t) {
  t.SetStopToken(std::stop_token{});
  return t;
}

}  // namespace internal

}  // namespace coverbs

#endif  // COVERBS_CORE_TASK_H_
