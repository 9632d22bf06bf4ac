// Addresses for cm tests: 127.0.0.1 on the host (soft provider); inside the
// VM harness the RDMA netdev's address (COVERBS_VM_ADDR_A).
#ifndef COVERBS_TESTS_CM_TEST_UTIL_H_
#define COVERBS_TESTS_CM_TEST_UTIL_H_

#include <cstdlib>
#include <string>

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

}  // namespace coverbs::cm

#endif  // COVERBS_TESTS_CM_TEST_UTIL_H_
