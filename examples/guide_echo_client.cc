// README.md, "Writing a service": calls Echo on guide_echo_server.
//   guide_echo_client [port]     (default 7471)
#include "coverbs/coverbs.h"
using namespace coverbs;

uint16_t port = 7471;

Task<absl::Status> Main(cm::Worker& worker) {
  CO_ASSIGN_OR_RETURN(auto client,
                      co_await rpc::Client::Connect(worker, "127.0.0.1", port));
  CO_ASSIGN_OR_RETURN(auto reply,
                      co_await client->Call("Echo", AsBytes("hello")));
  std::printf("%s\n", std::string(reply.text()).c_str());
  co_return co_await client->Close();
}

int main(int argc, char** argv) {
  if (argc > 1) port = std::atoi(argv[1]);
  return RunMain(Main);
}
