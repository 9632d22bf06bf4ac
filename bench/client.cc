#include "bench/client.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stop_token>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bench/flags.h"
#include "bench/sample_clock.h"
#include "bench/test_kinds.h"
#include "cm/listener.h"

namespace coverbs::bench {
namespace {

// One run of `spec` on one connection: the parameters and the memory, then
// the test kind's driver.
Task<absl::Status> DriveInner(ClientConn* c, const RunSpec& spec,
                              ConnRun* out) {
  const size_t size = spec.size;
  const int depth = IsLatencyTest(spec.test) ? 1 : spec.depth;
  out->lat_ns.reserve(spec.iters);
  SampleNsPerTick();  // calibrated before the first sample

  if (spec.test == Test::kRpcRate || spec.test == Test::kRpcLat) {
    co_return co_await DriveRpc(c, spec, out);
  }

  Params p;
  p.test = static_cast<uint16_t>(spec.test);
  p.size = size;
  p.iters = spec.iters;
  p.slots = depth;
  p.verify = spec.verify;
  absl::Status s = co_await SendParams(c, p);
  if (!s.ok()) co_return s;
  s = co_await EnsureMemory(c, size * depth);
  if (!s.ok()) co_return s;

  if (spec.test == Test::kSendBw) co_return co_await DriveSendBw(c, spec, out);
  if (spec.test == Test::kSendLat)
    co_return co_await DriveSendLat(c, spec, out);
  // write_bw / read_bw
  co_return co_await DriveOneSided(c, spec, out);
}

Task<void> Drive(ClientConn* c, RunSpec spec, ConnRun* out,
                 std::promise<void>* done) {
  absl::Status s = co_await DriveInner(c, spec, out);
  if (!s.ok()) out->Error(s);
  if (out->start == Clock::time_point{}) out->start = Clock::now();
  if (out->end == Clock::time_point{}) out->end = Clock::now();
  done->set_value();
}

}  // namespace

Client::~Client() {
  for (auto& c : conns_) {
    RunOn<bool>(side_, c->reactor, [c = c.get()]() -> Task<bool> {
      if (c->rpc) (void)co_await c->rpc->Close();
      if (c->conn) (void)co_await c->conn->Close();
      c->rpc.reset();
      c->conn.reset();
      c->mr.Deregister();
      co_return true;
    });
  }
}

absl::Status Client::Connect(int n) {
  for (int k = 0; k < n; ++k) {
    auto c = std::make_unique<ClientConn>();
    c->reactor = k % side_->workers->size();
    c->ctx = &side_->workers->worker(c->reactor);
    ClientConn* cp = c.get();
    absl::Status s = RunOn<absl::Status>(
        side_, c->reactor, [this, cp]() -> Task<absl::Status> {
          cm::ConnectOptions o;
          o.connection = BenchConnectionOptions();
          auto conn = co_await cm::Connect(*cp->ctx, address_, port_, o);
          if (!conn.ok()) co_return conn.status();
          cp->conn = *std::move(conn);
          co_return absl::OkStatus();
        });
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "connecting to ", address_, ":", port_, ": ", s.ToString()));
    }
    conns_.push_back(std::move(c));
  }
  return absl::OkStatus();
}

absl::Status Client::ConnectRpc() {
  for (auto& c : conns_) {
    if (c->rpc) continue;
    ClientConn* cp = c.get();
    absl::Status s = RunOn<absl::Status>(
        side_, c->reactor, [this, cp]() -> Task<absl::Status> {
          rpc::ClientOptions o;
          o.connect.connection = BenchConnectionOptions();
          auto cl =
              co_await rpc::Client::Connect(*cp->ctx, address_, rpc_port_, o);
          if (!cl.ok()) co_return cl.status();
          cp->rpc = *std::move(cl);
          co_return absl::OkStatus();
        });
    if (!s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("connecting the RPC client to ", address_, ":",
                       rpc_port_, ": ", s.ToString()));
    }
  }
  return absl::OkStatus();
}

absl::Status Client::ServerCpu(Op op, double* seconds) {
  ClientConn* c = conns_[0].get();
  return RunOn<absl::Status>(side_, c->reactor,
                             [c, op, seconds]() -> Task<absl::Status> {
                               Params p;
                               p.op = op;
                               absl::Status s = co_await SendParams(c, p);
                               if (!s.ok()) co_return s;
                               ConnRun ignored;
                               Reply rep;
                               s = co_await ReadReply(c, &ignored, &rep);
                               *seconds = rep.cpu_seconds;
                               co_return s;
                             });
}

bool Client::RunBatch(RunSpec spec, std::vector<ConnRun>* runs, bool progress,
                      const std::string& label) {
  std::stop_source stop;
  spec.stop = stop.get_token();
  std::vector<ConnRun> batch(conns_.size());
  std::vector<std::promise<void>> done(conns_.size());
  std::vector<std::future<void>> futures;
  for (size_t k = 0; k < conns_.size(); ++k) {
    futures.push_back(done[k].get_future());
    side_->pool().Spawn(conns_[k]->reactor,
                       Drive(conns_[k].get(), spec, &batch[k], &done[k]),
                       spec.stop);
  }
  const auto t0 = Clock::now();
  const auto limit =
      t0 + absl::ToChronoNanoseconds(absl::GetFlag(FLAGS_run_timeout));
  const uint64_t total = spec.iters * conns_.size();
  const uint64_t base = g_progress_ops.load();
  bool shown = false, ok = true;
  for (auto& f : futures) {
    while (f.wait_for(std::chrono::milliseconds(200)) !=
           std::future_status::ready) {
      auto now = Clock::now();
      if (progress && now - t0 > std::chrono::seconds(2)) {
        std::fprintf(
            stderr, "\r%s: %llu/%llu ops, %.0f s   ", label.c_str(),
            static_cast<unsigned long long>(g_progress_ops.load() - base),
            static_cast<unsigned long long>(total),
            std::chrono::duration<double>(now - t0).count());
        shown = true;
      }
      if (ok && now > limit) {
        std::fprintf(stderr,
                     "\ncoverbs_bench: %s exceeded --run_timeout, cancelling\n",
                     label.c_str());
        stop.request_stop();
        ok = false;
      }
      if (!ok && now > limit + std::chrono::seconds(30)) {
        std::fprintf(
            stderr,
            "coverbs_bench: %s did not unwind 30 s after cancellation; "
            "exiting\n",
            label.c_str());
        std::_Exit(3);
      }
    }
  }
  if (shown) std::fprintf(stderr, "\r%*s\r", 60, "");
  for (auto& b : batch) runs->push_back(std::move(b));
  return ok;
}

}  // namespace coverbs::bench
