// The verbs provider on a host without RDMA devices (the usual developer
// machine and CI host): it must fail cleanly, never crash or hang.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "transport/provider.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::transport {
namespace {

class VerbsNoDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VerbsDevicesPresent()) {
      GTEST_SKIP() << "an RDMA device is present: this suite checks the "
                      "no-device path (verbs_provider_test covers devices)";
    }
  }
};

bool IsCleanNoDeviceError(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound ||
         s.code() == absl::StatusCode::kUnavailable;
}

TEST_F(VerbsNoDeviceTest, DevicesPresentIsFalse) {
  EXPECT_FALSE(VerbsDevicesPresent());
  EXPECT_FALSE(VerbsDevicesPresent());  // idempotent, nothing cached wrongly
}

TEST_F(VerbsNoDeviceTest, OpenFailsWithClearMessage) {
  auto p = OpenVerbsProvider(ProviderOptions{});
  ASSERT_FALSE(p.ok());
  std::printf("OpenVerbsProvider: %s\n", p.status().ToString().c_str());
  EXPECT_TRUE(IsCleanNoDeviceError(p.status())) << p.status();
  const std::string msg(p.status().message());
  EXPECT_NE(msg.find("no RDMA device"), std::string::npos) << msg;
  // It points at the way out.
  EXPECT_NE(msg.find("COVERBS_PROVIDER=soft"), std::string::npos) << msg;
}

TEST_F(VerbsNoDeviceTest, NamedDeviceFailsTheSameWay) {
  ProviderOptions options;
  options.device = "rxe0";
  options.port = 1;
  options.gid_index = 3;
  auto p = OpenVerbsProvider(options);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(IsCleanNoDeviceError(p.status())) << p.status();
}

TEST_F(VerbsNoDeviceTest, EnvironmentDoesNotChangeTheOutcome) {
  setenv("COVERBS_DEVICE", "siw0", 1);
  setenv("COVERBS_GID_INDEX", "not-a-number", 1);
  auto p = OpenVerbsProvider(ProviderOptions{});
  unsetenv("COVERBS_DEVICE");
  unsetenv("COVERBS_GID_INDEX");
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(IsCleanNoDeviceError(p.status())) << p.status();
}

TEST_F(VerbsNoDeviceTest, RepeatedOpensStayClean) {
  for (int i = 0; i < 3; ++i) {
    auto p = OpenVerbsProvider(ProviderOptions{});
    ASSERT_FALSE(p.ok());
    EXPECT_TRUE(IsCleanNoDeviceError(p.status())) << p.status();
  }
}

}  // namespace
}  // namespace coverbs::transport
