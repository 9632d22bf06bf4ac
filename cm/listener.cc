// The listen and accept path: the Worker's transport::Connector listens
// (rdma_cm or the soft provider's TCP setup); each request's handshake is
// decoded here, then accepted (ConnectionSetup puts the Connection on the
// QP the connector creates) or rejected with a reason.
//
// Nothing a peer does may hold up another peer. A background Pump task
// takes every request the endpoint yields and starts one ReadHandshake task
// for it, bounded by accept_timeout; decoded requests wait in a queue for
// Next(). Pump never ends on an error accepting a socket (EMFILE, ...): it
// backs off and tries again, until Close(); out of descriptors, it first
// drops the oldest pending handshake to free one.
#include "cm/listener.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cm/connection_setup.h"
#include "cm/worker_shared.h"
#include "core/log.h"
#include "core/sync.h"
#include "transport/connector.h"

namespace coverbs::cm {

namespace {

std::string Endpoint(const std::string& a, uint16_t p) {
  return absl::StrCat(a, ":", p);
}

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

constexpr absl::Duration kMinBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
// The most pending handshakes evicted at once for newer connections (a
// sixteenth of the cap, at least one).
constexpr size_t kMaxEvictionBatch = 32;

// ListenerOptions::max_pending_handshakes, lowered to leave fd_reserve
// descriptors (at most half the limit) free under RLIMIT_NOFILE. `why`
// says what lowered it, empty if nothing did.
size_t PendingCap(const ListenerOptions& o, std::string* why) {
  size_t cap = std::max<size_t>(1, o.max_pending_handshakes);
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) {
    return cap;
  }
  const size_t limit = static_cast<size_t>(rl.rlim_cur);
  const size_t reserve = std::min(o.fd_reserve, limit / 2);
  const size_t fit = std::max<size_t>(1, limit - reserve);
  if (fit < cap) {
    cap = fit;
    *why = absl::StrCat("RLIMIT_NOFILE ", limit, " less ", reserve,
                        " descriptors kept for other work "
                        "(ListenerOptions::fd_reserve)");
  }
  return cap;
}

constexpr char kEvictedForNewer[] =
    "dropped for a newer connection: too many handshakes pending "
    "(ListenerOptions::max_pending_handshakes)";
constexpr char kEvictedForFds[] =
    "dropped to free a descriptor: the process ran out of file descriptors "
    "(RLIMIT_NOFILE)";

}  // namespace

namespace internal {

struct ConnectRequestState {
  Worker* listener_ctx = nullptr;
  std::weak_ptr<ListenerState> listener;
  ListenerOptions options;
  PeerInfo peer;
  bool decided = false;
  std::unique_ptr<transport::IncomingRequest> request;
};

// A handshake being read: its task's stop source, so that Close() and
// eviction can end it.
struct PendingHandshake {
  std::stop_source stop;
  const char* evicted = nullptr;  // why, once evicted
  // Set once the read has ended and, if it failed, the socket is closed:
  // an eviction has freed its descriptor.
  Event released{false};
};

struct ListenerState {
  Worker* ctx = nullptr;
  std::string address;
  uint16_t port = 0;
  std::string name;  // "listener ADDRESS:PORT"
  ListenerOptions options;
  size_t max_pending = 1;  // the cap in force (PendingCap)
  bool closed = false;
  // Written on the reactor thread; Listener::stats() may read from any.
  mutable std::mutex stats_mu;
  Listener::Stats stats;
  std::shared_ptr<transport::PassiveEndpoint> endpoint;
  std::stop_source pump_stop;
  // Oldest first.
  std::list<std::shared_ptr<PendingHandshake>> pending;
  std::deque<std::unique_ptr<ConnectRequestState>> ready;
  // The lists' sizes for Update(), which other Workers' threads call too
  // (an accepted connection is counted on the Worker that took it): the
  // lists themselves are only touched on the listener's reactor.
  std::atomic<size_t> pending_size{0};
  std::atomic<size_t> ready_size{0};
  void ListsChanged() {
    pending_size.store(pending.size(), std::memory_order_relaxed);
    ready_size.store(ready.size(), std::memory_order_relaxed);
  }
  Event ready_event{false};  // set while `ready` is non-empty or closed
  LogLimiter reject_log{absl::Seconds(1)};
  LogLimiter error_log{absl::Seconds(1)};

  // Changes the stats under their lock; pending and queued always follow
  // the lists (NoteSizes after a list changed and nothing else did).
  template <typename F>
  void Update(F f) {
    std::lock_guard<std::mutex> lock(stats_mu);
    f(stats);
    stats.pending = pending_size.load(std::memory_order_relaxed);
    stats.queued = ready_size.load(std::memory_order_relaxed);
  }
  void NoteSizes() {
    Update([](Listener::Stats&) {});
  }

  void Refuse(std::string_view peer, std::string_view reason) {
    Update([&](Listener::Stats& s) {
      ++s.rejected;
      s.last_reject_reason = std::string(reason);
    });
    uint64_t more = 0;
    if (reject_log.Allow(&more)) {
      COVERBS_LOG(kWarning, "cm", "%s: refused %s: %s%s", name, peer, reason,
                  more > 0 ? absl::StrCat(" (and ", more, " more refused)")
                           : std::string());
    }
  }
};

}  // namespace internal

using internal::ConnectRequestState;
using internal::ListenerState;
using internal::PendingHandshake;

namespace {

std::string PeerName(const ConnectRequestState& st) {
  return Endpoint(st.peer.address, st.peer.port);
}

void CountReject(ConnectRequestState& st, std::string_view reason) {
  if (auto l = st.listener.lock()) l->Refuse(PeerName(st), reason);
}

absl::Status RejectState(ConnectRequestState& st, std::string_view reason) {
  st.decided = true;
  CountReject(st, reason);
  return st.request->Reject(reason);
}

// Reads and decodes one request's handshake, then queues it for Next().
Task<void> ReadHandshake(std::shared_ptr<ListenerState> st,
                         std::shared_ptr<PendingHandshake> pending,
                         std::unique_ptr<ConnectRequestState> req) {
  auto private_data = co_await req->request->ReadPrivateData(
      absl::Now() + st->options.accept_timeout);
  st->pending.remove(pending);
  st->ListsChanged();
  st->Update([](Listener::Stats& s) { ++s.requests; });
  if (!private_data.ok()) {
    std::string why =
        pending->evicted != nullptr ? std::string(pending->evicted)
        : st->closed ? std::string("the listener closed")
                     : absl::StrCat("no valid handshake within ",
                                    absl::FormatDuration(
                                        st->options.accept_timeout),
                                    ": ", private_data.status().message());
    req->decided = true;
    req->request.reset();  // closes the socket now (soft)
    pending->released.Set();
    st->Refuse(PeerName(*req), why);
    co_return;
  }
  pending->released.Set();  // the read is over; the socket goes on
  auto h = DecodeHandshake(std::as_bytes(std::span(*private_data)));
  if (!h.ok()) {
    RejectState(*req, std::string(h.status().message())).IgnoreError();
    co_return;
  }
  req->peer.handshake = *std::move(h);
  if (st->closed) {
    RejectState(*req, "the listener closed").IgnoreError();
    co_return;
  }
  if (st->ready.size() >= st->options.max_queued_requests) {
    RejectState(*req,
                "server busy: too many requests waiting to be accepted "
                "(ListenerOptions::max_queued_requests)")
        .IgnoreError();
    co_return;
  }
  st->ready.push_back(std::move(req));
  st->ListsChanged();
  st->NoteSizes();
  st->ready_event.Set();
}

// Ends the oldest pending handshake. Its task closes the socket when it
// resumes, on this reactor: wait for `released` to have the descriptor back.
std::shared_ptr<PendingHandshake> EvictOldest(ListenerState& st,
                                              const char* why) {
  std::shared_ptr<PendingHandshake> oldest = st.pending.front();
  st.pending.pop_front();
  st.ListsChanged();
  oldest->evicted = why;
  const bool for_fds = why == kEvictedForFds;
  st.Update([for_fds](Listener::Stats& s) {
    ++s.evicted;
    if (for_fds) ++s.evicted_for_fds;
  });
  oldest->stop.request_stop();
  return oldest;
}

// Waits (bounded) until an evicted handshake's task has closed its socket:
// Pump accepts nothing meanwhile, so evictions keep the descriptors held
// at the cap rather than the cap plus every socket accepted before the
// evicted tasks ran. False once the listener is closing.
Task<bool> Released(std::shared_ptr<PendingHandshake> evicted) {
  auto wait = evicted->released.WaitFor(absl::Milliseconds(200));
  absl::Status s = co_await std::move(wait);
  co_return s.code() != absl::StatusCode::kCancelled;
}

// Takes every request the endpoint yields and starts reading its handshake.
Task<void> Pump(std::shared_ptr<ListenerState> st) {
  absl::Duration backoff = kMinBackoff;
  while (!st->closed) {
    std::shared_ptr<transport::PassiveEndpoint> ep = st->endpoint;
    auto next = ep->Next(absl::Seconds(1));
    auto in = co_await std::move(next);
    if (st->closed) break;
    if (!in.ok()) {
      if (in.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
      // Out of fds or memory, a connection aborted before it was taken:
      // transient. Log once per burst, back off, accept again. Out of
      // descriptors (the soft connector's EMFILE/ENFILE) with handshakes
      // pending: the oldest goes, which frees one, and the next accept
      // comes as soon as its task has closed the socket.
      const bool evict =
          in.status().code() == absl::StatusCode::kResourceExhausted &&
          !st->pending.empty();
      std::shared_ptr<PendingHandshake> evicted;
      if (evict) evicted = EvictOldest(*st, kEvictedForFds);
      st->Update([&](Listener::Stats& s) {
        ++s.accept_errors;
        s.last_accept_error = std::string(in.status().message());
      });
      uint64_t more = 0;
      if (st->error_log.Allow(&more)) {
        COVERBS_LOG(kError, "cm", "%s: accepting failed: %s; %s%s", st->name,
                    in.status().message(),
                    evict ? std::string("dropped the oldest pending handshake "
                                        "to free a descriptor, retrying")
                          : absl::StrCat("retrying in ",
                                         absl::FormatDuration(backoff)),
                    more > 0 ? absl::StrCat(" (", more, " more failures)")
                             : std::string());
      }
      if (evicted != nullptr) {
        auto released = Released(std::move(evicted));
        if (!co_await std::move(released)) break;  // closing
        continue;
      }
      auto sleep = Reactor::Current()->Sleep(backoff);
      absl::Status s = co_await sleep;
      if (!s.ok()) break;  // cancelled: closing
      backoff = std::min(backoff * 2, kMaxBackoff);
      continue;
    }
    backoff = kMinBackoff;
    auto req = std::make_unique<ConnectRequestState>();
    req->listener_ctx = st->ctx;
    req->listener = st;
    req->options = st->options;
    req->request = *std::move(in);
    req->peer.address = req->request->peer_address();
    req->peer.port = req->request->peer_port();
    // At the cap, the oldest pending handshakes go in a batch: the evicted
    // tasks close their sockets on the next turn, and the accepts that
    // follow fill the room without waiting a turn each. One eviction per
    // accept paced a flood's backlog at one accept per reactor turn, and a
    // good client queued behind a few hundred silent sockets on a loaded
    // host waited out its connect timeout.
    std::vector<std::shared_ptr<PendingHandshake>> evicted;
    if (st->pending.size() >= st->max_pending) {
      const size_t batch = std::clamp<size_t>(st->max_pending / 16, 1,
                                              kMaxEvictionBatch);
      while (evicted.size() < batch && !st->pending.empty()) {
        evicted.push_back(EvictOldest(*st, kEvictedForNewer));
      }
    }
    auto pending = std::make_shared<PendingHandshake>();
    st->pending.push_back(pending);
    st->ListsChanged();
    st->NoteSizes();
    st->ctx->reactor().Spawn(ReadHandshake(st, pending, std::move(req)),
                             pending->stop.get_token());
    // An accept completes without suspending while the backlog holds
    // connections: without a turn here, a flood's backlog would keep every
    // other task of this reactor (its connections' calls) waiting.
    co_await Reactor::Current()->Yield();
    bool closing = st->closed;
    for (size_t i = 0; i < evicted.size() && !closing; ++i) {
      auto released = Released(std::move(evicted[i]));
      closing = !co_await std::move(released);
    }
    if (closing) break;
  }
  st->ready_event.Set();
}

}  // namespace

ConnectRequest::ConnectRequest(std::unique_ptr<ConnectRequestState> s)
    : state_(std::move(s)) {}

ConnectRequest::~ConnectRequest() {
  if (state_ != nullptr && !state_->decided) {
    RejectState(*state_, "not accepted").IgnoreError();
  }
}

const PeerInfo& ConnectRequest::peer() const { return state_->peer; }

absl::Status ConnectRequest::Reject(std::string_view reason) {
  if (state_->decided) {
    return absl::FailedPreconditionError("connect request already decided");
  }
  return RejectState(*state_, reason);
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> ConnectRequest::Accept(
    Worker& ctx) {
  ConnectRequestState& st = *state_;
  std::string where = absl::StrCat("accept from ", PeerName(st));
  if (st.decided) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(where, ": request already decided"));
  }
  if (&ctx.device() != &st.listener_ctx->device()) {
    st.decided = true;
    co_return absl::InvalidArgumentError(
        absl::StrCat(where, ": the target worker uses another device"));
  }
  absl::Time deadline = absl::Now() + st.options.accept_timeout;
  auto setup = internal::ConnectionSetup::Create(ctx, st.options.connection,
                                                 /*active_side=*/false);
  if (!setup.ok()) {
    RejectState(st, std::string(setup.status().message())).IgnoreError();
    co_return Annotate(setup.status(), where);
  }
  st.decided = true;
  auto est = co_await st.request->Accept(internal::ConnectorOf(ctx), **setup,
                                         deadline);
  if (!est.ok() && !(*setup)->cq_error().ok()) {
    est = Annotate((*setup)->cq_error(), where);
  }
  if (!est.ok()) {
    CountReject(st, st.request->rejected()
                        ? st.request->reject_reason()
                        : std::string(est.status().message()));
    co_return est.status();
  }
  if (absl::Duration d = internal::PassiveStartDelayForTest();
      d > absl::ZeroDuration()) {
    absl::Status slept = co_await Reactor::Current()->Sleep(d);
    if (!slept.ok()) co_return slept;
  }
  auto conn = (*setup)->Start(st.peer, std::move(est->link));
  if (!conn.ok()) {
    CountReject(st, std::string(conn.status().message()));
    co_return conn.status();
  }
  // The handshake is complete only with the peer's first message (its
  // hello): a peer that connected and then says nothing is dropped here.
  absl::Status spoke =
      co_await internal::ConnectionSetup::WaitPeerSpoke(**conn, deadline);
  if (!spoke.ok()) {
    CountReject(st, std::string(spoke.message()));
    co_return Annotate(spoke, where);
  }
  if (auto l = st.listener.lock()) {
    l->Update([](Listener::Stats& s) { ++s.accepted; });
    COVERBS_LOG(kInfo, "cm", "%s: accepted %s", l->name, (*conn)->name());
  }
  co_return conn;
}

// ---------------------------------------------------------------------------

Listener::Listener(std::shared_ptr<ListenerState> s) : state_(std::move(s)) {}
Listener::~Listener() { Close(); }

uint16_t Listener::port() const { return state_->port; }
size_t Listener::max_pending_handshakes() const { return state_->max_pending; }
const std::string& Listener::address() const { return state_->address; }
Listener::Stats Listener::stats() const {
  std::lock_guard<std::mutex> lock(state_->stats_mu);
  return state_->stats;
}

void Listener::Close() {
  ListenerState& st = *state_;
  if (st.closed) return;
  st.closed = true;
  st.pump_stop.request_stop();
  for (auto& p : st.pending) p->stop.request_stop();
  if (st.endpoint != nullptr) st.endpoint->Close();
  st.endpoint.reset();
  // Requests nobody will take: each rejects itself ("not accepted").
  st.ready.clear();
  st.ready_event.Set();
  Stats s = stats();
  COVERBS_LOG(kInfo, "cm", "%s: closed (%d accepted, %d refused)", st.name,
              s.accepted, s.rejected);
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Create(
    Worker& ctx, std::string address, uint16_t port, ListenerOptions options) {
  auto st = std::make_shared<ListenerState>();
  st->ctx = &ctx;
  st->address = address;
  st->options = std::move(options);
  std::string lowered;
  st->max_pending = PendingCap(st->options, &lowered);
  auto ep =
      internal::ConnectorOf(ctx).Listen(address, port, st->options.backlog);
  if (!ep.ok()) return ep.status();
  st->endpoint = *std::move(ep);
  st->port = st->endpoint->port();
  st->name = absl::StrCat("listener ", Endpoint(st->address, st->port));
  if (lowered.empty()) {
    COVERBS_LOG(kInfo, "cm", "%s: listening", st->name);
  } else {
    COVERBS_LOG(kInfo, "cm",
                "%s: listening; at most %d handshakes pending (%s)", st->name,
                st->max_pending, lowered);
  }
  ctx.reactor().Spawn(Pump(st), st->pump_stop.get_token());
  return std::unique_ptr<Listener>(new Listener(std::move(st)));
}

Task<absl::StatusOr<std::unique_ptr<ConnectRequest>>> Listener::Next() {
  return NextOn(state_);
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> Listener::Accept() {
  return AcceptOn(state_);
}

Task<absl::StatusOr<std::unique_ptr<ConnectRequest>>> Listener::NextOn(
    std::shared_ptr<ListenerState> st) {
  for (;;) {
    if (!st->ready.empty()) {
      std::unique_ptr<ConnectRequestState> req = std::move(st->ready.front());
      st->ready.pop_front();
      st->ListsChanged();
      st->NoteSizes();
      if (st->ready.empty() && !st->closed) st->ready_event.Reset();
      co_return std::unique_ptr<ConnectRequest>(
          new ConnectRequest(std::move(req)));
    }
    if (st->closed) {
      co_return absl::CancelledError(absl::StrCat(st->name, ": closed"));
    }
    auto wait = st->ready_event.Wait();
    absl::Status s = co_await wait;
    if (!s.ok()) co_return Annotate(s, st->name);
  }
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> Listener::AcceptOn(
    std::shared_ptr<ListenerState> st) {
  for (;;) {
    auto next = NextOn(st);
    auto req = co_await std::move(next);
    if (!req.ok()) co_return req.status();
    if (st->options.admit) {
      absl::Status s = st->options.admit((*req)->peer());
      if (!s.ok()) {
        (*req)->Reject(std::string(s.message())).IgnoreError();
        continue;
      }
    }
    auto accept = (*req)->Accept(*st->ctx);
    auto conn = co_await std::move(accept);
    // One failed setup (the peer gave up, say) does not stop the listener.
    if (!conn.ok()) continue;
    co_return conn;
  }
}

}  // namespace coverbs::cm
