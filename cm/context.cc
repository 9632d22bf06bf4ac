#include "cm/context.h"

#include "absl/status/status.h"
#include "cm/context_shared.h"

namespace coverbs::cm {

absl::StatusOr<std::unique_ptr<Context>> Context::Create(
    Reactor& reactor, transport::Device& device, ContextOptions options) {
  std::unique_ptr<Context> ctx(new Context());
  ctx->reactor_ = &reactor;
  ctx->device_ = &device;
  ctx->options_ = options;
  if (options.pd != nullptr) {
    if (options.pd->device() != &device) {
      return absl::InvalidArgumentError(
          "cm::Context: the shared PD belongs to another device");
    }
    ctx->pd_ = options.pd;
  } else {
    auto pd = device.AllocPd();
    if (!pd.ok()) return pd.status();
    ctx->owned_pd_ = std::move(*pd);
    ctx->pd_ = ctx->owned_pd_.get();
  }
  auto cq =
      transport::CompletionQueue::Create(device, reactor, options.cq_entries);
  if (!cq.ok()) return cq.status();
  ctx->cq_ = std::move(*cq);
  auto connector = transport::OpenConnector(device, reactor);
  if (!connector.ok()) return connector.status();
  ctx->connector_ = *std::move(connector);
  ctx->reg_cache_ = std::make_unique<transport::RegistrationCache>(*ctx->pd_);
  ctx->shared_ = std::make_unique<internal::ContextShared>();
  ctx->shared_->large_memory = std::make_shared<internal::LargeMemoryCache>(
      options.rendezvous_cache_bytes);
  return ctx;
}

// Connections are gone by now (the Context outlives them); the shared
// state (pools, SRQ) goes before the CQ and PD it was created on.
Context::~Context() {
  shared_.reset();
  connector_.reset();
  reg_cache_.reset();
  cq_.reset();
  owned_pd_.reset();
}

}  // namespace coverbs::cm
