#include "cm/worker.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cm/connection_impl.h"
#include "cm/worker_shared.h"
#include "core/log.h"

namespace coverbs::cm {

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(
    Reactor& reactor, transport::Device& device, WorkerOptions options) {
  std::unique_ptr<Worker> ctx(new Worker());
  ctx->reactor_ = &reactor;
  ctx->device_ = &device;
  ctx->options_ = options;
  if (options.pd != nullptr) {
    if (options.pd->device() != &device) {
      return absl::InvalidArgumentError(
          "cm::Worker: the shared PD belongs to another device");
    }
    ctx->pd_ = options.pd;
  } else {
    auto pd = device.AllocPd();
    if (!pd.ok()) return pd.status();
    ctx->owned_pd_ = std::move(*pd);
    ctx->pd_ = ctx->owned_pd_.get();
  }
  int cq_entries = options.cq_entries;
  if (cq_entries == 0 && options.srq_depth > 0) {
    // The SRQ's receives all complete on this CQ: room for them on top of
    // the default, so that --srq_depth alone is a working configuration.
    uint64_t want = uint64_t{options.srq_depth} +
                    static_cast<uint64_t>(
                        transport::CompletionQueue::DefaultEntries(device));
    uint32_t max = device.caps().max_cqe;
    cq_entries =
        static_cast<int>(std::min<uint64_t>(want, max != 0 ? max : want));
  }
  auto cq = transport::CompletionQueue::Create(device, reactor, cq_entries);
  if (!cq.ok()) return cq.status();
  ctx->cq_ = std::move(*cq);
  if (options.srq_depth > static_cast<uint32_t>(ctx->cq_->capacity())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cm::Worker on %s: WorkerOptions::srq_depth %d does not fit its "
        "completion queue of %d entries (cq_entries)",
        device.name(), options.srq_depth, ctx->cq_->capacity()));
  }
  auto connector = transport::OpenConnector(device, reactor);
  if (!connector.ok()) return connector.status();
  ctx->connector_ = *std::move(connector);
  ctx->reg_cache_ = std::make_unique<transport::RegistrationCache>(*ctx->pd_);
  ctx->shared_ = std::make_unique<internal::WorkerShared>();
  ctx->shared_->qp_events = internal::QpEvents::For(device);
  reactor.Spawn(internal::QpEvents::Watch(ctx->shared_->qp_events,
                                          ctx->shared_->qp_events->fd(),
                                          &reactor),
                ctx->shared_->watch_stop.get_token());
  ctx->shared_->large_memory = std::make_shared<internal::LargeMemoryCache>(
      options.rendezvous_cache_bytes);
  // Idle landing blocks stay registered, i.e. pinned and counted against
  // RLIMIT_MEMLOCK: keep only what the grants of a few busy connections
  // cycle through (a block is idle between its Message's end and its next
  // grant), not the rendezvous cache's 64 MiB.
  constexpr size_t kMaxIdleLandingBytes = 8 << 20;
  ctx->shared_->landing_memory = std::make_shared<internal::LargeMemoryCache>(
      std::min(options.rendezvous_cache_bytes, kMaxIdleLandingBytes),
      /*keep_registrations=*/true);
  return ctx;
}

// Connections still on the Worker are ended and let go of first
// (ShutdownConnections); the shared state (pools, SRQ) goes before the CQ
// and PD it was created on.
Worker::~Worker() {
  if (shared_ != nullptr) internal::ShutdownConnections(*this);
  shared_.reset();
  connector_.reset();
  reg_cache_.reset();
  cq_.reset();
  owned_pd_.reset();
}

int Worker::cq_count() const {
  return 1 + static_cast<int>(shared_->more_cqs.size());
}

namespace internal {

absl::StatusOr<transport::CompletionQueue*> CqWithRoom(Worker& ctx,
                                                       int entries) {
  if (ctx.cq().free_entries() >= entries) return &ctx.cq();
  auto& more = SharedOf(ctx).more_cqs;
  for (auto& cq : more) {
    if (cq->free_entries() >= entries) return cq.get();
  }
  if (entries > ctx.cq().capacity()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "a connection needs %d completion queue entries but a CQ on %s has "
        "%d (raise WorkerOptions::cq_entries or lower the connection's "
        "send_depth / recv_credits)",
        entries, ctx.device().name(), ctx.cq().capacity()));
  }
  if (ctx.cq_count() >= ctx.options().max_cqs) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "every completion queue on %s is full: %d CQs of %d entries "
        "(WorkerOptions::max_cqs, cq_entries), %d more entries requested",
        ctx.device().name(), ctx.cq_count(), ctx.cq().capacity(), entries));
  }
  auto cq = transport::CompletionQueue::Create(ctx.device(), ctx.reactor(),
                                               ctx.cq().capacity());
  if (!cq.ok()) {
    return absl::Status(
        cq.status().code(),
        absl::StrFormat("creating completion queue %d on %s: %s",
                        ctx.cq_count() + 1, ctx.device().name(),
                        cq.status().message()));
  }
  more.push_back(*std::move(cq));
  return more.back().get();
}

namespace {

// The live connections of `sh`, as weak references: ending one may end
// others' holders, and a destroyed one leaves the set meanwhile.
std::vector<std::weak_ptr<ConnectionImpl>> LiveConnections(WorkerShared& sh) {
  std::vector<std::weak_ptr<ConnectionImpl>> v;
  v.reserve(sh.connections.size());
  for (ConnectionImpl* c : sh.connections) v.push_back(c->weak_from_this());
  return v;
}

Task<void> SleepFor(Reactor& r, absl::Duration d) { (void)co_await r.Sleep(d); }

}  // namespace

void ShutdownConnections(Worker& ctx) {
  WorkerShared& sh = SharedOf(ctx);
  if (sh.connections.empty()) return;
  const size_t open = sh.connections.size();
  // 1. Down, every one: the QP in the error state (its posted work
  // requests flush), every waiter -- receive loops, sends, calls -- woken.
  for (auto& w : LiveConnections(sh)) {
    if (auto c = w.lock()) c->ShutdownForWorker();
  }
  // 2. Their tasks unwind on the reactor and let go of them: an
  // rpc::Client's receive loop sees the end and fails its calls, the calls
  // return, internal sends end, a Close under way finishes. Only outside
  // the reactor's loop (RunMain, a test, a thread after Run): inside it,
  // running the loop again would resume tasks under the one running now.
  Reactor& r = ctx.reactor();
  const bool can_run = Reactor::Current() == nullptr;
  if (can_run) {
    const absl::Time until = absl::Now() + absl::Seconds(5);
    int idle = 0;
    while (!sh.connections.empty() && absl::Now() < until) {
      if (r.RunOnce()) {
        idle = 0;
        continue;
      }
      bool busy = false;
      for (ConnectionImpl* c : sh.connections) busy |= c->TeardownBusy();
      if (busy) {
        // Work requests still flushing, a Close waiting for its link, an
        // internal send: give them the loop (a completion or a timer ends
        // each).
        r.BlockOn(SleepFor(r, absl::Milliseconds(1)));
      } else if (++idle >= 3) {
        break;  // the rest is held by the application, not by a task
      }
    }
  }
  // 3. What is still held (an rpc::Client or a cm::Connection the
  // application keeps past its Worker, or a task of the loop when it could
  // not run) stays valid but down, and detached: nothing of it refers to
  // the Worker any more.
  const size_t held = sh.connections.size();
  for (auto& w : LiveConnections(sh)) {
    if (auto c = w.lock()) c->DetachFromWorker();
  }
  // Anything in the set without an owner (never the case: every
  // ConnectionImpl is made by make_shared) would dangle; drop it.
  sh.connections.clear();
  if (held > 0 && !can_run) {
    COVERBS_LOG(kWarning, "cm",
                "cm::Worker on %s destroyed inside its reactor's loop with %d "
                "connection(s) open (%d held): they are down and detached, but "
                "tasks still suspended on them must not run after it; destroy "
                "a Worker outside the loop, or close its connections first",
                ctx.device().name(), open, held);
  } else {
    COVERBS_LOG(kInfo, "cm",
                "cm::Worker on %s destroyed with %d connection(s) open: ended "
                "them (%d still held by the application, now detached)",
                ctx.device().name(), open, held);
  }
}

void ScheduleCqTrim(Worker& ctx) {
  WorkerShared& sh = SharedOf(ctx);
  if (sh.more_cqs.empty() || sh.trim_posted) return;
  sh.trim_posted = true;
  std::weak_ptr<int> alive = sh.trim_token;
  Worker* c = &ctx;
  ctx.reactor().Post([alive, c] {
    if (alive.expired()) return;
    WorkerShared& s = SharedOf(*c);
    s.trim_posted = false;
    std::erase_if(s.more_cqs, [](const auto& cq) {
      return cq->reserved() == 0 && !cq->InFlight();
    });
  });
}

}  // namespace internal

}  // namespace coverbs::cm
