// pool_client: an rpc::ClientPool under load, for the recovery test
// (tests/rpc/pool_recovery_test.sh). `--callers` coroutines spread over the
// pool's reactors call Echo one after another until --run_for ends; a
// failed call pauses --pause_after_failure before the next (as a real
// caller backs off), so the process's CPU while the servers are down is
// the pool's own.
//
// Every --tick it prints one line (all counts cumulative):
//   tick ms=<epoch ms> ok=N fail=N cpu_ms=N live=N losses=N reconnects=N
//        connect_failures=N fail_fast=N drain_retries=N
// and each failed call as
//   fail start_ms=<epoch ms of its start> code=<status code> <message>
// At the end (after --run_for, or SIGTERM / SIGINT) "done ok=N fail=N
// bad=N" (bad: an echo with other bytes);
// exits 1 if bad > 0 or nothing succeeded.
#include <signal.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cm/worker_pool.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "rpc/client_pool.h"
#include "transport/device.h"
#include "transport/provider.h"

ABSL_FLAG(std::vector<std::string>, servers, {},
          "host:port of each server, comma-separated");
ABSL_FLAG(int, threads, 2, "reactors of the pool");
ABSL_FLAG(int, callers, 16, "calls in flight at once");
ABSL_FLAG(int, payload, 64, "bytes per Echo");
ABSL_FLAG(absl::Duration, run_for, absl::Seconds(10), "how long to call");
ABSL_FLAG(absl::Duration, tick, absl::Milliseconds(100), "report interval");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(2), "per call");
ABSL_FLAG(absl::Duration, pause_after_failure, absl::Milliseconds(20),
          "a caller's pause after a failed call");
ABSL_FLAG(absl::Duration, reconnect_max, absl::Milliseconds(500),
          "ClientPoolOptions::reconnect_max");
ABSL_FLAG(bool, wait_for_ready, false, "ClientPoolOptions::wait_for_ready");
ABSL_FLAG(std::string, provider, "soft",
          "soft, verbs or auto (tests/vm/wire: the guests' rxe or siw)");
ABSL_FLAG(int, retry_count, -1,
          "ConnectionOptions::qp.retry_cnt of the pool's connections (-1: "
          "the default)");
ABSL_FLAG(absl::Duration, keepalive, absl::ZeroDuration(),
          "ConnectionOptions::keepalive_interval of the pool's connections "
          "(0: off)");

namespace coverbs {
namespace {

std::atomic<uint64_t> ok_calls{0}, failed_calls{0}, bad_calls{0};
// SIGTERM / SIGINT end the run early, as --run_for would (a script that
// is done measuring; "done" is still printed).
std::atomic<bool> stop{false};
void OnStop(int) { stop.store(true); }
bool Running(absl::Time end) { return absl::Now() < end && !stop.load(); }

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

int64_t CpuMs() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1000 +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1000;
}

Task<void> Caller(rpc::ClientPool* pool, absl::Time end, WaitGroup* wg) {
  const std::string msg(absl::GetFlag(FLAGS_payload), 'p');
  const absl::Duration deadline = absl::GetFlag(FLAGS_deadline);
  const absl::Duration pause = absl::GetFlag(FLAGS_pause_after_failure);
  while (Running(end)) {
    rpc::CallOptions o;
    o.deadline = absl::Now() + deadline;
    const int64_t start = NowMs();
    auto r = co_await pool->Call("Echo", std::as_bytes(std::span(msg)), o);
    if (r.ok()) {
      (r->ToString() == msg ? ok_calls : bad_calls).fetch_add(1);
      continue;
    }
    failed_calls.fetch_add(1);
    std::printf("fail start_ms=%lld code=%s %s\n",
                static_cast<long long>(start),
                absl::StatusCodeToString(r.status().code()).c_str(),
                std::string(r.status().message()).c_str());
    std::fflush(stdout);
    if (!(co_await Reactor::Current()->Sleep(pause)).ok()) break;
  }
  wg->Done();
}

int Main() {
  rpc::ClientPoolOptions po;
  for (const std::string& s : absl::GetFlag(FLAGS_servers)) {
    std::pair<std::string, std::string> hp = absl::StrSplit(s, ':');
    uint32_t port = 0;
    if (!absl::SimpleAtoi(hp.second, &port) || port > 65535) {
      std::fprintf(stderr, "pool_client: bad --servers entry %s\n", s.c_str());
      return 2;
    }
    po.servers.push_back({hp.first, static_cast<uint16_t>(port)});
  }
  po.reconnect_min = absl::Milliseconds(20);
  po.reconnect_max = absl::GetFlag(FLAGS_reconnect_max);
  po.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  po.client.connect.connection.keepalive_interval =
      absl::GetFlag(FLAGS_keepalive);
  if (int r = absl::GetFlag(FLAGS_retry_count); r >= 0) {
    po.client.connect.connection.qp.retry_cnt = static_cast<uint8_t>(r);
  }
  transport::ProviderOptions prov;
  auto kind = transport::ParseProviderKind(absl::GetFlag(FLAGS_provider));
  if (!kind.ok()) {
    std::fprintf(stderr, "pool_client: %s\n", kind.status().ToString().c_str());
    return 2;
  }
  prov.kind = *kind;
  auto device = transport::Device::Open(prov);
  if (!device.ok()) {
    std::fprintf(stderr, "pool_client: %s\n",
                 device.status().ToString().c_str());
    return 1;
  }
  cm::WorkerPool::Options wo;
  wo.threads = absl::GetFlag(FLAGS_threads);
  auto workers = cm::WorkerPool::Create(**device, wo);
  if (!workers.ok()) {
    std::fprintf(stderr, "pool_client: %s\n",
                 workers.status().ToString().c_str());
    return 1;
  }
  auto pool = rpc::ClientPool::Create(**workers, po);
  if (!pool.ok()) {
    std::fprintf(stderr, "pool_client: %s\n", pool.status().ToString().c_str());
    return 2;
  }
  const absl::Time end = absl::Now() + absl::GetFlag(FLAGS_run_for);
  signal(SIGTERM, OnStop);
  signal(SIGINT, OnStop);
  const int callers = absl::GetFlag(FLAGS_callers);
  WaitGroup wg;
  for (int i = 0; i < callers; ++i) {
    wg.Add();
    (*workers)->reactors().Spawn(i % (*workers)->size(),
                                 Caller(pool->get(), end, &wg));
  }
  const absl::Duration tick = absl::GetFlag(FLAGS_tick);
  while (Running(end)) {
    absl::SleepFor(tick);
    const rpc::ClientPool::Stats s = (*pool)->stats();
    std::printf(
        "tick ms=%lld ok=%llu fail=%llu cpu_ms=%lld live=%llu losses=%llu "
        "reconnects=%llu connect_failures=%llu fail_fast=%llu "
        "drain_retries=%llu\n",
        static_cast<long long>(NowMs()),
        static_cast<unsigned long long>(ok_calls.load()),
        static_cast<unsigned long long>(failed_calls.load()),
        static_cast<long long>(CpuMs()),
        static_cast<unsigned long long>(s.live),
        static_cast<unsigned long long>(s.losses),
        static_cast<unsigned long long>(s.reconnects),
        static_cast<unsigned long long>(s.connect_failures),
        static_cast<unsigned long long>(s.fail_fast),
        static_cast<unsigned long long>(s.drain_retries));
    std::fflush(stdout);
  }
  // Callers end within a deadline and a pause of `end`; then the pool goes.
  std::promise<void> callers_done;
  (*workers)->reactors().Spawn(
      0, [](WaitGroup* wg, std::promise<void>* done) -> Task<void> {
        (void)co_await wg->Wait();
        done->set_value();
      }(&wg, &callers_done));
  callers_done.get_future().wait();
  (*pool)->Shutdown();
  std::printf("done ok=%llu fail=%llu bad=%llu\n",
              static_cast<unsigned long long>(ok_calls.load()),
              static_cast<unsigned long long>(failed_calls.load()),
              static_cast<unsigned long long>(bad_calls.load()));
  std::fflush(stdout);
  pool->reset();
  return bad_calls.load() == 0 && ok_calls.load() > 0 ? 0 : 1;
}

}  // namespace
}  // namespace coverbs

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return coverbs::Main();
}
