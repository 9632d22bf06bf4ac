#include "rpc/server.h"

#include <array>
#include <coroutine>
#include <future>
#include <optional>
#include <utility>

#include "absl/container/node_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "rpc/drain.h"

namespace coverbs::rpc {

namespace {

// A running call: its handler's stop source (a cancel frame or the
// connection's end stops it).
struct Call {
  std::stop_source stop;
  bool cancelled_by_peer = false;
};

// The running calls of a connection by id. Clients number their calls from
// a counter, so the calls in flight nearly always sit in distinct slots of
// a small ring indexed by the id: adding, finding and removing are an array
// access (with a hash map for all of them, the three and the hash cost
// ~130 instructions per call). An id whose slot is taken goes to the map.
// Reactor thread only.
class CallTable {
 public:
  // The new call's record (valid until its Remove), or null when a call
  // with this id is running.
  Call* Add(uint64_t id) {
    Slot& s = ring_[id & (kRing - 1)];
    if (!s.used) {
      // The id may have gone to the map while its slot was taken.
      if (!overflow_.empty() && overflow_.contains(id)) return nullptr;
      s.used = true;
      s.id = id;
      s.call = Call{};
      return &s.call;
    }
    if (s.id == id) return nullptr;
    auto [it, fresh] = overflow_.try_emplace(id);
    return fresh ? &it->second : nullptr;
  }
  Call* Find(uint64_t id) {
    Slot& s = ring_[id & (kRing - 1)];
    if (s.used && s.id == id) return &s.call;
    if (overflow_.empty()) return nullptr;
    auto it = overflow_.find(id);
    return it == overflow_.end() ? nullptr : &it->second;
  }
  // Removes id's call; true when it was running and stopped (one lookup
  // for the Find and Remove of a call's end).
  bool TakeStopped(uint64_t id) {
    Slot& s = ring_[id & (kRing - 1)];
    if (s.used && s.id == id) {
      s.used = false;
      return s.call.stop.stop_requested();
    }
    if (overflow_.empty()) return false;
    auto it = overflow_.find(id);
    if (it == overflow_.end()) return false;
    const bool stopped = it->second.stop.stop_requested();
    overflow_.erase(it);
    return stopped;
  }
  void Remove(uint64_t id) {
    Slot& s = ring_[id & (kRing - 1)];
    if (s.used && s.id == id) {
      s.used = false;
      return;
    }
    if (!overflow_.empty()) overflow_.erase(id);
  }
  void StopAll() {
    for (Slot& s : ring_) {
      if (s.used) s.call.stop.request_stop();
    }
    for (auto& [id, call] : overflow_) call.stop.request_stop();
  }

 private:
  static constexpr size_t kRing = 256;
  struct Slot {
    uint64_t id = 0;
    bool used = false;
    Call call;
  };
  std::array<Slot, kRing> ring_;
  // Node-based: a record's address stays put while others come and go.
  absl::node_hash_map<uint64_t, Call> overflow_;
};

}  // namespace

// One connection's serving state. Shared by its receive loop and its call
// coroutines; lives on the connection's reactor.
// One call: the handler, then the response. Not a Task handed to
// Reactor::Spawn (its record and the trip through the ready queue cost
// ~150 instructions per call): ServeLoop runs it at once on a trampoline of
// its own (ResumeOnTrampoline) until it first waits -- usually for its
// response's send completion -- and then goes on receiving; the frame frees
// itself at its end (final_suspend does not suspend). The connection state
// lists the live ones (Conn::live_calls): a frame still suspended when the
// reactor destroys the receive loop (shutdown) is destroyed with the
// connection state, as the reactor destroys spawned tasks.
struct Server::CallCoro {
  struct promise_type : coverbs::internal::PromiseBase,
                        coverbs::internal::ListNode<promise_type> {
    CallCoro get_return_object() noexcept {
      return CallCoro{std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    // Hides PromiseBase's: nobody awaits a call, so it ends by itself.
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    ~promise_type();       // after Conn
    Conn* conn = nullptr;  // lists this call in conn->live_calls
  };
  std::coroutine_handle<promise_type> h;
};

struct Server::Conn {
  Server* server = nullptr;
  cm::Worker* ctx = nullptr;
  std::unique_ptr<cm::Connection> conn;
  std::stop_source stop;  // Shutdown: ends the receive loop
  CallTable calls;
  // The method of the last request: methods_ does not change once serving
  // started, and a connection's requests mostly name one method (a hash
  // lookup per request otherwise).
  uint32_t last_method_id = 0;
  const Method* last_method = nullptr;
  // What handlers kept for the connection's lifetime
  // (Context::KeepUntilClose): released after the connection closed.
  std::vector<std::shared_ptr<void>> kept;
  Semaphore running;    // handler slots
  Semaphore admission;  // running + queued
  // Small requests whose payload view pins one of the connection's receive
  // buffers. Kept under half of them so that cancels and new requests can
  // still arrive while handlers run; above, payloads are copied.
  // Each such payload's lease is a copy of `held_anchor` (no allocation,
  // one atomic increment; the payload may outlive this state and be
  // released on any thread), so the count is its use count less ours.
  std::shared_ptr<char> held_anchor = std::make_shared<char>(0);
  uint32_t held() const {
    return static_cast<uint32_t>(held_anchor.use_count() - 1);
  }
  uint32_t max_held = 1;
  size_t eager_max = 0;  // messages up to this size sit in a receive buffer
  DecodeLimits limits;
  uint64_t response_limit = 0;  // largest response payload we may send

  // Calls started and not ended (their frames; ~Conn destroys what is
  // left, before anything they point to goes). When the connection ends
  // the receive loop waits for it to empty: `draining` says it waits, and
  // the last call's frame sets `drained` as it goes. (A WaitGroup counted
  // them before, ~35 instructions per call for an Add and a Done.)
  coverbs::internal::IntrusiveList<CallCoro::promise_type> live_calls;
  bool draining = false;
  Event drained;
  // Server::Shutdown(drain): requests refused on this connection (DrainConn
  // closes it once this stops growing), and whether its loop has ended.
  uint64_t drain_refused = 0;
  bool ended = false;

  Conn(size_t max_running, size_t max_outstanding)
      : running(max_running), admission(max_outstanding) {}
  ~Conn() {
    // Only when the reactor destroyed the receive loop while calls were
    // suspended (it waits for them otherwise).
    while (CallCoro::promise_type* p = live_calls.pop_front()) {
      std::coroutine_handle<CallCoro::promise_type>::from_promise(*p).destroy();
    }
    server->ConnGone();
  }

  const std::string& name() const {
    static const std::string kNone = "(not connected)";
    return conn ? conn->name() : kNone;
  }
};

// Inline: once per call, in RunCall's frame teardown (out of line it was
// a call, ~11 Ir).
inline Server::CallCoro::promise_type::~promise_type() {
  if (conn == nullptr || !linked()) return;  // (~Conn destroys it)
  conn->live_calls.erase(this);
  if (conn->draining && conn->live_calls.empty()) conn->drained.Set();
}

using ::coverbs::internal::Unstoppable;

Server::Server() : Server(ServerOptions{}) {}
Server::Server(ServerOptions options) : options_(std::move(options)) {
  if (options_.max_concurrent_calls == 0) options_.max_concurrent_calls = 1;
}

Server::~Server() { Shutdown(); }

absl::Status Server::Register(std::string_view name, Handler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) {
    return absl::FailedPreconditionError(
        absl::StrCat("register ", std::string(name), ": the server already started"));
  }
  if (!handler) {
    return absl::InvalidArgumentError(
        absl::StrCat("register ", std::string(name), ": empty handler"));
  }
  uint32_t id = MethodId(name);
  auto it = methods_.find(id);
  if (it != methods_.end()) {
    if (it->second->name == name) {
      return absl::AlreadyExistsError(
          absl::StrCat("method ", std::string(name), " is already registered"));
    }
    return absl::AlreadyExistsError(absl::StrFormat(
        "method %s has the same id 0x%08x as registered method %s; rename one",
        std::string(name), id, it->second->name));
  }
  auto m = std::make_unique<Method>();
  m->name = std::string(name);
  m->handler = std::move(handler);
  methods_.emplace(id, std::move(m));
  return absl::OkStatus();
}

Server::Stats Server::stats() const {
  Stats s;
  s.connections = stats_.connections.load();
  s.open_connections = stats_.open_connections.load();
  s.failed_calls = stats_.failed_calls.load();
  s.request_bytes = stats_.request_bytes.load();
  s.response_bytes = stats_.response_bytes.load();
  s.credit_stalls = stats_.credit_stalls.load();
  s.rendezvous = stats_.rendezvous.load();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (listener_ != nullptr) {
      cm::Listener::Stats ls = listener_->stats();
      s.rejected_connections = ls.rejected;
      s.accept_errors = ls.accept_errors;
      s.pending_handshakes = ls.pending;
      s.evicted_handshakes = ls.evicted;
    } else {
      s.rejected_connections = final_listener_.rejected;
      s.accept_errors = final_listener_.accept_errors;
      s.evicted_handshakes = final_listener_.evicted;
    }
  }
  s.calls = stats_.calls.load();
  s.cancels_received = stats_.cancels_received.load();
  s.cancelled_calls = stats_.cancelled_calls.load();
  s.unknown_method = stats_.unknown_method.load();
  s.drain_refused = stats_.drain_refused.load();
  s.protocol_errors = stats_.protocol_errors.load();
  s.copied_requests = stats_.copied_requests.load();
  for (size_t i = 0; i < cm::kCloseCauses; ++i) {
    s.closed_by_cause[i] = stats_.closed[i].load();
  }
  {
    // The Workers live until Shutdown returns (Start's contract).
    std::lock_guard<std::mutex> lock(mu_);
    s.reactor_stalls = shut_down_ ? final_stalls_ : StallsLocked();
    if (!shut_down_) {
      for (cm::Worker* w : workers_) {
        const cm::Worker::RendezvousUsage u = w->rendezvous_usage();
        s.rendezvous_held_bytes += u.held_bytes;
        s.rendezvous_deferred += u.deferred;
        s.rendezvous_budget_violations += u.budget_violations;
        s.rendezvous_done_timeouts += u.done_timeouts;
        s.exposures_refused += w->exposures_refused();
      }
    }
  }
  return s;
}

uint64_t Server::StallsLocked() const {
  uint64_t n = 0;
  for (cm::Worker* w : workers_) n += w->reactor().stalls();
  return n;
}

std::shared_ptr<Server::Conn> Server::NewConn(cm::Worker* ctx) {
  auto c = std::make_shared<Conn>(
      options_.max_concurrent_calls,
      options_.max_concurrent_calls + options_.max_queued_calls);
  c->server = this;
  c->ctx = ctx;
  std::lock_guard<std::mutex> lock(mu_);
  started_ = true;
  ++live_;
  if (shutting_down_) c->stop.request_stop();
  // Forget connections that ended, so the list stays bounded.
  std::erase_if(conns_, [](const std::weak_ptr<Conn>& w) { return w.expired(); });
  conns_.push_back(c);
  return c;
}

void Server::ConnGone() {
  std::lock_guard<std::mutex> lock(mu_);
  --live_;
  cv_.notify_all();
}

absl::Status Server::Start(std::vector<cm::Worker*> workers,
                           const std::string& address, uint16_t port) {
  if (workers.empty() || workers[0] == nullptr) {
    return absl::InvalidArgumentError("rpc server start: no workers");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!workers_.empty()) {
      return absl::FailedPreconditionError("rpc server already started");
    }
    if (shutting_down_) {
      return absl::FailedPreconditionError("rpc server was shut down");
    }
    workers_ = workers;
    started_ = true;
  }
  Reactor& r = workers[0]->reactor();
  auto create = [this, &address, port, ctx = workers[0]]() {
    return cm::Listener::Create(*ctx, address, port, options_.listener);
  };
  absl::StatusOr<std::unique_ptr<cm::Listener>> ln;
  if (r.InLoopThread()) {
    ln = create();
  } else {
    std::promise<absl::StatusOr<std::unique_ptr<cm::Listener>>> p;
    auto f = p.get_future();
    r.Post([&p, &create]() { p.set_value(create()); });
    ln = f.get();
  }
  if (!ln.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    workers_.clear();
    return ln.status();
  }
  port_ = (*ln)->port();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++live_;  // the accept loop
  }
  r.Spawn(AcceptLoop(*std::move(ln)), accept_stop_.get_token());
  return absl::OkStatus();
}

Task<void> Server::AcceptLoop(std::unique_ptr<cm::Listener> listener) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    listener_ = listener.get();
  }
  for (;;) {
    auto req = co_await listener->Next();
    if (!req.ok()) break;  // Cancelled by Shutdown, or the listener failed
    const auto& admit =
        options_.admit ? options_.admit : options_.listener.admit;
    if (admit) {
      absl::Status ok = admit((*req)->peer());
      if (!ok.ok()) {
        (*req)->Reject(std::string(ok.message())).IgnoreError();
        continue;
      }
    }
    cm::Worker* ctx = workers_[next_ctx_++ % workers_.size()];
    std::shared_ptr<Conn> c = NewConn(ctx);
    std::stop_token token = c->stop.get_token();
    // Spawn is thread-safe: the task starts on ctx's reactor, where the
    // request must be accepted.
    ctx->reactor().Spawn(AcceptAndServe(std::move(c), *std::move(req)),
                         std::move(token));
  }
  listener->Close();
  {
    std::lock_guard<std::mutex> lock(mu_);
    final_listener_ = listener->stats();
    listener_ = nullptr;
  }
  listener.reset();
  ConnGone();  // the accept loop's share of live_
}

Task<void> Server::AcceptAndServe(std::shared_ptr<Conn> c,
                                  std::unique_ptr<cm::ConnectRequest> req) {
  auto conn = co_await req->Accept(*c->ctx);
  req.reset();
  if (!conn.ok()) co_return;
  c->conn = *std::move(conn);
  co_await ServeLoop(std::move(c));
}

Task<void> Server::Serve(std::unique_ptr<cm::Connection> conn) {
  std::shared_ptr<Conn> c = NewConn(&conn->worker());
  c->conn = std::move(conn);
  // The loop runs with the connection's own stop token (Shutdown), plus the
  // caller's.
  Task<void> loop = ServeLoop(c);
  std::stop_token caller = co_await CurrentStopToken();
  std::optional<std::stop_callback<coverbs::internal::StopForwarder>> link;
  if (caller.stop_possible()) {
    link.emplace(caller, coverbs::internal::StopForwarder{&c->stop});
  }
  loop.SetStopToken(c->stop.get_token());
  co_await std::move(loop);
}

Task<void> Server::ServeLoop(std::shared_ptr<Conn> c) {
  stats_.connections.fetch_add(1);
  stats_.open_connections.fetch_add(1);
  cm::Connection& conn = *c->conn;
  cm::Handshake local = conn.local_handshake();
  c->eager_max = local.recv_buffer_size;
  c->max_held = std::max<uint32_t>(1, local.credits / 2);
  uint64_t conn_max = conn.peer().handshake.max_message_size;
  c->limits.max_payload = std::min<uint64_t>(
      options_.max_request_size,
      conn_max > kHeaderSize ? conn_max - kHeaderSize : 0);
  c->response_limit =
      std::min<uint64_t>(options_.max_response_size,
                         conn_max > kHeaderSize ? conn_max - kHeaderSize : 0);
  absl::Status why;
  Frame f;  // (out of the loop: not built anew per message)
  bool bad_frame = false;
  const cm::PeerInfo* const peer = &conn.peer();  // (a call per request)
  for (;;) {
    // Recv has no coroutine frame: a request already there is taken
    // without suspending.
    auto m = co_await conn.Recv();
    if (!m.ok()) {
      why = m.status();
      break;
    }
    // A request or cancel inline; anything else through DecodeFrame, which
    // says what is wrong.
    if (!DecodeUsualFrame(m->data(), Side::kServer, c->limits, f)) {
      absl::StatusOr<Frame> other =
          DecodeFrame(m->data(), Side::kServer, c->limits);
      if (!other.ok()) {
        stats_.protocol_errors.fetch_add(1);
        bad_frame = true;
        // Answer the call whose id the header carries (when it can be read
        // and is not a running call's), then the connection as a whole (id
        // 0) so every other pending call learns why; then close this
        // connection only: it cannot be trusted to stay in sync.
        uint64_t id = 0;
        auto peek = PeekHeader(m->data());
        if (peek.ok()) id = peek->call_id;
        why = absl::Status(
            other.status().code(),
            absl::StrCat("rpc server on ", conn.name(),
                         ": bad frame: ", other.status().message()));
        if (id != 0 && c->calls.Find(id) == nullptr) {
          (void)co_await Unstoppable(
              WithTimeout(SendError(c.get(), id, 0, why), absl::Seconds(2)));
        }
        (void)co_await Unstoppable(
            WithTimeout(SendError(c.get(), 0, 0, why), absl::Seconds(2)));
        break;
      }
      f = *other;
    }
    const FrameHeader& h = f.header;
    if (h.type == FrameType::kCancel) {
      stats_.cancels_received.fetch_add(1);
      Call* call = c->calls.Find(h.call_id);
      // Unknown id: the call already finished (its response crossed the
      // cancel on the wire) -- nothing to do.
      if (call != nullptr && !call->cancelled_by_peer) {
        call->cancelled_by_peer = true;
        call->stop.request_stop();
      }
      continue;
    }
    if (draining_.load(std::memory_order_relaxed)) [[unlikely]] {
      // Not run: the caller may send it elsewhere (rpc/drain.h).
      ++c->drain_refused;
      stats_.drain_refused.fetch_add(1);
      co_await SendError(
          c.get(), h.call_id, h.method_id,
          absl::UnavailableError(absl::StrCat(
              kServerDraining, " (", conn.name(),
              "): the call was not run; send it to another server")));
      continue;
    }
    // A request. Its call record goes in first: one lookup both finds a
    // reused id and makes the entry (taken out again below when the
    // request goes no further).
    Call* call = c->calls.Add(h.call_id);
    if (call == nullptr) {
      stats_.protocol_errors.fetch_add(1);
      bad_frame = true;
      why = absl::InvalidArgumentError(absl::StrCat(
          "rpc server on ", conn.name(), ": call id ", h.call_id,
          " reused while that call is still running"));
      (void)co_await Unstoppable(
          WithTimeout(SendError(c.get(), 0, 0, why), absl::Seconds(2)));
      break;
    }
    const Method* method = c->last_method;
    if (method == nullptr || c->last_method_id != h.method_id) {
      auto mit = methods_.find(h.method_id);
      method = mit == methods_.end() ? nullptr : mit->second.get();
      if (method != nullptr) {
        c->last_method_id = h.method_id;
        c->last_method = method;
      }
    }
    if (method == nullptr) {
      c->calls.Remove(h.call_id);
      stats_.unknown_method.fetch_add(1);
      co_await SendError(
          c.get(), h.call_id, h.method_id,
          absl::NotFoundError(absl::StrFormat(
              "no method with id 0x%08x is registered on this server",
              h.method_id)));
      continue;
    }
    // A free slot is taken without an awaiter (built and torn down per
    // request otherwise).
    if (!c->admission.TryAcquire()) {
      absl::Status admitted = co_await c->admission.Acquire();
      if (!admitted.ok()) {
        c->calls.Remove(h.call_id);
        why = admitted;
        break;
      }
    }
    stats_.request_bytes.fetch_add(f.payload.size());
    // The request is built in place, its payload too (each Payload
    // move-assignment cost a variant visit).
    auto take_payload = [&]() -> Payload {
      if (m->size() > c->eager_max) return Payload(*std::move(m), kHeaderSize);
      if (c->held() >= c->max_held) {
        stats_.copied_requests.fetch_add(1);
        return Payload::Copy(f.payload);
      }
      return Payload(*std::move(m), kHeaderSize, c->held_anchor);
    };
    const bool large = m->size() > c->eager_max;
    // A plain pointer to the connection state: this loop holds it and
    // waits for every call (c->live_calls) before it lets go. The call runs
    // now, until it first waits (CallCoro). The request is built as the
    // argument itself: one move (into the frame) less than from a local.
    auto make_request = [&]() {
      Request r;
      r.method = method->name;
      r.method_id = h.method_id;
      r.call_id = h.call_id;
      r.peer = peer;
      r.conn_ = &conn;
      r.stop_ = &call->stop;
      r.keep_ = &c->kept;
      r.payload = take_payload();
      return r;
    };
    CallCoro call_coro = RunCall(c.get(), h.call_id, method, make_request());
    CallCoro::promise_type& pr = call_coro.h.promise();
    // The handler's token. `call` is still this call's record after the
    // admission wait: records stay put (a ring slot, or a node of the
    // node-based overflow map) while other calls come and go, and only
    // this loop adds or removes this id.
    pr.set_stop_token(call->stop.get_token());
    pr.conn = c.get();
    c->live_calls.push_back(&pr);
    if (large) {
      // A request that came by RDMA WRITE (landed or rendezvous) runs from
      // the ready queue, after this loop took what else had arrived:
      // started at once, 64 KiB echo calls went from ~60,000 to ~50,000/s
      // on the soft provider at 31 -> 38 us of CPU per call (bench/
      // RESULTS.md; why is not understood yet). Small ones start at once.
      c->ctx->reactor().Schedule(call_coro.h);
    } else {
      coverbs::internal::ResumeOnTrampoline(call_coro.h);
    }
  }
  // The connection is done: stop every call, wait for them, close.
  c->calls.StopAll();
  // Handlers honour their stop token, so this ends.
  if (!c->live_calls.empty()) {
    c->draining = true;
    (void)co_await Unstoppable([](Event* e) -> Task<absl::Status> {
      co_return co_await e->Wait();
    }(&c->drained));
  }
  (void)co_await Unstoppable(conn.Close());
  // Why it ended (this side closes after a bad frame: the peer's fault).
  cm::CloseCause cause = conn.close_cause();
  if (bad_frame) {
    cause = cm::CloseCause::kProtocolViolation;
  } else if (cause == cm::CloseCause::kProtocolViolation) {
    stats_.protocol_errors.fetch_add(1);
  }
  stats_.closed[static_cast<size_t>(cause)].fetch_add(1);
  // After the close (no peer can reach what it held), newest first.
  while (!c->kept.empty()) c->kept.pop_back();
  cm::Connection::Stats cs = conn.stats();
  stats_.credit_stalls.fetch_add(cs.credit_waits);
  stats_.rendezvous.fetch_add(cs.rendezvous_sent + cs.rendezvous_received);
  stats_.open_connections.fetch_sub(1);
  c->ended = true;
  (void)why;
}

Task<void> Server::DrainConn(std::shared_ptr<Conn> c, absl::Duration quiet) {
  Reactor& r = c->ctx->reactor();
  for (;;) {
    if (c->ended || c->stop.stop_requested()) co_return;
    const uint64_t refused = c->drain_refused;
    const bool idle = c->live_calls.empty();
    if (!(co_await r.Sleep(quiet)).ok()) co_return;
    if (c->ended || c->stop.stop_requested()) co_return;
    if (idle && c->live_calls.empty() && c->drain_refused == refused) {
      c->stop.request_stop();  // the loop closes the connection
      co_return;
    }
  }
}

void Server::Shutdown(absl::Duration drain, absl::Duration quiet) {
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_ || shutting_down_ ||
        draining_.load(std::memory_order_relaxed)) {
      drain = absl::ZeroDuration();
    } else {
      draining_.store(true);
      for (auto& w : conns_) {
        if (auto c = w.lock()) conns.push_back(std::move(c));
      }
    }
  }
  if (drain > absl::ZeroDuration()) {
    const absl::Time deadline = absl::Now() + drain;
    accept_stop_.request_stop();  // no new connections
    for (auto& c : conns) {
      // On the connection's reactor, which also runs ~Conn (BeginShutdown).
      Reactor& r = c->ctx->reactor();
      r.Post([this, c = std::move(c), quiet]() mutable {
        Reactor& here = c->ctx->reactor();
        here.Spawn(DrainConn(std::move(c), quiet));
      });
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, absl::ToChronoTime(deadline),
                   [this] { return live_ == 0; });
  }
  Shutdown();
}

Server::CallCoro Server::RunCall(Conn* c, uint64_t call_id,
                                 const Method* method, Request req) {
  const uint32_t method_id = req.method_id;
  const bool observed = static_cast<bool>(options_.call_observer);
  const absl::Time arrived = observed ? absl::Now() : absl::Time();
  const uint64_t request_bytes = req.payload.data().size();
  if (!c->running.TryAcquire()) {  // no awaiter when a slot is free
    absl::Status slot = co_await c->running.Acquire();
    if (!slot.ok()) {
      // Stopped while waiting for a slot (cancel frame, shutdown): the
      // handler never ran, and nobody waits for an answer.
      c->calls.Remove(call_id);
      stats_.cancelled_calls.fetch_add(1);
      c->admission.Release();
      co_return;
    }
  }
  stats_.calls.fetch_add(1);
  // A stall report of the handler's first run names its method.
  Reactor::NameCurrentTask(method->name);
  // The handler's result in place: no optional around it to construct,
  // test and destroy per call.
  absl::StatusOr<Payload> ran = co_await method->handler(std::move(req));
  c->running.Release();
  const bool cancelled = c->calls.TakeStopped(call_id);
  uint64_t sent_bytes = 0;
  absl::StatusCode code =
      cancelled ? absl::StatusCode::kCancelled : ran.status().code();
  if (cancelled) {
    // The caller gave up (cancel frame) or the server is shutting down:
    // nobody waits for this response.
    stats_.cancelled_calls.fetch_add(1);
  } else if (ran.ok()) {
    std::span<const std::byte> data = ran->data();
    const uint64_t limit = c->response_limit;
    if (data.size() > limit) {
      code = absl::StatusCode::kResourceExhausted;
      co_await SendError(
          c, call_id, method_id,
          absl::ResourceExhaustedError(absl::StrCat(
              "method ", method->name, " returned ", data.size(),
              " bytes, the response limit is ", limit)));
    } else {
      HeaderBytes hdr = ResponseHeader(call_id, method_id,
                                       static_cast<uint32_t>(data.size()));
      std::span<const std::byte> parts[2] = {hdr, data};
      // Failure means the connection is going down; its receive loop
      // reports that. Direct: a small response goes without a send
      // coroutine of its own. Posted before the co_await (PostNow): one
      // that went inline is complete, and the co_await does not suspend;
      // awaited at once, such a send suspended and resumed this coroutine
      // (~30 Ir per call).
      // Usually it goes inline at once (TrySendNow: no awaiter per call).
      absl::Status sent;
      if (std::optional<absl::Status> now = c->conn->TrySendNow(parts)) {
        sent = *std::move(now);
      } else {
        cm::Connection::SendAwaiter send = c->conn->SendV(parts);
        send.PostNow();
        sent = co_await send;
      }
      if (sent.ok()) {
        stats_.response_bytes.fetch_add(data.size());
        sent_bytes = data.size();
      }
    }
  } else {
    stats_.failed_calls.fetch_add(1);
    co_await SendError(c, call_id, method_id, ran.status());
  }
  if (observed) {
    options_.call_observer(CallRecord{method->name, method_id, code,
                                      absl::Now() - arrived, request_bytes,
                                      sent_bytes});
  }
  c->admission.Release();
}

Task<void> Server::SendError(Conn* c, uint64_t call_id, uint32_t method_id,
                             absl::Status status) {
  std::string frame = EncodeError(call_id, method_id, status);
  (void)co_await c->conn->Send(std::as_bytes(std::span(frame)));
}

bool Server::BeginShutdown() {
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return false;
    shutting_down_ = true;
    for (auto& w : conns_) {
      if (auto c = w.lock()) conns.push_back(std::move(c));
    }
    conns_.clear();
  }
  accept_stop_.request_stop();
  for (auto& c : conns) {
    // On the connection's reactor: the stop callbacks then run there. The
    // reference moves into the posted function, so that this thread never
    // holds the last one: ~Conn (the connection's close, its timers) must
    // run on the connection's reactor, not here (a TSan race with that
    // reactor's timer heap, seen in ConnectionsSpreadAcrossReactors).
    Reactor& r = c->ctx->reactor();
    r.Post([c = std::move(c)]() { c->stop.request_stop(); });
  }
  return true;  // the loops keep their own references
}

void Server::Shutdown() {
  if (!BeginShutdown()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return live_ == 0; });
  final_stalls_ = StallsLocked();
  shut_down_ = true;
}

Task<void> Server::ShutdownAsync() {
  if (!BeginShutdown()) co_return;
  Reactor* r = Reactor::Current();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (live_ == 0) {
        final_stalls_ = StallsLocked();
        shut_down_ = true;
        co_return;
      }
    }
    // Polled: the connections may end on other reactors.
    (void)co_await Unstoppable(
        [](Reactor* r) -> Task<absl::Status> {
          co_return co_await r->Sleep(absl::Milliseconds(1));
        }(r));
  }
}

}  // namespace coverbs::rpc
