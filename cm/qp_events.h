// Internal: why a connection's QP failed, from the device's asynchronous
// events.
//
// The side of a connection whose QP refused the peer's READ or WRITE (a bad
// key, range or access right) gets no failed work completion of its own:
// its QP goes to the error state and its receives flush, which alone reads
// as "peer gone". The device says why in an asynchronous event naming the
// QP (IBV_EVENT_QP_ACCESS_ERR; IBV_EVENT_QP_REQ_ERR for an invalid
// request, which is what siw raises for a bad key; rxe on Linux 6.1 has raised
// none by its flush, cm/README.md). QpEvents reads a device's events and keeps, for each QP a
// connection tracks, the first such event, for the connection to take when
// it decides its close cause.
//
// One QpEvents per transport::Device, shared by every Worker on it (events
// go to whichever reader reads them first, and a WorkerPool puts several
// Workers, on several threads, on one Device). Each Worker watches the
// device's event fd on its own reactor (Watch); a Worker being destroyed
// then never leaves the device unwatched. Thread-safe.
#ifndef COVERBS_CM_QP_EVENTS_H_
#define COVERBS_CM_QP_EVENTS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "core/reactor.h"
#include "core/task.h"
#include "transport/device.h"
#include "transport/provider.h"

namespace coverbs::cm::internal {

class QpEvents {
 public:
  explicit QpEvents(transport::Device& device) : device_(device) {}

  // The table of `device`, created by the first Worker to ask.
  static std::shared_ptr<QpEvents> For(transport::Device& device);

  // Reads the device's events as its fd becomes readable, on `reactor`,
  // until the awaiting coroutine's stop token is requested or the table is
  // gone (at once when the provider has no event fd). Holds no reference:
  // the Workers own the table, and it must not outlive their device.
  static Task<void> Watch(std::weak_ptr<QpEvents> table, int fd,
                          Reactor* reactor);
  int fd() const { return device_.async_event_fd(); }

  // Events naming `qp_num` are kept from now on (a QP number of a destroyed
  // QP may come back: Track forgets what an earlier one left).
  void Track(uint32_t qp_num);
  // Before the QP is destroyed: its events are no longer kept.
  void Forget(uint32_t qp_num);

  // The error event the device raised on `qp_num`, if any. Reads the
  // events pending on the device first (without waiting), so that an event
  // raised before this call is found even when no watcher has read it yet.
  std::optional<transport::AsyncEvent> ErrorOf(uint32_t qp_num);

 private:
  void DrainLocked();  // mu_ held
  void RecordLocked(const transport::AsyncEvent& ev);

  transport::Device& device_;
  // Held while reading from the device too: an event read by one thread is
  // recorded before another thread's ErrorOf can look.
  std::mutex mu_;
  absl::flat_hash_map<uint32_t, std::optional<transport::AsyncEvent>>
      tracked_;
};

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_QP_EVENTS_H_
