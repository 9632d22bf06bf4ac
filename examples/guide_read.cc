// README.md, "Writing a service": a server that echoes a message and exposes
// a region, and a client that sends, gets the echo and RDMA-Reads the region
// (one process, one reactor; guide_test.sh runs it and counts its lines).
#include "coverbs/coverbs.h"
using namespace coverbs;

Task<absl::Status> Server(cm::Listener& listener, std::string& region) {
  CO_ASSIGN_OR_RETURN(auto conn, co_await listener.Accept());
  CO_ASSIGN_OR_RETURN(auto mr, conn->worker().pd().Register(
                                   AsBytes(region), Access::kRemoteRead));
  CO_ASSIGN_OR_RETURN(auto msg, co_await conn->Recv());
  CO_RETURN_IF_ERROR(co_await conn->Send(msg.data()));  // the echo
  CO_ASSIGN_OR_RETURN(auto exposed, conn->Expose(mr));
  CO_RETURN_IF_ERROR(co_await conn->Send(exposed.Encode()));  // where to read
  auto bye = co_await conn->Recv();  // until the client closes
  co_return absl::OkStatus();
}

Task<absl::Status> Client(cm::Worker& worker, uint16_t port) {
  CO_ASSIGN_OR_RETURN(auto conn, co_await cm::Connect(worker, "127.0.0.1", port));
  CO_RETURN_IF_ERROR(co_await conn->Send("hello"));
  CO_ASSIGN_OR_RETURN(auto echo, co_await conn->Recv());
  CO_ASSIGN_OR_RETURN(auto msg, co_await conn->Recv());
  CO_ASSIGN_OR_RETURN(auto remote, RemoteRegion::Decode(msg.data()));
  std::string copy(remote.length, '\0');
  CO_RETURN_IF_ERROR(co_await conn->Read(AsBytes(copy), remote));
  std::printf("echo: %s, read: %s\n", std::string(echo.text()).c_str(),
              copy.c_str());
  co_return co_await conn->Close();
}

Task<absl::Status> Main(cm::Worker& worker) {
  CO_ASSIGN_OR_RETURN(auto listener, cm::Listener::Create(worker, "127.0.0.1", 0));
  std::string region = "bytes the client reads by RDMA";
  auto server = Spawn(worker.reactor(), Server(*listener, region));
  CO_RETURN_IF_ERROR(co_await Client(worker, listener->port()));
  co_return co_await server.Join();
}

int main() { return RunMain(Main); }
