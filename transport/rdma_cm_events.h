// Internal (verbs provider): the rdma_cm event channel of one reactor and
// the rdma_cm ids whose events it dispatches.
//
// The channel fd is watched by the Worker's reactor. Each event is copied
// (type, status, private data) into the queue of the CmId it belongs to --
// CONNECT_REQUESTs go to the listening id, carrying a new CmId -- and acked at
// once, so no id is ever destroyed with unacked events.
#ifndef COVERBS_TRANSPORT_RDMA_CM_EVENTS_H_
#define COVERBS_TRANSPORT_RDMA_CM_EVENTS_H_

#include <rdma/rdma_cma.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "core/task.h"
#include "transport/connection_link.h"

namespace coverbs::transport::rdma_cm {

class CmId;

struct CmEvent {
  rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_ERROR;
  int status = 0;
  std::string private_data;
  std::shared_ptr<CmId> request;  // CONNECT_REQUEST: the new id
  std::string peer;               // CONNECT_REQUEST: "addr:port"
  uint16_t peer_port = 0;
  std::string peer_addr;
};

class CmEventChannel {
 public:
  static absl::StatusOr<std::unique_ptr<CmEventChannel>> Create(
      Reactor& reactor);
  ~CmEventChannel();
  CmEventChannel(const CmEventChannel&) = delete;

  rdma_event_channel* channel() const;
  Reactor& reactor() const { return *reactor_; }

  struct Shared;  // what the watch loop and the ids share

 private:
  friend class CmId;
  CmEventChannel(Reactor* r, std::shared_ptr<Shared> s)
      : reactor_(r), shared_(std::move(s)) {}
  Reactor* reactor_;
  std::shared_ptr<Shared> shared_;
  std::stop_source stop_;
};

// One rdma_cm id and its event queue; the Link of an established verbs
// connection. Destroying it unregisters and destroys the id.
class CmId : public std::enable_shared_from_this<CmId> {
 public:
  static absl::StatusOr<std::shared_ptr<CmId>> Create(CmEventChannel* ch);
  ~CmId();

  rdma_cm_id* id() const { return id_; }
  CmEventChannel* channel() const { return channel_; }

  // The next event for this id (FIFO); DeadlineExceeded after `timeout`;
  // Cancelled with the caller's stop token.
  Task<absl::StatusOr<CmEvent>> Next(absl::Duration timeout);
  // Moves the id to another channel (rdma_migrate_id); events go there.
  absl::Status Migrate(CmEventChannel* to);
  // rdma_destroy_id may block while an address resolution is under way
  // (seen for minutes on siw): such ids are destroyed off the reactor.
  void set_destroy_in_background(bool on) { destroy_in_background_ = on; }
  // After ESTABLISHED: events drive the link instead of the queue.
  void SetEstablished(std::string describe);

  // Link behaviour.
  void Disconnect();
  Task<absl::Status> WaitDown(absl::Duration timeout);
  void OnDown(std::function<void(absl::Status)> fn);
  std::string Describe() const { return describe_; }

  // For the channel's watch loop only.
  static std::shared_ptr<CmId> AdoptRequest(CmEventChannel* ch, rdma_cm_id* id);
  void Deliver(CmEvent ev);  // on the channel's reactor thread

 private:
  CmId(CmEventChannel* ch, rdma_cm_id* id)
      : channel_(ch), shared_(ch->shared_), id_(id) {}
  void Register();

  CmEventChannel* channel_;
  // The channel's state, held (not only reached through channel_) because
  // an id may outlive its CmEventChannel object -- a task still holding a
  // listening id after its Worker went -- and the rdma_cm channel must
  // outlive every id on it.
  std::shared_ptr<CmEventChannel::Shared> shared_;
  rdma_cm_id* id_;
  std::deque<CmEvent> events_;
  Event signal_;
  bool established_ = false;
  bool local_disconnect_ = false;
  bool disconnect_called_ = false;
  bool destroy_in_background_ = false;
  bool down_ = false;
  Event down_event_;
  absl::Status down_why_;  // once down_
  std::function<void(absl::Status)> on_down_;
  std::string describe_;
};

std::unique_ptr<ConnectionLink> MakeVerbsLink(std::shared_ptr<CmId> id);

}  // namespace coverbs::transport::rdma_cm

#endif  // COVERBS_TRANSPORT_RDMA_CM_EVENTS_H_
