#include "transport/errors.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

namespace coverbs::transport {
namespace {
constexpr char kWcStatusPayload[] = "coverbs.dev/wc_status";
}

const char* WcStatusName(ibv_wc_status s) {
  switch (s) {
#define CASE(x) \
  case x:       \
    return #x;
    CASE(IBV_WC_SUCCESS)
    CASE(IBV_WC_LOC_LEN_ERR)
    CASE(IBV_WC_LOC_QP_OP_ERR)
    CASE(IBV_WC_LOC_EEC_OP_ERR)
    CASE(IBV_WC_LOC_PROT_ERR)
    CASE(IBV_WC_WR_FLUSH_ERR)
    CASE(IBV_WC_MW_BIND_ERR)
    CASE(IBV_WC_BAD_RESP_ERR)
    CASE(IBV_WC_LOC_ACCESS_ERR)
    CASE(IBV_WC_REM_INV_REQ_ERR)
    CASE(IBV_WC_REM_ACCESS_ERR)
    CASE(IBV_WC_REM_OP_ERR)
    CASE(IBV_WC_RETRY_EXC_ERR)
    CASE(IBV_WC_RNR_RETRY_EXC_ERR)
    CASE(IBV_WC_LOC_RDD_VIOL_ERR)
    CASE(IBV_WC_REM_INV_RD_REQ_ERR)
    CASE(IBV_WC_REM_ABORT_ERR)
    CASE(IBV_WC_INV_EECN_ERR)
    CASE(IBV_WC_INV_EEC_STATE_ERR)
    CASE(IBV_WC_FATAL_ERR)
    CASE(IBV_WC_RESP_TIMEOUT_ERR)
    CASE(IBV_WC_GENERAL_ERR)
    CASE(IBV_WC_TM_ERR)
    CASE(IBV_WC_TM_RNDV_INCOMPLETE)
#undef CASE
  }
  return "IBV_WC_UNKNOWN";
}

const char* AsyncEventName(ibv_event_type t) {
  switch (t) {
#define CASE(x) \
  case x:       \
    return #x;
    CASE(IBV_EVENT_CQ_ERR)
    CASE(IBV_EVENT_QP_FATAL)
    CASE(IBV_EVENT_QP_REQ_ERR)
    CASE(IBV_EVENT_QP_ACCESS_ERR)
    CASE(IBV_EVENT_COMM_EST)
    CASE(IBV_EVENT_SQ_DRAINED)
    CASE(IBV_EVENT_PATH_MIG)
    CASE(IBV_EVENT_PATH_MIG_ERR)
    CASE(IBV_EVENT_DEVICE_FATAL)
    CASE(IBV_EVENT_PORT_ACTIVE)
    CASE(IBV_EVENT_PORT_ERR)
    CASE(IBV_EVENT_LID_CHANGE)
    CASE(IBV_EVENT_PKEY_CHANGE)
    CASE(IBV_EVENT_SM_CHANGE)
    CASE(IBV_EVENT_SRQ_ERR)
    CASE(IBV_EVENT_SRQ_LIMIT_REACHED)
    CASE(IBV_EVENT_QP_LAST_WQE_REACHED)
    CASE(IBV_EVENT_CLIENT_REREGISTER)
    CASE(IBV_EVENT_GID_CHANGE)
    CASE(IBV_EVENT_WQ_FATAL)
#undef CASE
  }
  return "IBV_EVENT_UNKNOWN";
}

absl::StatusCode CodeForWcStatus(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS:
      return absl::StatusCode::kOk;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
      return absl::StatusCode::kPermissionDenied;
    case IBV_WC_WR_FLUSH_ERR:
      return absl::StatusCode::kAborted;
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
      return absl::StatusCode::kUnavailable;
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status WcError(ibv_wc_status status, uint32_t vendor_err,
                     std::string_view op, uint32_t qp_num,
                     std::string_view device) {
  absl::Status s(CodeForWcStatus(status),
                 absl::StrFormat("%s on QP 0x%x (%s) failed: %s (%s, "
                                 "vendor_err 0x%x)",
                                 op, qp_num, device, ibv_wc_status_str(status),
                                 WcStatusName(status), vendor_err));
  s.SetPayload(kWcStatusPayload,
               absl::Cord(absl::StrFormat("%d", static_cast<int>(status))));
  return s;
}

std::optional<ibv_wc_status> WcStatusOf(const absl::Status& s) {
  auto p = s.GetPayload(kWcStatusPayload);
  if (!p) return std::nullopt;
  int v = 0;
  if (!absl::SimpleAtoi(std::string(*p), &v)) return std::nullopt;
  return static_cast<ibv_wc_status>(v);
}

}  // namespace coverbs::transport
