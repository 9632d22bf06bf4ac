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
// sets verbs), else soft -- and the in-process loop provider with
// `in_process` -- plus verbs when a device is present.
inline std::vector<std::string> Providers(bool in_process = false) {
  const char* env = std::getenv("COVERBS_PROVIDER");
  if (env != nullptr && *env != '\0' && std::string(env) != "auto") {
    return {env};
  }
  std::vector<std::string> v = {"soft"};
  if (in_process) v.push_back("loop");
  if (transport::VerbsDevicesPresent()) v.push_back("verbs");
  return v;
}

// For suites whose peers all live in the test's process: loop completes
// every work request at once, in the posting thread, an order of events no
// wire makes (it found a rendezvous budget that waited for ever).
inline std::vector<std::string> InProcessProviders() { return Providers(true); }

}  // namespace coverbs::cm

#endif  // COVERBS_TESTS_CM_TEST_UTIL_H_
