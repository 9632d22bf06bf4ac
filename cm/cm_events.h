// Internal (verbs provider): the rdma_cm event channel of one Context.
//
// Its fd is watched by the Context's reactor; each event is handed to the
// waiter registered for the event's cm_id (listen ids receive CONNECT_REQUEST
// for new ids) and is always acked -- after the waiter copied what it needs,
// since private data lives in the event.
#ifndef COVERBS_CM_CM_EVENTS_H_
#define COVERBS_CM_CM_EVENTS_H_

#include <rdma/rdma_cma.h>

#include <memory>

#include "absl/status/statusor.h"
#include "core/reactor.h"

namespace coverbs::cm::internal {

class CmEventChannel {
 public:
  static absl::StatusOr<std::unique_ptr<CmEventChannel>> Create(
      Reactor& reactor);
  ~CmEventChannel();
  CmEventChannel(const CmEventChannel&) = delete;

  rdma_event_channel* channel() const { return channel_; }
  Reactor& reactor() const { return *reactor_; }

 private:
  CmEventChannel(Reactor* r, rdma_event_channel* ch)
      : reactor_(r), channel_(ch) {}
  Reactor* reactor_;
  rdma_event_channel* channel_;
};

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_CM_EVENTS_H_
