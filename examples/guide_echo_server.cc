// README.md, "Writing a service": the smallest echo RPC server, typed (with
// guide_echo_client.cc; guide_test.sh runs both and counts their lines).
//   guide_echo_server [port]     (default 7471; serves until SIGINT/SIGTERM)
#include "coverbs/coverbs.h"
using namespace coverbs;

Task<absl::StatusOr<std::string>> Echo(std::string text) { co_return text; }

int main(int argc, char** argv) {
  rpc::Server server;
  if (!server.Register("Echo", Echo).ok()) return 1;
  return Serve(server, "127.0.0.1", argc > 1 ? std::atoi(argv[1]) : 7471);
}
