// The asynchronous event queue of a software provider instance (soft,
// loop): what ProviderDevice's async fd and GetAsyncEvent serve.
#ifndef COVERBS_TRANSPORT_ASYNC_QUEUE_H_
#define COVERBS_TRANSPORT_ASYNC_QUEUE_H_

#include <deque>
#include <memory>
#include <mutex>
#include <string_view>

#include "absl/status/statusor.h"
#include "transport/provider.h"

namespace coverbs::transport {

// fd() is a non-blocking semaphore eventfd: readable while events are
// pending. Push and Pop from any thread.
class AsyncQueue {
 public:
  // `provider` names the provider in the error when the eventfd cannot be
  // made.
  static absl::StatusOr<std::shared_ptr<AsyncQueue>> Create(
      std::string_view provider);
  ~AsyncQueue();
  int fd() const { return fd_; }
  void Push(AsyncEvent ev);
  absl::StatusOr<AsyncEvent> Pop();

 private:
  explicit AsyncQueue(int fd) : fd_(fd) {}
  const int fd_;
  std::mutex mu_;
  std::deque<AsyncEvent> events_;
};

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_ASYNC_QUEUE_H_
