#include "rpc/client_pool.h"

#include <algorithm>
#include <stop_token>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "rpc/drain.h"

namespace coverbs::rpc {
namespace internal {

// One connection of a reactor: to one server. Touched on its reactor only.
struct PoolSlot {
  ServerAddress server;
  std::shared_ptr<Client> client;  // set while connected, null otherwise
  // `client` is counted in PoolReactor::live (and the pool's live gauge):
  // true from the connect until the first one to see the loss (a call or
  // Maintain) takes it out, so a dead connection is never picked again.
  bool counted_live = false;
  // The last connect attempt failed, and none succeeded since: calls fail
  // fast instead of waiting (unless wait_for_ready).
  bool attempt_failed = false;
  absl::Status last_error = absl::UnavailableError("not connected yet");
  Event down;  // a call saw the connection fail: act now
  // The server refused a call because it drains: out of rotation; its
  // calls in flight finish, then the pool closes it and reconnects.
  bool draining = false;
};

// A reactor's share of the pool. Touched on that reactor only (Shutdown
// posts to it); calls hold a reference, so it outlives them.
struct PoolReactor {
  cm::Worker* worker = nullptr;
  Reactor* reactor = nullptr;
  std::vector<std::shared_ptr<PoolSlot>> slots;
  size_t next = 0;  // round-robin cursor
  size_t live = 0;
  // Pulsed (Set, then Reset) on every change a waiting call cares about: a
  // slot became live, a connect attempt failed, shutdown. Calls with no
  // live connection sleep on it: nothing spins while the servers are down.
  Event changed;
  bool shut_down = false;
  std::stop_source stop;
  std::atomic<uint64_t>* live_gauge = nullptr;  // the pool's counters_.live

  void Pulse() {
    changed.Set();
    changed.Reset();
  }

  // Takes a connected slot out of the live set (idempotent) and wakes its
  // Maintain loop.
  void MarkDown(PoolSlot& s) {
    if (s.counted_live) {
      s.counted_live = false;
      --live;
      live_gauge->fetch_sub(1);
    }
    s.down.Set();
  }

  std::shared_ptr<PoolSlot> PickLive() {
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& s = slots[(next + i) % slots.size()];
      if (!s->counted_live) continue;
      if (!s->client->status().ok()) {
        MarkDown(*s);  // lost: seen here first
        continue;
      }
      next = (next + i + 1) % slots.size();
      return s;
    }
    return nullptr;
  }

  // Every slot's last connect attempt failed: nothing is on its way up.
  bool AllFailing() const {
    for (const auto& s : slots) {
      if (s->counted_live || !s->attempt_failed) return false;
    }
    return true;
  }

  std::string LastErrors() const {
    std::string out;
    for (const auto& s : slots) {
      absl::StrAppend(&out, out.empty() ? "" : "; ", s->server.address, ":",
                      s->server.port, ": ", s->last_error.ToString());
    }
    return out;
  }
};

}  // namespace internal

using internal::PoolReactor;
using internal::PoolSlot;

absl::StatusOr<std::unique_ptr<ClientPool>> ClientPool::Create(
    cm::WorkerPool& workers, ClientPoolOptions options) {
  if (options.servers.empty()) {
    return absl::InvalidArgumentError("client pool: no server address given");
  }
  if (options.reconnect_min <= absl::ZeroDuration() ||
      options.reconnect_min > options.reconnect_max) {
    return absl::InvalidArgumentError(
        absl::StrCat("client pool: reconnect_min (",
                     absl::FormatDuration(options.reconnect_min),
                     ") must be positive and at most reconnect_max (",
                     absl::FormatDuration(options.reconnect_max), ")"));
  }
  std::unique_ptr<ClientPool> pool(new ClientPool(std::move(options)));
  for (size_t i = 0; i < workers.size(); ++i) {
    auto r = std::make_shared<PoolReactor>();
    r->worker = &workers.worker(i);
    r->reactor = &r->worker->reactor();
    r->live_gauge = &pool->counters_.live;
    for (const ServerAddress& a : pool->options_.servers) {
      auto s = std::make_shared<PoolSlot>();
      s->server = a;
      r->slots.push_back(std::move(s));
    }
    pool->reactors_.push_back(std::move(r));
  }
  {
    std::lock_guard<std::mutex> lock(pool->mu_);
    pool->loops_ = workers.size() * pool->options_.servers.size();
  }
  for (auto& r : pool->reactors_) {
    for (size_t s = 0; s < r->slots.size(); ++s) {
      r->reactor->Spawn(pool->Maintain(r, s), r->stop.get_token());
    }
  }
  return pool;
}

ClientPool::~ClientPool() { Shutdown(); }

void ClientPool::LoopEnded() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--loops_ == 0) cv_.notify_all();
}

// Keeps one slot connected until the pool stops: connect (with back-off
// while it fails), watch, close what went down, again. Runs whatever the
// callers do: calls never poll, they sleep on PoolReactor::changed.
Task<void> ClientPool::Maintain(std::shared_ptr<PoolReactor> r, size_t index) {
  std::shared_ptr<PoolSlot> s = r->slots[index];
  std::stop_token stop = r->stop.get_token();
  absl::Duration backoff = options_.reconnect_min;
  bool was_connected = false;
  // Spreads the reconnects of many slots (and pools) apart.
  uint64_t jitter = reinterpret_cast<uintptr_t>(s.get()) >> 4;
  while (!stop.stop_requested()) {
    auto c = co_await Client::Connect(*r->worker, s->server.address,
                                      s->server.port, options_.client);
    if (!c.ok()) {
      if (stop.stop_requested()) break;
      s->last_error = c.status();
      s->attempt_failed = true;
      counters_.connect_failures.fetch_add(1);
      r->Pulse();  // waiting calls may now fail fast
      jitter = jitter * 6364136223846793005ull + 1442695040888963407ull;
      // backoff * [0.75, 1.25)
      const double f = 0.75 + static_cast<double>((jitter >> 33) % 1000) / 2000;
      absl::Status slept = co_await r->reactor->Sleep(backoff * f);
      backoff = std::min(backoff * 2, options_.reconnect_max);
      if (!slept.ok()) break;
      continue;
    }
    backoff = options_.reconnect_min;
    s->client = std::shared_ptr<Client>(*std::move(c));
    s->last_error = absl::OkStatus();
    s->attempt_failed = false;
    s->down.Reset();
    counters_.connects.fetch_add(1);
    if (was_connected) counters_.reconnects.fetch_add(1);
    was_connected = true;
    s->counted_live = true;
    ++r->live;
    counters_.live.fetch_add(1);
    r->Pulse();
    while (s->counted_live && s->client->status().ok() &&
           !stop.stop_requested()) {
      absl::Status w = co_await s->down.WaitFor(options_.check_interval);
      if (w.code() == absl::StatusCode::kCancelled) break;
      s->down.Reset();
    }
    r->MarkDown(*s);
    std::shared_ptr<Client> old = std::move(s->client);
    if (s->draining) {
      // Its calls were admitted before the drain began: let them finish
      // (each has a deadline) before closing our side.
      while (old->in_flight() > 0 && old->status().ok() &&
             !stop.stop_requested()) {
        if (!(co_await r->reactor->Sleep(absl::Milliseconds(2))).ok()) break;
      }
      s->draining = false;
      counters_.drained.fetch_add(1);
      s->last_error = absl::UnavailableError(
          absl::StrCat(kServerDraining, ": ", s->server.address, ":",
                       s->server.port, " stopped taking calls"));
      (void)co_await coverbs::internal::Unstoppable(old->Close());
      continue;  // reconnect (refused while it stops: back-off)
    }
    const bool lost = !old->status().ok();
    s->last_error =
        lost ? old->status() : absl::UnavailableError("client pool shut down");
    // Calls still on it fail now (UNAVAILABLE) and drop their references.
    (void)co_await coverbs::internal::Unstoppable(old->Close());
    if (lost && !stop.stop_requested()) counters_.losses.fetch_add(1);
    // Reconnect at once; until that attempt fails, calls wait for it.
  }
  LoopEnded();
}

Task<absl::StatusOr<ClientPool::Picked>> ClientPool::Pick(
    std::string_view method, absl::Time deadline) {
  // Errors only: a call that finds a live connection builds no string.
  auto what = [method] {
    return method.empty() ? std::string("lease")
                          : absl::StrCat("call ", std::string(method));
  };
  if (deadline == absl::InfiniteFuture()) {
    deadline = absl::Now() + options_.default_deadline;
  }
  Reactor* here = Reactor::Current();
  std::shared_ptr<PoolReactor> r;
  for (const auto& p : reactors_) {
    if (p->reactor == here) r = p;
  }
  if (r == nullptr) {
    co_return absl::FailedPreconditionError(
        "ClientPool::Call and Lease must run on one of the pool's reactors");
  }
  for (;;) {
    if (r->shut_down) {
      co_return absl::UnavailableError("client pool shut down");
    }
    if (std::shared_ptr<PoolSlot> s = r->PickLive()) {
      co_return Picked{std::move(r), std::move(s)};
    }
    if (!options_.wait_for_ready && r->AllFailing()) {
      counters_.fail_fast.fetch_add(1);
      co_return absl::UnavailableError(
          absl::StrCat(what(), ": no live connection (", r->LastErrors(), ")"));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      co_return absl::DeadlineExceededError(
          absl::StrCat(what(), ": no live connection before the deadline (",
                       r->LastErrors(), ")"));
    }
    // Sleeps until a connection comes up, an attempt fails or shutdown.
    absl::Status w = co_await r->changed.WaitFor(left);
    if (!w.ok() && w.code() != absl::StatusCode::kDeadlineExceeded) {
      co_return absl::Status(w.code(), absl::StrCat(what(), ": ", w.message()));
    }
  }
}

Task<absl::StatusOr<Response>> ClientPool::Call(
    std::string_view method, std::span<const std::byte> payload,
    CallOptions options) {
  if (options.deadline == absl::InfiniteFuture()) {
    options.deadline = absl::Now() + options_.default_deadline;
  }
  for (;;) {
    absl::StatusOr<Picked> p = co_await Pick(method, options.deadline);
    if (!p.ok()) co_return p.status();
    std::shared_ptr<Client> c = p->slot->client;
    counters_.calls.fetch_add(1);
    absl::StatusOr<Response> resp = co_await c->Call(method, payload, options);
    if (resp.ok()) co_return resp;
    // The slot may have been reconnected meanwhile: only this client's
    // state takes it down.
    const bool same = p->slot->client == c;
    if (IsServerDraining(resp.status())) {
      // Not run there: take that connection out and try another one.
      counters_.drain_retries.fetch_add(1);
      if (same && !p->slot->draining) {
        p->slot->draining = true;
        p->reactor->MarkDown(*p->slot);
      }
      continue;
    }
    if (!c->status().ok() && same) p->reactor->MarkDown(*p->slot);
    co_return resp;
  }
}

Task<absl::StatusOr<std::shared_ptr<Client>>> ClientPool::Lease(
    CallOptions options) {
  absl::StatusOr<Picked> p = co_await Pick({}, options.deadline);
  if (!p.ok()) co_return p.status();
  counters_.leases.fetch_add(1);
  co_return p->slot->client;
}

Task<absl::StatusOr<std::shared_ptr<Client>>> ClientPool::Lease() {
  return Lease(CallOptions{});
}

Task<absl::StatusOr<Response>> ClientPool::Call(
    std::string_view method, std::span<const std::byte> payload) {
  return Call(method, payload, CallOptions{});
}

void ClientPool::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  for (auto& r : reactors_) {
    r->reactor->Post([r]() {
      r->shut_down = true;
      r->stop.request_stop();
      r->Pulse();  // waiting calls see shut_down
      for (auto& s : r->slots) s->down.Set();
    });
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return loops_ == 0; });
}

ClientPool::Stats ClientPool::stats() const {
  Stats s;
  s.connects = counters_.connects.load();
  s.connect_failures = counters_.connect_failures.load();
  s.losses = counters_.losses.load();
  s.calls = counters_.calls.load();
  s.reconnects = counters_.reconnects.load();
  s.fail_fast = counters_.fail_fast.load();
  s.leases = counters_.leases.load();
  s.drained = counters_.drained.load();
  s.drain_retries = counters_.drain_retries.load();
  s.live = counters_.live.load();
  return s;
}

}  // namespace coverbs::rpc
