// Turning work-completion failures into absl::Status.
//
// Every failed RDMA operation surfaces as a Status whose message names the
// operation, the QP and ibv_wc_status_str, e.g.
//   "RDMA_WRITE on QP 0x11 (soft0) failed: remote access error
//    (IBV_WC_REM_ACCESS_ERR, vendor_err 0x0)"
// and which carries the exact ibv_wc_status as a payload, so callers (and
// the conformance suite) can branch on it with WcStatusOf().
#ifndef COVERBS_TRANSPORT_ERRORS_H_
#define COVERBS_TRANSPORT_ERRORS_H_

#include <infiniband/verbs.h>

#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "transport/provider.h"

namespace coverbs::transport {

// Name of the ibv_wc_status enumerator ("IBV_WC_REM_ACCESS_ERR").
const char* WcStatusName(ibv_wc_status s);

// Name of the ibv_event_type enumerator ("IBV_EVENT_QP_ACCESS_ERR");
// ibv_event_type_str gives words instead ("local access violation error").
const char* AsyncEventName(ibv_event_type t);

// The canonical code for a completion status: REM_ACCESS_ERR and
// LOC_PROT_ERR -> PermissionDenied, WR_FLUSH_ERR -> Aborted,
// RNR_RETRY_EXC_ERR / RETRY_EXC_ERR -> Unavailable, LOC_LEN_ERR /
// REM_INV_REQ_ERR -> InvalidArgument, others -> Internal.
absl::StatusCode CodeForWcStatus(ibv_wc_status s);

absl::Status WcError(ibv_wc_status status, uint32_t vendor_err,
                     std::string_view op, uint32_t qp_num,
                     std::string_view device);

// The ibv_wc_status carried by a Status made by WcError, if any.
std::optional<ibv_wc_status> WcStatusOf(const absl::Status& s);

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_ERRORS_H_
