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
  po.kind = absl::GetFlag(FLAGS_provider);
  po.device = absl::GetFlag(FLAGS_device);
  auto d = transport::Device::Open(po);
  if (!d.ok()) return d.status();
  side->device = *std::move(d);
  ReactorOptions ro;
  ro.poll_mode = poll;
  auto pool = ReactorPool::Create(threads, ro);
  if (!pool.ok()) return pool.status();
  side->pool = *std::move(pool);
  for (size_t i = 0; i < side->pool->size(); ++i) {
    std::promise<absl::StatusOr<std::unique_ptr<cm::Context>>> p;
    auto f = p.get_future();
    Side* s = side.get();
    s->pool->Post(i, [&p, s, i]() {
      cm::ContextOptions co;
      // Room for many connections with deep queues on one CQ.
      co.cq_entries = 8192;
      p.set_value(cm::Context::Create(s->pool->reactor(i), *s->device, co));
    });
    auto ctx = f.get();
    if (!ctx.ok()) return ctx.status();
    side->contexts.push_back(*std::move(ctx));
  }
  return side;
}

Side::~Side() {
  for (size_t i = 0; i < contexts.size(); ++i) {
    std::promise<void> p;
    auto f = p.get_future();
    pool->Post(i, [this, &p, i]() {
      contexts[i].reset();
      p.set_value();
    });
    f.get();
  }
  if (pool) pool->Stop();
}

std::vector<cm::Context*> Side::context_ptrs() const {
  std::vector<cm::Context*> v;
  for (const auto& c : contexts) v.push_back(c.get());
  return v;
}

cm::ConnectionOptions BenchConnectionOptions() {
  cm::ConnectionOptions o;
  // Deep enough for --depth in flight plus the control messages.
  int depth = std::max(absl::GetFlag(FLAGS_depth), 1);
  o.recv_credits = std::clamp<uint32_t>(depth * 2, 64, 512);
  o.send_depth = std::clamp<uint32_t>(depth * 2, 64, 512);
  return o;
}

std::string Describe(const transport::Device& d) {
  if (d.caps().provider == "soft") return "soft";
  return absl::StrCat(d.caps().provider, " (", d.name(), ")");
}

}  // namespace coverbs::bench
