// Provider selection: auto | verbs | soft, from options or COVERBS_PROVIDER.
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "absl/strings/str_format.h"
#include "core/log.h"
#include "transport/provider.h"
#include "transport/soft/soft_provider.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::transport {

absl::StatusOr<std::unique_ptr<Provider>> OpenProvider(
    const ProviderOptions& options) {
  ProviderOptions o = options;
  if (o.kind.empty()) {
    const char* env = std::getenv("COVERBS_PROVIDER");
    o.kind = env != nullptr && *env != '\0' ? env : "auto";
  }
  if (o.device.empty()) {
    if (const char* env = std::getenv("COVERBS_DEVICE")) o.device = env;
  }
  std::string why;
  absl::StatusOr<std::unique_ptr<Provider>> p;
  if (o.kind == "soft") {
    p = CreateSoftProvider();
    why = "requested";
  } else if (o.kind == "verbs") {
    p = OpenVerbsProvider(o);
    why = "requested";
  } else if (o.kind == "auto") {
    if (VerbsDevicesPresent()) {
      p = OpenVerbsProvider(o);
      why = "auto: an RDMA device is present";
    } else {
      p = CreateSoftProvider();
      why = "auto: no RDMA device found";
    }
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unknown provider '%s' (expected auto, verbs or soft)", o.kind));
  }
  if (!p.ok()) return p.status();
  static std::once_flag logged;
  std::call_once(logged, [&] {
    const DeviceCaps& c = (*p)->caps();
    COVERBS_LOG(kInfo, "transport", "provider %s, device %s (%s; %s)",
                c.provider, c.device_name, TransportKindName(c.transport),
                why);
  });
  return p;
}

}  // namespace coverbs::transport
