#include "transport/async_queue.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"

namespace coverbs::transport {

absl::StatusOr<std::shared_ptr<AsyncQueue>> AsyncQueue::Create(
    std::string_view provider) {
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE);
  if (fd < 0) {
    return absl::InternalError(absl::StrFormat(
        "%s: eventfd for async events: %s", provider, strerror(errno)));
  }
  return std::shared_ptr<AsyncQueue>(new AsyncQueue(fd));
}

AsyncQueue::~AsyncQueue() { close(fd_); }

void AsyncQueue::Push(AsyncEvent ev) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::move(ev));
  uint64_t one = 1;
  ssize_t n = write(fd_, &one, sizeof(one));
  (void)n;
}

absl::StatusOr<AsyncEvent> AsyncQueue::Pop() {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.empty()) return absl::NotFoundError("no async event pending");
  AsyncEvent ev = std::move(events_.front());
  events_.pop_front();
  uint64_t v;
  ssize_t n = read(fd_, &v, sizeof(v));  // semaphore: takes one
  (void)n;
  return ev;
}

}  // namespace coverbs::transport
