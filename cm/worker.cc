#include "cm/worker.h"

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cm/worker_shared.h"

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

// Connections are gone by now (the Worker outlives them); the shared
// state (pools, SRQ) goes before the CQ and PD it was created on.
Worker::~Worker() {
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
