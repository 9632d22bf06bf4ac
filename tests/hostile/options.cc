#include <cstdlib>
#include <string>

#include "tests/hostile/hostile.h"

namespace hostile {

std::string ParseOptions(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      return "bad argument '" + a + "' (flags are --name=value)";
    }
    std::string k = a.substr(2, eq - 2), v = a.substr(eq + 1);
    char* end = nullptr;
    if (k == "mode") {
      o->mode = v;
    } else if (k == "address") {
      o->address = v;
    } else if (k == "port") {
      long p = std::strtol(v.c_str(), &end, 10);
      if (*end != '\0' || p <= 0 || p > 65535) return "bad --port " + v;
      o->port = static_cast<uint16_t>(p);
    } else if (k == "count") {
      long n = std::strtol(v.c_str(), &end, 10);
      if (*end != '\0' || n < 0 || n > 5000)
        return "bad --count " + v + " (0..5000)";
      o->count = static_cast<int>(n);
    } else if (k == "hold_ms") {
      long n = std::strtol(v.c_str(), &end, 10);
      if (*end != '\0' || n < 0 || n > 600000) return "bad --hold_ms " + v;
      o->hold = std::chrono::milliseconds(n);
    } else if (k == "seed") {
      o->seed = std::strtoull(v.c_str(), &end, 10);
      if (*end != '\0') return "bad --seed " + v;
    } else {
      return "unknown flag --" + k;
    }
  }
  if (o->mode.empty()) return "--mode is required";
  if (o->port == 0) return "--port is required";
  if (o->address.empty()) return "--address is empty";
  return "";
}

}  // namespace hostile
