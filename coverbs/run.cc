#include "coverbs/run.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <future>
#include <memory>
#include <utility>

#include "cm/worker_pool.h"
#include "core/log.h"
#include "transport/device.h"

namespace coverbs {

namespace {

// `given`, or the device `provider` names, opened into *owned; logs why
// when it cannot be opened (null then).
transport::Device* DeviceOf(transport::Device* given,
                            const transport::ProviderOptions& provider,
                            std::unique_ptr<transport::Device>* owned) {
  if (given != nullptr) return given;
  auto d = transport::Device::Open(provider);
  if (!d.ok()) {
    COVERBS_LOG(kError, "run", "opening the device: %s",
                d.status().ToString().c_str());
    return nullptr;
  }
  *owned = *std::move(d);
  return owned->get();
}

// RunClientPool's main, on the pool's first reactor.
Task<void> RunOnPool(
    absl::AnyInvocable<Task<absl::Status>(rpc::ClientPool&)>* main,
    rpc::ClientPool* pool, std::promise<absl::Status>* done) {
  absl::Status s = co_await (*main)(*pool);
  done->set_value(std::move(s));
}

}  // namespace

int RunMain(absl::AnyInvocable<Task<absl::Status>(cm::Worker&)> main,
            const RunOptions& options) {
  auto reactor = Reactor::Create(options.reactor);
  if (!reactor.ok()) {
    COVERBS_LOG(kError, "run", "creating the reactor: %s",
                reactor.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<transport::Device> owned;
  transport::Device* device =
      DeviceOf(options.device, options.provider, &owned);
  if (device == nullptr) return 1;
  auto ctx = cm::Worker::Create(**reactor, *device, options.worker);
  if (!ctx.ok()) {
    COVERBS_LOG(kError, "run", "creating the worker: %s",
                ctx.status().ToString().c_str());
    return 1;
  }
  absl::Status s = (*reactor)->BlockOn(main(**ctx));
  // Why main failed first, then the teardown (which may log the
  // connections it ends).
  if (!s.ok()) COVERBS_LOG(kError, "run", "%s", s.ToString().c_str());
  // Outside the loop: a connection main left open (an rpc::Client
  // destroyed without Close, calls in flight, its receive loop) is ended
  // and its tasks run until they let go of it, before the Worker's CQs go
  // (cm::Worker's destructor); then the reactor destroys what is left.
  ctx->reset();
  return s.ok() ? 0 : 1;
}

int RunMain(absl::AnyInvocable<Task<absl::Status>(cm::Worker&)> main) {
  return RunMain(std::move(main), RunOptions());
}

int RunClientPool(
    absl::AnyInvocable<Task<absl::Status>(rpc::ClientPool&)> main,
    rpc::ClientPoolOptions pool_options, const PoolRunOptions& options) {
  std::unique_ptr<transport::Device> owned;
  transport::Device* device =
      DeviceOf(options.device, options.provider, &owned);
  if (device == nullptr) return 1;
  cm::WorkerPool::Options wo;
  wo.threads = std::max<size_t>(1, options.threads);
  wo.reactor = options.reactor;
  wo.worker = options.worker;
  auto workers = cm::WorkerPool::Create(*device, wo);
  if (!workers.ok()) {
    COVERBS_LOG(kError, "run", "starting %d reactors: %s", wo.threads,
                workers.status().ToString().c_str());
    return 1;
  }
  auto pool = rpc::ClientPool::Create(**workers, std::move(pool_options));
  if (!pool.ok()) {
    COVERBS_LOG(kError, "run", "creating the client pool: %s",
                pool.status().ToString().c_str());
    return 1;
  }
  std::promise<absl::Status> done;
  std::future<absl::Status> result = done.get_future();
  (*workers)->reactors().Spawn(0, RunOnPool(&main, pool->get(), &done));
  absl::Status s = result.get();
  if (!s.ok()) COVERBS_LOG(kError, "run", "%s", s.ToString().c_str());
  (*pool)->Shutdown();
  pool->reset();
  workers->reset();
  return s.ok() ? 0 : 1;
}

int RunClientPool(
    absl::AnyInvocable<Task<absl::Status>(rpc::ClientPool&)> main,
    rpc::ClientPoolOptions pool_options) {
  return RunClientPool(std::move(main), std::move(pool_options),
                       PoolRunOptions());
}

int Serve(rpc::Server& server, const std::string& address, uint16_t port,
          const ServeOptions& options) {
  // Blocked before the reactors start, so that they inherit the mask and
  // sigwait below is the one place the signals arrive.
  sigset_t stop, old;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, &old);
  int rc = 1;
  // Destroyed in reverse: the pool (its workers) before the PD, the PD
  // before the device.
  std::unique_ptr<transport::Device> owned_device;
  std::unique_ptr<transport::ProtectionDomain> owned_pd;
  do {
    transport::Device* device =
        DeviceOf(options.device, options.provider, &owned_device);
    if (device == nullptr) break;
    cm::WorkerPool::Options po;
    po.threads = options.threads;
    po.reactor = options.reactor;
    po.worker = options.worker;
    if (po.worker.pd == nullptr) {
      auto pd = device->AllocPd();
      if (!pd.ok()) {
        COVERBS_LOG(kError, "run", "allocating the protection domain: %s",
                    pd.status().ToString().c_str());
        break;
      }
      owned_pd = *std::move(pd);
      po.worker.pd = owned_pd.get();
    }
    auto pool = cm::WorkerPool::Create(*device, po);
    if (!pool.ok()) {
      COVERBS_LOG(kError, "run", "starting %d reactors: %s", options.threads,
                  pool.status().ToString().c_str());
      break;
    }
    // ServeContext::keep: after the server's shutdown, before the pool.
    std::vector<std::shared_ptr<void>> kept;
    if (options.setup) {
      absl::Status s =
          options.setup(ServeContext{*device, *po.worker.pd, **pool, kept});
      if (!s.ok()) {
        COVERBS_LOG(kError, "run", "setting up the service: %s",
                    s.ToString().c_str());
        break;
      }
    }
    absl::Status s = server.Start(**pool, address, port);
    if (!s.ok()) {
      COVERBS_LOG(kError, "run", "starting the server: %s",
                  s.ToString().c_str());
      break;
    }
    int sig = 0;
    sigwait(&stop, &sig);
    COVERBS_LOG(kInfo, "run", "signal %d: draining (at most %s)", sig,
                absl::FormatDuration(options.drain).c_str());
    server.Shutdown(options.drain);
    while (!kept.empty()) kept.pop_back();  // newest first
    rc = 0;
  } while (false);

  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return rc;
}

int Serve(rpc::Server& server, const std::string& address, uint16_t port) {
  return Serve(server, address, port, ServeOptions());
}

}  // namespace coverbs
