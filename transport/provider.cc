#include "transport/provider.h"

namespace coverbs::transport {

const char* TransportKindName(TransportKind k) {
  switch (k) {
    case TransportKind::kInfiniBand:
      return "InfiniBand";
    case TransportKind::kRoCE:
      return "RoCE";
    case TransportKind::kIWarp:
      return "iWARP";
    case TransportKind::kSoft:
      return "soft";
  }
  return "?";
}

}  // namespace coverbs::transport
