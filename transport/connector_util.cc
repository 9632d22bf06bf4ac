#include "transport/connector_util.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/sync.h"

namespace coverbs::transport::connector_util {

std::string SocketAddress::Numeric() const {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (family() == AF_INET) {
    inet_ntop(AF_INET,
              &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf,
              sizeof(buf));
  } else if (family() == AF_INET6) {
    inet_ntop(AF_INET6,
              &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf,
              sizeof(buf));
  }
  return buf;
}

bool SocketAddress::IsLoopback() const {
  if (family() == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&storage);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (family() == AF_INET6) {
    const in6_addr& a =
        reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&a) ||
           (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
  }
  return false;
}

absl::StatusOr<SocketAddress> ParseNumeric(const std::string& address,
                                           uint16_t port) {
  std::string a = address.empty() ? "0.0.0.0" : address;
  if (a.size() >= 2 && a.front() == '[' && a.back() == ']') {
    a = a.substr(1, a.size() - 2);
  }
  SocketAddress out;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out.storage);
  if (inet_pton(AF_INET, a.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    out.length = sizeof(sockaddr_in);
    return out;
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out.storage);
  if (inet_pton(AF_INET6, a.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    out.length = sizeof(sockaddr_in6);
    return out;
  }
  return absl::NotFoundError(
      absl::StrCat("'", address, "' is not a numeric IPv4 or IPv6 address"));
}

namespace {

// getaddrinfo for `name`: every TCP address, IPv4 and IPv6, in its order.
absl::StatusOr<std::vector<SocketAddress>> GetAddrInfo(const std::string& name,
                                                       uint16_t port,
                                                       int flags) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(name.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat(
        "address resolution failed: '", name,
        "': ", rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc)));
  }
  std::vector<SocketAddress> out;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) ||
        ai->ai_addrlen > sizeof(sockaddr_storage)) {
      continue;
    }
    SocketAddress a;
    std::memcpy(&a.storage, ai->ai_addr, ai->ai_addrlen);
    a.length = ai->ai_addrlen;
    // One entry per address (getaddrinfo may repeat one per protocol).
    const bool seen = std::any_of(out.begin(), out.end(), [&](const auto& o) {
      return o.length == a.length &&
             std::memcmp(&o.storage, &a.storage, a.length) == 0;
    });
    if (!seen) out.push_back(a);
  }
  freeaddrinfo(res);
  if (out.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "address resolution failed: '", name, "' has no IPv4 or IPv6 address"));
  }
  return out;
}

// A lookup's result, shared by the waiting coroutine and the thread that
// runs getaddrinfo (which may outlive the wait).
struct Lookup {
  Event done;
  std::mutex mu;
  absl::StatusOr<std::vector<SocketAddress>> result =
      absl::UnknownError("not resolved");
};

}  // namespace

absl::StatusOr<SocketAddress> ListenAddress(const std::string& address,
                                            uint16_t port) {
  auto numeric =
      ParseNumeric(address == "localhost" ? "127.0.0.1" : address, port);
  if (numeric.ok() || numeric.status().code() != absl::StatusCode::kNotFound) {
    return numeric;
  }
  auto all = GetAddrInfo(address, port, AI_PASSIVE);
  if (!all.ok()) {
    return absl::InvalidArgumentError(std::string(all.status().message()));
  }
  return all->front();
}

Task<absl::StatusOr<std::vector<SocketAddress>>> Resolve(
    const std::string& address, uint16_t port, absl::Duration timeout) {
  auto numeric = ParseNumeric(address, port);
  if (numeric.ok()) {
    co_return std::vector<SocketAddress>{*numeric};
  }
  auto lookup = std::make_shared<Lookup>();
  // getaddrinfo blocks (DNS): never on the reactor. The thread keeps the
  // lookup alive; a result nobody waits for any more is dropped with it.
  std::thread([lookup, address, port]() {
    auto r = GetAddrInfo(address, port, 0);
    {
      std::lock_guard<std::mutex> lock(lookup->mu);
      lookup->result = std::move(r);
    }
    lookup->done.Set();
  }).detach();
  absl::Status waited = co_await lookup->done.WaitFor(timeout);
  if (!waited.ok()) {
    if (waited.code() == absl::StatusCode::kDeadlineExceeded) {
      co_return absl::DeadlineExceededError(absl::StrCat(
          "address resolution of '", address, "' did not finish within ",
          absl::FormatDuration(timeout)));
    }
    co_return waited;
  }
  // Moved out, not copied: a copy would share the error's reference-counted
  // rep with the lookup, which the thread may be the last to release --
  // correct (absl counts atomically) but invisible to TSan, which cannot
  // see into Debian's uninstrumented absl and reports the release as a race.
  std::lock_guard<std::mutex> lock(lookup->mu);
  co_return std::move(lookup->result);
}

std::string Endpoint(const std::string& address, uint16_t port) {
  if (address.find(':') != std::string::npos && address.front() != '[') {
    return absl::StrCat("[", address, "]:", port);
  }
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
