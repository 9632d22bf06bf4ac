#include "bench/side.h"

#include <sys/resource.h>

#include <algorithm>
#include <future>
#include <memory>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "bench/flags.h"
#include "core/sync.h"

namespace coverbs::bench {
namespace {

double ThreadCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace

double PoolCpuBlocking(ReactorPool& pool) {
  double sum = 0;
  for (size_t i = 0; i < pool.size(); ++i) {
    std::promise<double> p;
    auto f = p.get_future();
    pool.Post(i, [&p]() { p.set_value(ThreadCpuSeconds()); });
    sum += f.get();
  }
  return sum;
}

Task<double> PoolCpuAsync(ReactorPool* pool) {
  double sum = 0;
  for (size_t i = 0; i < pool->size(); ++i) {
    if (&pool->reactor(i) == Reactor::Current()) {
      sum += ThreadCpuSeconds();
      continue;
    }
    auto ev = std::make_shared<Event>();
    auto v = std::make_shared<double>(0);
    pool->Post(i, [ev, v]() {
      *v = ThreadCpuSeconds();
      ev->Set();
    });
    (void)co_await ev->Wait();
    sum += *v;
  }
  co_return sum;
}

absl::StatusOr<std::unique_ptr<Side>> Side::Create(int threads, PollMode poll) {
  auto side = std::make_unique<Side>();
  transport::ProviderOptions po;
  absl::StatusOr<transport::ProviderKind> kind =
      transport::ParseProviderKind(absl::GetFlag(FLAGS_provider));
  if (!kind.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--provider: ", kind.status().message()));
  }
  po.kind = *kind;
  po.device = absl::GetFlag(FLAGS_device);
  auto d = transport::Device::Open(po);
  if (!d.ok()) return d.status();
  side->device = *std::move(d);
  cm::WorkerPool::Options o;
  o.threads = static_cast<size_t>(threads);
  o.reactor.poll_mode = poll;
  // Room for many connections with deep queues on one CQ.
  o.worker.cq_entries = 8192;
  auto workers = cm::WorkerPool::Create(*side->device, o);
  if (!workers.ok()) return workers.status();
  side->workers = *std::move(workers);
  return side;
}

cm::ConnectionOptions BenchConnectionOptions() {
  cm::ConnectionOptions o;
  // Deep enough for --depth in flight plus the control messages.
  int depth = std::max(absl::GetFlag(FLAGS_depth), 1);
  o.recv_credits = std::clamp<uint32_t>(depth * 2, 64, 512);
  o.send_depth = std::clamp<uint32_t>(depth * 2, 64, 512);
  if (int in = absl::GetFlag(FLAGS_inline_size); in >= 0) {
    o.qp.max_inline_data = static_cast<uint32_t>(in);
  }
  return o;
}

}  // namespace coverbs::bench
