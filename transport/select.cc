// Provider selection: auto | verbs | soft | loop, from options or
// COVERBS_PROVIDER.
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "transport/loop/loop_provider.h"
#include "transport/provider.h"
#include "transport/soft/soft_provider.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::transport {

absl::StatusOr<ProviderKind> ParseProviderKind(std::string_view name) {
  if (name.empty()) return ProviderKind::kDefault;
  if (name == "auto") return ProviderKind::kAuto;
  if (name == "verbs") return ProviderKind::kVerbs;
  if (name == "soft") return ProviderKind::kSoft;
  if (name == "loop") return ProviderKind::kLoop;
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown provider '%s' (expected auto, verbs, soft or loop)", name));
}

std::string_view ProviderKindName(ProviderKind kind) {
  switch (kind) {
    case ProviderKind::kDefault:
      return "default";
    case ProviderKind::kAuto:
      return "auto";
    case ProviderKind::kVerbs:
      return "verbs";
    case ProviderKind::kSoft:
      return "soft";
    case ProviderKind::kLoop:
      return "loop";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<Provider>> OpenProvider(
    const ProviderOptions& options) {
  ProviderOptions o = options;
  if (o.kind == ProviderKind::kDefault) {
    const char* env = std::getenv("COVERBS_PROVIDER");
    absl::StatusOr<ProviderKind> k =
        ParseProviderKind(env != nullptr && *env != '\0' ? env : "auto");
    if (!k.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("COVERBS_PROVIDER: ", k.status().message()));
    }
    o.kind = *k;
  }
  if (o.device.empty()) {
    if (const char* env = std::getenv("COVERBS_DEVICE")) o.device = env;
  }
  std::string why;
  absl::StatusOr<std::unique_ptr<Provider>> p;
  if (o.kind == ProviderKind::kSoft) {
    p = CreateSoftProvider();
    why = "requested";
  } else if (o.kind == ProviderKind::kLoop) {
    p = CreateLoopProvider();
    why = "requested";
  } else if (o.kind == ProviderKind::kVerbs) {
    p = OpenVerbsProvider(o);
    why = "requested";
  } else if (VerbsDevicesPresent()) {
    p = OpenVerbsProvider(o);
    why = "auto: an RDMA device is present";
  } else {
    p = CreateSoftProvider();
    why = "auto: no RDMA device found";
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
