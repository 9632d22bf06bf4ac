// Internal, for tests (//cm:internal): a Connect that sends `private_data`
// instead of the encoded handshake -- garbage, truncated data, another
// protocol version -- to check that listeners refuse it with a reason.
#ifndef COVERBS_CM_CONNECT_FOR_TEST_H_
#define COVERBS_CM_CONNECT_FOR_TEST_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cm/connect.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "core/task.h"

namespace coverbs::cm::internal {

Task<absl::StatusOr<std::unique_ptr<Connection>>> ConnectWithPrivateData(
    Worker& ctx, const std::string& address, uint16_t port,
    const ConnectOptions& options, const std::string& private_data);

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_CONNECT_FOR_TEST_H_
