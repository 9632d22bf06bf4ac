#include "cm/cm_events.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace coverbs::cm::internal {

absl::StatusOr<std::unique_ptr<CmEventChannel>> CmEventChannel::Create(
    Reactor& reactor) {
  rdma_event_channel* ch = rdma_create_event_channel();
  if (ch == nullptr) {
    int err = errno;
    return absl::UnavailableError(
        absl::StrCat("rdma_create_event_channel failed: ", strerror(err),
                     " (is rdma_ucm loaded?)"));
  }
  // The reactor waits for readiness; reads must never block it.
  int flags = fcntl(ch->fd, F_GETFL);
  if (flags < 0 || fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    int err = errno;
    rdma_destroy_event_channel(ch);
    return absl::InternalError(absl::StrCat(
        "cm event channel: fcntl(O_NONBLOCK) failed: ", strerror(err)));
  }
  return std::unique_ptr<CmEventChannel>(new CmEventChannel(&reactor, ch));
}

CmEventChannel::~CmEventChannel() { rdma_destroy_event_channel(channel_); }

}  // namespace coverbs::cm::internal
