#include "transport/connector_util.h"

#include <arpa/inet.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace coverbs::transport::connector_util {

absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address,
                                         uint16_t port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  std::string a = address == "localhost" ? "127.0.0.1" : address;
  if (a.empty()) a = "0.0.0.0";
  if (inet_pton(AF_INET, a.c_str(), &sa.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", address,
        "' is not a numeric IPv4 address or 'localhost' (other host names "
        "are not resolved)"));
  }
  return sa;
}

std::string Endpoint(const std::string& address, uint16_t port) {
  return absl::StrCat(address, ":", port);
}

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

QpInit InitFor(QpSetup& setup) {
  const QpOptions& o = setup.qp_options();
  QpInit i;
  i.send_cq = setup.cq().provider();
  i.recv_cq = setup.recv_cq().provider();
  i.srq = o.srq;
  i.max_send_wr = o.max_send_wr;
  i.max_recv_wr = o.max_recv_wr;
  i.max_send_sge = o.max_send_sge;
  i.max_recv_sge = o.max_recv_sge;
  i.max_inline_data =
      std::min(o.max_inline_data, setup.cq().device()->caps().max_inline_data);
  i.rnr_retry = o.rnr_retry;
  i.min_rnr_timer = o.min_rnr_timer;
  i.retry_cnt = o.retry_cnt;
  i.timeout = o.timeout;
  return i;
}

}  // namespace coverbs::transport::connector_util
