#include "rpc/client.h"

#include <array>
#include <memory>
#include <optional>
#include <stop_token>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "core/timeout.h"

namespace coverbs::rpc {

namespace {
struct Pending;
}

namespace internal {

// The pending calls by id. Ids come from a counter, so the calls in flight
// nearly always sit in distinct slots of a small ring indexed by the id:
// add, take and remove are an array access (a hash map cost ~150
// instructions per call for the three). An id whose slot is taken (more
// than kRing calls in flight, or a slow call lapped by later ones) goes to
// the map. Reactor thread only.
class PendingTable {
 public:
  // The ring inline, the map out of line (inline, the map's code kept the
  // compiler from inlining the whole: a call per add and per take).
  void Add(uint64_t id, Pending* p) {
    Slot& s = ring_[id & (kRing - 1)];
    ++size_;
    if (s.p == nullptr) {
      s = {id, p};
    } else {
      AddToMap(id, p);
    }
  }
  // Removes and returns id's call, or null when there is none.
  Pending* Take(uint64_t id) {
    Slot& s = ring_[id & (kRing - 1)];
    if (s.p != nullptr && s.id == id) {
      --size_;
      return std::exchange(s.p, nullptr);
    }
    if (overflow_.empty()) return nullptr;
    return TakeFromMap(id);
  }
  // Removes id's entry if it is `p`'s.
  void Remove(uint64_t id, const Pending* p) {
    Slot& s = ring_[id & (kRing - 1)];
    if (s.p == p && s.id == id) {
      s.p = nullptr;
      --size_;
      return;
    }
    auto it = overflow_.find(id);
    if (it != overflow_.end() && it->second == p) {
      overflow_.erase(it);
      --size_;
    }
  }
  size_t size() const { return size_; }
  template <typename F>
  void ForEach(F f) {
    for (Slot& s : ring_) {
      if (s.p != nullptr) f(s.p);
    }
    for (auto& [id, p] : overflow_) f(p);
  }
  // Empties the table and returns what it held.
  std::vector<Pending*> TakeAll() {
    std::vector<Pending*> all;
    all.reserve(size_);
    for (Slot& s : ring_) {
      if (s.p != nullptr) all.push_back(std::exchange(s.p, nullptr));
    }
    for (auto& [id, p] : overflow_) all.push_back(p);
    overflow_.clear();
    size_ = 0;
    return all;
  }

 private:
  [[gnu::noinline]] void AddToMap(uint64_t id, Pending* p) {
    overflow_.emplace(id, p);
  }
  [[gnu::noinline]] Pending* TakeFromMap(uint64_t id) {
    auto it = overflow_.find(id);
    if (it == overflow_.end()) return nullptr;
    Pending* p = it->second;
    overflow_.erase(it);
    --size_;
    return p;
  }
  static constexpr size_t kRing = 256;
  struct Slot {
    uint64_t id = 0;
    Pending* p = nullptr;
  };
  std::array<Slot, kRing> ring_{};
  absl::flat_hash_map<uint64_t, Pending*> overflow_;
  size_t size_ = 0;
};

// Calls waiting under one stop token share one stop callback (see
// ClientState::watch): its firing, on any thread, cancels them on the
// reactor.
struct WatchFired {
  ClientState* st;
  void operator()() const noexcept;
};

struct ClientState {
  std::weak_ptr<ClientState> self;  // for work posted from other threads
  std::unique_ptr<cm::Connection> conn;
  ClientOptions options;
  Reactor* reactor = nullptr;
  PendingTable pending;
  uint64_t next_id = 1;
  absl::Status status;  // OK while usable
  std::stop_source reader_stop;
  Event reader_done;
  // SendCancel tasks still running: they hold the connection, so Close
  // waits for them and its caller may then destroy the Worker.
  WaitGroup cancels;
  DecodeLimits limits;
  size_t eager_max = 0;  // responses up to this size sit in a receive buffer
  // Largest request payload: the peer's max_message_size less the header,
  // and at most what payload_len (32 bits) can say -- one comparison per
  // call.
  uint64_t request_limit = 0;
  bool closing = false;
  Client::Stats stats;
  // The method of the last call and its id: calls mostly name one method,
  // and comparing the name is cheaper than hashing it (MethodId) per call.
  std::string last_method;
  uint32_t last_method_id = 0;
  uint32_t IdOf(std::string_view method) {
    if (method.size() != last_method.size() || method != last_method) {
      last_method_id = MethodId(method);
      last_method.assign(method);
    }
    return last_method_id;
  }
  // Calls usually run under one token (their caller's, the same for all of
  // them): those waiting under `watch_token` are marked (Pending::watched),
  // counted here, and share one stop callback instead of registering one
  // each (a registration and its removal, under the token's lock, were
  // ~100 Ir per call); when it fires the pending table is searched for the
  // marked calls (a list of them cost ~12 Ir per call to keep). The watch
  // moves to another token when nobody waits under the current one; calls
  // under other tokens meanwhile register their own. Reactor thread only,
  // but for the callback (WatchFired).
  std::stop_token watch_token;
  std::optional<std::stop_callback<WatchFired>> watch_cb;
  size_t watched = 0;

  void FailAll(const absl::Status& why);
  // Reactor thread: the watched token was stopped; cancels the calls
  // waiting under it.
  void CancelWatched();
};
}  // namespace internal
using internal::ClientState;
using ::coverbs::internal::Unstoppable;

namespace {

// One waiting call; lives in the Call coroutine's frame, which awaits it
// for the response. A reactor-local one-shot rather than an Event and a
// Task around the send and the wait: the reader completes it on the same
// thread, and a stop request (which may come from any thread) is handed to
// the reactor by CancellableOp before the wait ends.
struct Pending final : coverbs::internal::CancellableOp {
  ClientState* st;
  uint64_t id;
  bool registered = true;  // in st->pending
  bool waiting = false;    // the call is suspended on it
  bool watched = false;    // waits under st->watch_token (counted there)
  std::optional<absl::StatusOr<Response>> result;
  std::optional<std::stop_callback<coverbs::internal::CancelCallback>> cb;

  Pending(ClientState* s, uint64_t i)
      : CancellableOp(s->reactor), st(s), id(i) {}
  // Inline (once per call, in the call's frame): out of line it was a call
  // that also re-tested the result just moved out (~11 Ir per call).
  [[gnu::always_inline]] ~Pending() {
    cb.reset();
    Unwatch();
    // Frame destroyed while registered (reactor shutdown), or the call
    // gave up: unregister.
    Unregister();
  }
  void Unregister() {
    if (!registered) return;
    registered = false;
    st->pending.Remove(id, this);
  }
  // Reactor thread; the caller took it out of st->pending.
  void Complete(absl::StatusOr<Response> r) {
    registered = false;
    result.emplace(std::move(r));
    if (waiting) Finish();
  }
  // A response, built in place: a copy of `bytes` (a small one), or the
  // bytes of `m` after the header (no Payload moved from argument to
  // argument first).
  void CompleteCopy(std::span<const std::byte> bytes) {
    registered = false;
    result.emplace(absl::in_place,
                   std::vector<std::byte>(bytes.begin(), bytes.end()));
    if (waiting) Finish();
  }
  void CompleteHeld(cm::Message m) {
    registered = false;
    result.emplace(absl::in_place, std::move(m), kHeaderSize);
    if (waiting) Finish();
  }

  // Awaiting it waits for Complete or a stop request; then `result` says
  // which.
  bool await_ready() const noexcept { return result.has_value(); }
  // Inline: once per call (gcc made it a call of its own).
  template <typename P>
  [[gnu::always_inline]] bool await_suspend(std::coroutine_handle<P> h) {
    static_assert(coverbs::internal::HasStopToken<P>);
    // By reference: a copy is two atomic count updates.
    const std::stop_token& token = h.promise().stop_token();
    if (token.stop_requested()) return false;
    waiter_ = h;
    waiting = true;
    // The watched token first (the usual case, one comparison): it is set
    // only with its callback, and an empty token (no stop possible) equal
    // to an empty watch has nothing to watch.
    if (token == st->watch_token) {
      if (st->watch_cb.has_value()) Watch();
    } else if (token.stop_possible()) {
      if (st->watched == 0) {
        // Marked first: a callback that runs at once (the token stopped
        // meanwhile) finds this call.
        Watch();
        st->watch_cb.reset();
        st->watch_token = token;
        st->watch_cb.emplace(token, internal::WatchFired{st});
      } else {
        cb.emplace(token, coverbs::internal::CancelCallback{this});
      }
    }
    return true;
  }
  void await_resume() {
    cb.reset();
    Unwatch();
  }
  void Watch() {
    watched = true;
    ++st->watched;
  }
  void Unwatch() {
    if (!watched) return;
    watched = false;
    --st->watched;
  }

 private:
  // Reactor thread: stop requested before a response came. A response that
  // arrives later finds no pending call (a late response).
  void DoCancel() override {
    Unregister();
    Finish();
  }
};

Task<void> SendCancel(std::shared_ptr<ClientState> st, uint64_t id,
                      uint32_t method_id) {
  HeaderBytes hdr = CancelHeader(id, method_id);
  if (st->status.ok()) {
    ++st->stats.cancels_sent;
    (void)co_await st->conn->Send(std::span<const std::byte>(hdr));
  }
  st->cancels.Done();
}

Task<void> Reader(std::shared_ptr<ClientState> st) {
  cm::Connection& conn = *st->conn;
  bool close = false;
  Frame f;  // (out of the loop: not built anew per message)
  for (;;) {
    // Recv has no coroutine frame: a response already there is taken
    // without suspending.
    auto m = co_await conn.Recv();
    if (!m.ok()) {
      st->FailAll(absl::UnavailableError(absl::StrCat(
          "rpc connection ", conn.name(), " is down: ", m.status().message())));
      break;
    }
    // A response inline; anything else (an error frame, a bad frame)
    // through DecodeFrame.
    if (!DecodeUsualFrame(m->data(), Side::kClient, st->limits, f)) {
      absl::StatusOr<Frame> other =
          DecodeFrame(m->data(), Side::kClient, st->limits);
      if (!other.ok()) {
        st->FailAll(absl::UnavailableError(absl::StrCat(
            "rpc connection ", conn.name(),
            " closed: bad frame from the server: ", other.status().message())));
        close = true;
        break;
      }
      f = *other;
    }
    const FrameHeader& h = f.header;
    if (h.call_id == 0) {  // the server closes the connection, and says why
      absl::Status why = StatusFromErrorFrame(f);
      st->FailAll(absl::UnavailableError(
          absl::StrCat("rpc connection ", conn.name(),
                       " closed by the server: ", why.ToString())));
      close = true;
      break;
    }
    Pending* p = st->pending.Take(h.call_id);
    if (p == nullptr) {
      if (h.call_id >= st->next_id) {
        // No call ever had this id: the server answers what was never
        // asked (a broken or hostile peer). Ends the connection.
        st->FailAll(absl::UnavailableError(absl::StrCat(
            "rpc connection ", conn.name(),
            " closed: protocol violation by the server: a ",
            FrameTypeName(h.type), " for call id ", h.call_id,
            ", which was never issued (next id ", st->next_id, ")")));
        close = true;
        break;
      }
      // The caller gave up (deadline, cancel) before the response came.
      ++st->stats.late_responses;
      continue;
    }
    if (h.type == FrameType::kError) {
      p->Complete(StatusFromErrorFrame(f));
    } else if (m->size() <= st->eager_max) {
      p->CompleteCopy(f.payload);
    } else {
      p->CompleteHeld(*std::move(m));
    }
  }
  if (close) (void)co_await Unstoppable(conn.Close());
  st->reader_done.Set();
}

}  // namespace

void internal::WatchFired::operator()() const noexcept {
  Reactor* r = st->reactor;
  if (r->InLoopThread()) {
    st->CancelWatched();
    return;
  }
  // The state may be gone by the time the reactor runs this.
  r->Post([w = st->self]() {
    if (auto s = w.lock()) s->CancelWatched();
  });
}

void ClientState::CancelWatched() {
  // Calls that waited under the token when it stopped (later ones see the
  // stop before they wait). A cancel request goes through CancellableOp as
  // a call's own callback's would; a call that its response completed
  // meanwhile is left alone there.
  // (Collected first: a cancel takes the call out of the table.)
  std::vector<Pending*> calls;
  pending.ForEach([&calls](Pending* p) {
    if (p->watched) calls.push_back(p);
  });
  for (Pending* p : calls) p->RequestCancel();
}

void ClientState::FailAll(const absl::Status& why) {
  if (status.ok()) status = why;
  for (Pending* p : pending.TakeAll()) p->Complete(status);
  // No call waits any more, and none will (they fail at once now): the
  // shared stop callback leaves the caller's token, so a stop requested
  // later -- after the Worker and the Reactor are gone, say -- reaches
  // nothing of this client. (Calls still marked unmark themselves.)
  watch_cb.reset();
}

std::unique_ptr<Client> Client::Create(std::unique_ptr<cm::Connection> conn,
                                       const ClientOptions& options) {
  auto st = std::make_shared<State>();
  st->self = st;
  st->reactor = &conn->worker().reactor();
  st->options = options;
  cm::Handshake local = conn->local_handshake();
  st->eager_max = local.recv_buffer_size;
  uint64_t mine = local.max_message_size;
  st->limits.max_payload = std::min<uint64_t>(
      options.max_response_size, mine > kHeaderSize ? mine - kHeaderSize : 0);
  uint64_t peer_max = conn->peer().handshake.max_message_size;
  st->request_limit = std::min<uint64_t>(
      peer_max > kHeaderSize ? peer_max - kHeaderSize : 0, 0xffffffffull);
  st->status = conn->status();
  st->conn = std::move(conn);
  st->reactor->Spawn(Reader(st), st->reader_stop.get_token());
  return std::unique_ptr<Client>(new Client(std::move(st)));
}

Task<absl::StatusOr<std::unique_ptr<Client>>> Client::Connect(
    cm::Worker& ctx, std::string address, uint16_t port,
    ClientOptions options) {
  auto conn = co_await cm::Connect(ctx, address, port, options.connect);
  if (!conn.ok()) co_return conn.status();
  co_return Create(*std::move(conn), options);
}

Task<absl::StatusOr<std::unique_ptr<Client>>> Client::Connect(
    cm::Worker& ctx, std::string address, uint16_t port) {
  // Options by value: this Task is lazy and must not refer to a temporary.
  return Connect(ctx, std::move(address), port, ClientOptions{});
}

Client::~Client() {
  state_->FailAll(absl::CancelledError("rpc client destroyed"));
  // The reader ends (its Recv is cancelled) and drops the connection.
  state_->reader_stop.request_stop();
}

absl::Status Client::status() const { return state_->status; }
size_t Client::in_flight() const { return state_->pending.size(); }
cm::Connection& Client::connection() const { return *state_->conn; }
Client::Stats Client::stats() const { return state_->stats; }

namespace {

// Abseil here has its own string_view.
absl::string_view AsAbsl(std::string_view v) { return {v.data(), v.size()}; }

// A call's checks before anything is sent: OK, or what the call returns.
absl::Status CheckCall(const ClientState& st, absl::string_view name,
                       size_t payload_size) {
  if (!st.status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("rpc call ", name, ": ", st.status.message()));
  }
  const uint64_t limit = st.request_limit;
  if (payload_size > limit || payload_size > 0xffffffffull) {
    return absl::InvalidArgumentError(
        absl::StrCat("rpc call ", name, ": request of ", payload_size,
                     " bytes exceeds the connection's limit of ", limit));
  }
  return absl::OkStatus();
}

// A call that got no result: sending its request failed (`sent`), or it
// was stopped (`stopped`; `deadline`: by its deadline), in which case the
// server is told to stop the handler.
absl::Status CallFailed(const std::shared_ptr<ClientState>& st,
                        absl::string_view name, uint64_t id, uint32_t method_id,
                        const absl::Status& sent, bool stopped, bool deadline) {
  if (stopped) {
    // Tell the server to stop the handler; its response, if already on the
    // way, is dropped by the reader (unknown id).
    if (st->status.ok()) {
      st->cancels.Add();
      st->reactor->Spawn(SendCancel(st, id, method_id));
    }
    if (deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rpc call ", name, " (id ", id, ") on ", st->conn->name(),
          ": deadline exceeded; the call was cancelled"));
    }
    return absl::CancelledError(absl::StrCat("rpc call ", name, " (id ", id,
                                             ") on ", st->conn->name(),
                                             ": cancelled"));
  }
  if (!st->status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("rpc call ", name, ": ", st->status.message()));
  }
  return absl::UnavailableError(
      absl::StrCat("rpc call ", name, " (id ", id, ") on ", st->conn->name(),
                   ": sending the request failed: ", sent.ToString()));
}

// The usual call: no deadline and no cancel token of its own, so it runs
// under the caller's token as it is. None of the stop plumbing of
// CallJoined sits in its frame (per call, their construction and
// destruction were a good part of the client's instructions).
Task<absl::StatusOr<Response>> CallPlain(std::shared_ptr<ClientState> st,
                                         std::string_view method,
                                         std::span<const std::byte> payload) {
  const uint32_t method_id = st->IdOf(method);
  // CheckCall's conditions first, without a call and a Status per call.
  if (!st->status.ok() || payload.size() > st->request_limit) {
    co_return CheckCall(*st, AsAbsl(method), payload.size());
  }
  const uint64_t id = st->next_id++;
  ++st->stats.calls;
  Pending p(st.get(), id);
  st->pending.Add(id, &p);
  const HeaderBytes hdr =
      RequestHeader(id, method_id, static_cast<uint32_t>(payload.size()));
  std::span<const std::byte> parts[2] = {hdr, payload};
  // Direct: a small request goes without a send coroutine of its own. Once
  // posted, the response is awaited first and the send's completion after
  // it (it usually came with the response): this coroutine resumes once
  // per call, not twice. A send that fails fails the connection, which
  // completes `p` (FailAll); a stopped call still waits for its posted send.
  // Usually the request goes inline at once (TrySendNow), with no awaiter
  // built and torn down per call.
  absl::Status sent;
  if (std::optional<absl::Status> now = st->conn->TrySendNow(parts)) {
    sent = *std::move(now);
    if (sent.ok()) co_await p;
  } else {
    cm::Connection::SendAwaiter send = st->conn->SendV(parts);
    const bool posted = send.PostNow();
    if (posted) co_await p;
    sent = co_await send;
    if (!posted && sent.ok()) co_await p;
  }
  if (p.result.has_value()) {
    // A response goes into the call's result as a Payload: moving the
    // whole StatusOr went through an out-of-line absl helper (~25 Ir).
    if (p.result->ok()) co_return **std::move(p.result);
    co_return *std::move(p.result);
  }
  // No result: the send failed or the call was stopped.
  p.Unregister();
  std::stop_token token = co_await CurrentStopToken();
  co_return CallFailed(st, AsAbsl(method), id, method_id, sent,
                       token.stop_requested(), false);
}

// A call with a deadline or a cancel token: it stops when the caller's
// ambient token, the cancel token or the deadline asks.
Task<absl::StatusOr<Response>> CallJoined(std::shared_ptr<ClientState> st,
                                          std::string_view method,
                                          std::span<const std::byte> payload,
                                          CallOptions options) {
  const uint32_t method_id = MethodId(method);
  if (absl::Status s = CheckCall(*st, AsAbsl(method), payload.size());
      !s.ok()) {
    co_return s;
  }
  // (No clock read for the usual infinite deadline.)
  if (options.deadline != absl::InfiniteFuture() &&
      options.deadline <= absl::Now()) {
    co_return absl::DeadlineExceededError(
        absl::StrCat("rpc call ", AsAbsl(method), ": deadline already passed"));
  }
  const uint64_t id = st->next_id++;
  ++st->stats.calls;

  // With only one of the tokens able to stop and no deadline the call runs
  // on that token itself; otherwise one stop source per call joins them.
  // (A stop source is a heap-allocated shared state plus a callback
  // registration per link.)
  std::stop_token ambient = co_await CurrentStopToken();
  const bool timed = options.deadline != absl::InfiniteFuture();
  std::stop_token own;  // the call's token when it is not `ambient`
  std::optional<std::stop_source> source;
  std::optional<StopLink> link1, link2;
  StopAtDeadline timer;
  if (timed || (ambient.stop_possible() && options.cancel.stop_possible())) {
    source.emplace();
    link1.emplace(ambient, *source);
    link2.emplace(options.cancel, *source);
    if (timed) timer.Arm(*source, SteadyAfter(options.deadline - absl::Now()));
    own = source->get_token();
  } else if (options.cancel.stop_possible()) {
    own = std::move(options.cancel);
  }
  // The send and the wait run under the call's token (swapped in, and back
  // out below, so `own` holds the caller's meanwhile).
  const bool own_token = own.stop_possible();
  if (own_token) co_await coverbs::internal::SwapStopToken{&own};

  Pending p(st.get(), id);
  st->pending.Add(id, &p);
  const HeaderBytes hdr =
      RequestHeader(id, method_id, static_cast<uint32_t>(payload.size()));
  std::span<const std::byte> parts[2] = {hdr, payload};
  absl::Status s = co_await st->conn->SendV(parts);
  if (s.ok()) co_await p;
  if (own_token) co_await coverbs::internal::SwapStopToken{&own};
  timer.Cancel();
  if (p.result.has_value()) co_return *std::move(p.result);
  // No result: the send failed or the call was stopped.
  p.Unregister();
  const std::stop_token& token = own_token ? own : ambient;
  co_return CallFailed(st, AsAbsl(method), id, method_id, s,
                       token.stop_requested(), timer.fired());
}

}  // namespace

Task<absl::StatusOr<Response>> Client::Call(
    std::string_view method, std::span<const std::byte> payload) {
  if (state_->options.call_timeout != absl::InfiniteDuration()) {
    return Call(method, payload, CallOptions());
  }
  return CallPlain(state_, method, payload);
}

Task<absl::StatusOr<Response>> Client::Call(std::string_view method,
                                            std::span<const std::byte> payload,
                                            CallOptions options) {
  if (options.deadline == absl::InfiniteFuture() &&
      state_->options.call_timeout != absl::InfiniteDuration()) {
    options.deadline = absl::Now() + state_->options.call_timeout;
  }
  if (options.deadline == absl::InfiniteFuture() &&
      !options.cancel.stop_possible()) {
    return CallPlain(state_, method, payload);
  }
  return CallJoined(state_, method, payload, std::move(options));
}

Task<absl::Status> Client::Close() {
  std::shared_ptr<State> st = state_;
  if (st->closing) co_return absl::OkStatus();
  st->closing = true;
  st->FailAll(absl::UnavailableError(
      absl::StrCat("rpc client on ", st->conn->name(), " closed")));
  st->reader_stop.request_stop();
  (void)co_await Unstoppable([](Event* e) -> Task<absl::Status> {
    co_return co_await e->Wait();
  }(&st->reader_done));
  absl::Status s = co_await Unstoppable(st->conn->Close());
  // The connection is down now, so cancel frames still waiting for a credit
  // or a completion end at once.
  (void)co_await Unstoppable([](WaitGroup* wg) -> Task<absl::Status> {
    co_return co_await wg->Wait();
  }(&st->cancels));
  co_return s;
}

}  // namespace coverbs::rpc
