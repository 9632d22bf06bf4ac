#include "examples/common.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <future>

#include "absl/strings/str_cat.h"

namespace coverbs::examples {

absl::StatusOr<std::unique_ptr<transport::Device>> OpenDevice(
    const std::string& provider, const std::string& device) {
  transport::ProviderOptions o;
  o.kind = provider;
  o.device = device;
  return transport::Device::Open(o);
}

absl::StatusOr<std::unique_ptr<ContextPool>> ContextPool::Create(
    transport::Device& device, size_t threads, PollMode poll_mode,
    transport::ProtectionDomain* pd) {
  ReactorOptions ro;
  ro.poll_mode = poll_mode;
  auto pool = ReactorPool::Create(threads, ro);
  if (!pool.ok()) return pool.status();
  std::unique_ptr<ContextPool> cp(new ContextPool());
  cp->pool_ = *std::move(pool);
  for (size_t i = 0; i < cp->pool_->size(); ++i) {
    std::promise<absl::StatusOr<std::unique_ptr<cm::Context>>> p;
    auto f = p.get_future();
    ReactorPool* rp = cp->pool_.get();
    rp->Post(i, [&p, &device, rp, i, pd]() {
      cm::ContextOptions o;
      o.pd = pd;
      p.set_value(cm::Context::Create(rp->reactor(i), device, o));
    });
    auto ctx = f.get();
    if (!ctx.ok()) return ctx.status();  // ~ContextPool cleans up the rest
    cp->contexts_.push_back(*std::move(ctx));
  }
  return cp;
}

ContextPool::~ContextPool() {
  for (size_t i = 0; i < contexts_.size(); ++i) {
    std::promise<void> p;
    auto f = p.get_future();
    pool_->Post(i, [this, &p, i]() {
      contexts_[i].reset();
      p.set_value();
    });
    f.get();
  }
  if (pool_) pool_->Stop();
}

std::vector<cm::Context*> ContextPool::contexts() const {
  std::vector<cm::Context*> v;
  for (const auto& c : contexts_) v.push_back(c.get());
  return v;
}

namespace {
sigset_t TerminationSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}
}  // namespace

void BlockTerminationSignals() {
  sigset_t set = TerminationSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForSignal(absl::Duration limit) {
  sigset_t set = TerminationSet();
  const absl::Time end = limit == absl::InfiniteDuration()
                             ? absl::InfiniteFuture()
                             : absl::Now() + limit;
  while (true) {
    // Wake at least once a minute so an infinite wait needs no special case.
    absl::Duration left = std::min(end - absl::Now(), absl::Minutes(1));
    if (left <= absl::ZeroDuration()) return 0;
    timespec ts = absl::ToTimespec(left);
    int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig > 0) return sig;
  }
}

int64_t Percentile(const std::vector<int64_t>& sorted, double p) {
  if (sorted.empty()) return 0;
  size_t rank = static_cast<size_t>(std::ceil(p * sorted.size()));
  if (rank == 0) rank = 1;
  return sorted[std::min(rank, sorted.size()) - 1];
}

void FillPattern(std::span<std::byte> out, uint64_t tag) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = PatternByte(tag, i);
}

int64_t FirstMismatch(std::span<const std::byte> in, uint64_t tag) {
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != PatternByte(tag, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

std::string DescribeDevice(const transport::Device& d) {
  if (d.caps().provider == "soft") return "soft";
  return absl::StrCat(d.caps().provider, " (", d.name(), ")");
}

}  // namespace coverbs::examples
