// Addresses for cm tests: 127.0.0.1 on the host (soft provider); inside the
// VM harness the RDMA netdev's address (COVERBS_VM_ADDR_A).
#ifndef COVERBS_TESTS_CM_TEST_UTIL_H_
#define COVERBS_TESTS_CM_TEST_UTIL_H_

#include <cstdlib>
#include <string>
#include <vector>

#include "transport/verbs/verbs_provider.h"

namespace coverbs::cm {

inline std::string TestAddress() {
  if (const char* a = std::getenv("COVERBS_TEST_ADDR")) return a;
  if (const char* a = std::getenv("COVERBS_VM_ADDR_A")) return a;
  return "127.0.0.1";
}

// Same /24 as `addr`, host part .250: owned by nobody in the VM's subnet.
inline std::string UnusedPeerAddress(const std::string& addr) {
  size_t dot = addr.rfind('.');
  return addr.substr(0, dot + 1) + "250";
}

// The providers a suite runs on: COVERBS_PROVIDER if set (the VM harness
// sets verbs), else soft, plus verbs when a device is present.
inline std::vector<std::string> Providers() {
  const char* env = std::getenv("COVERBS_PROVIDER");
  if (env != nullptr && *env != '\0' && std::string(env) != "auto") {
    return {env};
  }
  std::vector<std::string> v = {"soft"};
  if (transport::VerbsDevicesPresent()) v.push_back("verbs");
  return v;
}

// Providers() plus the in-process loop provider, for suites whose peers
// all live in the test's process: loop completes every work request at
// once, in the posting thread, an order of events no wire makes (it found
// a rendezvous budget that waited for ever). With COVERBS_PROVIDER set,
// that one only.
inline std::vector<std::string> InProcessProviders() {
  std::vector<std::string> v = Providers();
  const char* env = std::getenv("COVERBS_PROVIDER");
  if (env == nullptr || *env == '\0' || std::string(env) == "auto") {
    v.insert(v.begin() + 1, "loop");
  }
  return v;
}

}  // namespace coverbs::cm

#endif  // COVERBS_TESTS_CM_TEST_UTIL_H_
