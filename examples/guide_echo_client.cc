// README.md, "Writing a service": calls Echo on guide_echo_server, typed,
// with a deadline (a server that never answers fails it, no hang). Exits 1
// with the reason on any error (no such method, no server, the deadline).
//   guide_echo_client [port]     (default 7471)
#include "coverbs/coverbs.h"
using namespace coverbs;

uint16_t port = 7471;

Task<absl::Status> Main(cm::Worker& worker) {
  CO_ASSIGN_OR_RETURN(auto client,
                      co_await rpc::Client::Connect(worker, "127.0.0.1", port));
  const std::string hello = "hello";
  rpc::CallOptions o{.deadline = absl::Now() + absl::Seconds(10)};  // no hang
  CO_ASSIGN_OR_RETURN(auto reply,
                      co_await client->Call<std::string>("Echo", hello, o));
  std::printf("%s\n", reply.c_str());
  co_return co_await client->Close();
}

int main(int argc, char** argv) {
  if (argc > 1) port = std::atoi(argv[1]);
  return RunMain(Main);
}
