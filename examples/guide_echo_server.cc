// README.md, "Writing a service": the smallest echo RPC server (with
// guide_echo_client.cc; guide_test.sh runs both and counts their lines).
//   guide_echo_server [port]     (default 7471; serves until SIGINT/SIGTERM)
#include "coverbs/coverbs.h"
using namespace coverbs;

int main(int argc, char** argv) {
  rpc::Server server;
  auto echo = [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
    co_return std::move(r.payload);
  };
  if (!server.Register("Echo", echo).ok()) return 1;
  return Serve(server, "127.0.0.1", argc > 1 ? std::atoi(argv[1]) : 7471);
}
