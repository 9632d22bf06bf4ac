#include "bench/server.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/report.h"
#include "bench/test_kinds.h"

namespace coverbs::bench {

absl::Status Server::Start(const std::string& address, uint16_t port,
                           uint16_t rpc_port) {
  cm::ListenerOptions lo;
  lo.connection = BenchConnectionOptions();
  std::promise<absl::StatusOr<std::unique_ptr<cm::Listener>>> p;
  auto f = p.get_future();
  side_->pool().Post(0, [&]() {
    p.set_value(cm::Listener::Create(side_->workers->worker(0), address, port, lo));
  });
  auto ln = f.get();
  if (!ln.ok()) return ln.status();
  port_ = (*ln)->port();
  side_->pool().Spawn(0, AcceptLoop(*std::move(ln)), stop_.get_token());

  rpc::ServerOptions ro;
  ro.listener.connection = BenchConnectionOptions();
  ro.max_concurrent_calls = 512;
  rpc_ = std::make_unique<rpc::Server>(ro);
  absl::Status s = RegisterEcho(*rpc_);
  if (!s.ok()) return s;
  return rpc_->Start(side_->workers->workers(), address, rpc_port);
}

void Server::Shutdown() {
  rpc_->Shutdown();
  stop_.request_stop();
  for (int i = 0; i < 5000 && live_.load() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Task<void> Server::AcceptLoop(std::unique_ptr<cm::Listener> ln) {
  ++live_;
  size_t next = 0;
  while (true) {
    auto req = co_await ln->Next();
    if (!req.ok()) break;  // cancelled by Shutdown
    size_t i = next++ % side_->workers->size();
    side_->pool().Spawn(
        i, AcceptAndServe(*std::move(req), &side_->workers->worker(i)),
        stop_.get_token());
  }
  ln->Close();
  --live_;
}

Task<void> Server::AcceptAndServe(std::unique_ptr<cm::ConnectRequest> req,
                                  cm::Worker* ctx) {
  ++live_;
  auto conn = co_await req->Accept(*ctx);
  if (conn.ok()) {
    co_await Serve(conn->get());
    (void)co_await (*conn)->Close();
  } else {
    std::fprintf(stderr, "coverbs_bench: accept: %s\n",
                 conn.status().ToString().c_str());
  }
  --live_;
}

Task<void> Server::Serve(cm::Connection* conn) {
  while (true) {
    Params p;
    {
      auto m = co_await conn->Recv();
      if (!m.ok()) co_return;  // the client is done (or gone)
      if (m->size() != sizeof(Params)) {
        std::fprintf(stderr,
                     "coverbs_bench: %s: expected parameters, got %zu bytes\n",
                     conn->name().c_str(), m->size());
        co_return;
      }
      std::memcpy(&p, m->data().data(), sizeof(p));
    }
    if (p.magic != kMagic) {
      std::fprintf(stderr, "coverbs_bench: %s: bad parameter magic\n",
                   conn->name().c_str());
      co_return;
    }
    Reply rep;
    if (p.op == kOpCpuBegin) {
      cpu_begin_ = co_await PoolCpuAsync(&side_->pool());
    } else if (p.op == kOpCpuEnd) {
      rep.cpu_seconds = co_await PoolCpuAsync(&side_->pool()) - cpu_begin_;
    } else {
      absl::Status s = co_await Run(conn, p, &rep);
      if (!s.ok()) {
        rep.ok = 0;
        absl::SNPrintF(rep.error, sizeof(rep.error), "%s", s.ToString());
      }
    }
    if (!(co_await conn->Send(AsBytes(rep))).ok()) co_return;
  }
}

Task<absl::Status> Server::Run(cm::Connection* conn, const Params& p,
                               Reply* rep) {
  const Test test = static_cast<Test>(p.test);
  if (test == Test::kSendBw) co_return co_await ServeSendBw(conn, p, rep);
  if (test == Test::kSendLat) co_return co_await ServeSendLat(conn, p, rep);
  if (test == Test::kWriteBw || test == Test::kReadBw) {
    co_return co_await ServeOneSided(conn, p, rep);
  }
  co_return absl::InvalidArgumentError(absl::StrCat("unknown test ", p.test));
}

}  // namespace coverbs::bench
