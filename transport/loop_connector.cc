#include "transport/loop_connector.h"

#include <atomic>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/sync.h"
#include "transport/connector_util.h"
#include "transport/loop/loop_provider.h"

namespace coverbs::transport {
namespace {

using connector_util::Annotate;
using connector_util::Endpoint;

// ---------------------------------------------------------------------------
// Links

// One end's view of a connection's state. on_down runs on `reactor`, once,
// when the other end disconnects or goes away first.
struct LinkEnd {
  std::mutex mu;
  Reactor* reactor = nullptr;
  std::function<void(absl::Status)> on_down;  // mu
  bool down = false;                          // mu
  bool local = false;     // mu: this end disconnected first
  absl::Status why;       // mu
  Event down_event;       // set once down
};

// Shared by the two ConnectionLinks of a connection.
struct LinkState {
  LinkEnd end[2];
};

// Runs end `i`'s OnDown callback on its reactor, if it has one and has not
// run it yet. The state is held by the posted closure: the link may be
// destroyed first (its destructor, on the same reactor, clears on_down).
// Posted under the end's lock: a link with a callback is alive, and so is
// its reactor (links go before their reactors), until the post is done;
// Post never runs the closure inline.
void FireOnDown(const std::shared_ptr<LinkState>& st, int i) {
  LinkEnd& e = st->end[i];
  std::lock_guard<std::mutex> lock(e.mu);
  if (!e.down || e.local || !e.on_down || e.reactor == nullptr) return;
  e.reactor->Post([st, i] {
    LinkEnd& e = st->end[i];
    std::function<void(absl::Status)> fn;
    absl::Status why;
    {
      std::lock_guard<std::mutex> lock(e.mu);
      fn = std::move(e.on_down);
      e.on_down = nullptr;
      why = e.why;
    }
    if (fn) fn(why);
  });
}

// Marks end `i` down (`local`: by its own Disconnect) and fires its OnDown
// when it did not disconnect itself.
void MarkDown(const std::shared_ptr<LinkState>& st, int i, bool local,
              absl::Status why) {
  LinkEnd& e = st->end[i];
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.down) return;
    e.down = true;
    e.local = local;
    e.why = std::move(why);
  }
  e.down_event.Set();
  FireOnDown(st, i);
}

class LoopLink final : public ConnectionLink {
 public:
  LoopLink(std::shared_ptr<LinkState> st, int end, QueuePair* qp,
           std::string describe)
      : st_(std::move(st)), end_(end), qp_(qp),
        describe_(std::move(describe)) {}
  // Destroyed without Disconnect (its owner went away): for the peer, the
  // connection is down as after a peer disconnect.
  ~LoopLink() override {
    {
      std::lock_guard<std::mutex> lock(st_->end[end_].mu);
      st_->end[end_].on_down = nullptr;
    }
    MarkDown(st_, end_, /*local=*/true, absl::OkStatus());
    MarkDown(st_, 1 - end_, /*local=*/false,
             absl::UnavailableError(absl::StrCat(describe_,
                                                 ": the peer went away")));
  }
  // Moves the QP to error; the peer QP goes with it (the loop QPs share
  // their connection) and the peer's OnDown fires on its reactor.
  void Disconnect() override {
    if (!qp_->in_error()) qp_->SetError("disconnect").IgnoreError();
    MarkDown(st_, end_, /*local=*/true, absl::OkStatus());
    MarkDown(st_, 1 - end_, /*local=*/false,
             absl::UnavailableError(
                 absl::StrCat(describe_, ": the peer disconnected")));
  }
  Task<absl::Status> WaitDown(absl::Duration timeout) override {
    absl::Status s = co_await st_->end[end_].down_event.WaitFor(timeout);
    if (absl::IsDeadlineExceeded(s)) {
      co_return absl::DeadlineExceededError(
          absl::StrCat(describe_, ": still up after ",
                       absl::FormatDuration(timeout)));
    }
    co_return s;
  }
  void OnDown(std::function<void(absl::Status)> fn) override {
    {
      std::lock_guard<std::mutex> lock(st_->end[end_].mu);
      st_->end[end_].on_down = std::move(fn);
    }
    FireOnDown(st_, end_);  // the peer may be gone already
  }
  std::string Describe() const override { return describe_; }

 private:
  std::shared_ptr<LinkState> st_;
  int end_;
  QueuePair* qp_;  // valid until the owner destroys it, before this link
  std::string describe_;
};

// ---------------------------------------------------------------------------
// Requests and listeners

// A connection request, shared by the requester (Connect) and the
// listener's IncomingRequest.
struct Request {
  std::mutex mu;
  enum State { kPending, kAccepted, kRejected, kRefused, kAbandoned };
  State state = kPending;               // mu
  std::string client_data;              // immutable once queued
  ProviderQp* client_qp = nullptr;      // alive while kPending (Connect waits)
  Reactor* client_reactor = nullptr;    // immutable once queued
  std::string client_address;           // the address it dialed (numeric)
  uint16_t client_port = 0;             // a number naming the requester
  std::string answer;                   // mu: private data, or reject reason
  std::shared_ptr<LinkState> link;      // mu: set by Accept
  Event answered;
};

struct Listener {
  std::mutex mu;
  std::deque<std::shared_ptr<Request>> queue;  // mu
  bool closed = false;                          // mu
  Event ready;  // set while the queue is not empty (or closed)
};

// The process-wide port table.
struct Ports {
  std::mutex mu;
  absl::flat_hash_map<uint16_t, std::shared_ptr<Listener>> by_port;
  uint16_t next_free = 49152;  // port 0: the first free from here
  static Ports& Get() {
    static Ports* p = new Ports();
    return *p;
  }
};

std::atomic<uint16_t> g_next_client_port{1024};

// Creates the QP (joined to `peer` if given) and hands it to `setup`;
// yields the private data to send and the QP.
absl::StatusOr<std::string> SetUpQp(QpSetup& setup, ProviderQp* peer,
                                    QueuePair** qp_out) {
  auto pqp = loop::CreateQp(setup.pd().provider(),
                            connector_util::InitFor(setup), peer);
  if (!pqp.ok()) return pqp.status();
  auto qp = QueuePair::Adopt(std::move(*pqp), setup.cq(), setup.qp_options(),
                             nullptr, &setup.recv_cq());
  if (!qp.ok()) return qp.status();
  *qp_out = qp->get();
  return setup.Adopt(*std::move(qp));
}

Reactor* ReactorOf(Connector& c);

class LoopRequest final : public IncomingRequest {
 public:
  explicit LoopRequest(std::shared_ptr<Request> req) : req_(std::move(req)) {
    // Both ends are this process: the requester is "at" the address it
    // dialed, as a loopback peer of the soft provider is.
    set_peer(req_->client_address, req_->client_port);
  }

  Task<absl::StatusOr<std::string>> ReadPrivateData(absl::Time) override {
    co_return req_->client_data;
  }

  absl::Status Reject(std::string_view reason) override {
    set_rejected(reason);
    bool answered = false;
    {
      std::lock_guard<std::mutex> lock(req_->mu);
      if (req_->state == Request::kPending) {
        req_->state = Request::kRejected;
        req_->answer = std::string(reason.substr(0, kMaxRejectReason));
        answered = true;
      }
    }
    if (!answered) {
      return absl::UnavailableError("sending the reject failed: the "
                                    "requester gave up");
    }
    req_->answered.Set();
    return absl::OkStatus();
  }

  Task<absl::StatusOr<Established>> Accept(Connector& on, QpSetup& setup,
                                           absl::Time) override {
    const std::string ep = Endpoint(peer_address(), peer_port());
    const std::string where = absl::StrCat("accept from ", ep);
    QueuePair* qp = nullptr;
    absl::Status failed;
    auto st = std::make_shared<LinkState>();
    st->end[0].reactor = req_->client_reactor;
    st->end[1].reactor = ReactorOf(on);
    {
      // Held throughout: the requester cannot give up (and destroy its QP)
      // while its QP is being joined to ours.
      std::lock_guard<std::mutex> lock(req_->mu);
      if (req_->state != Request::kPending) {
        co_return absl::UnavailableError(
            absl::StrCat(where, ": the requester gave up"));
      }
      auto pd = SetUpQp(setup, req_->client_qp, &qp);
      if (pd.ok()) {
        failed = loop::ConnectQps(req_->client_qp, qp->provider());
        if (failed.ok()) {
          req_->state = Request::kAccepted;
          req_->answer = *std::move(pd);
          req_->link = st;
        }
      } else {
        failed = pd.status();
      }
      if (!failed.ok()) {
        req_->state = Request::kRejected;
        req_->answer =
            std::string(failed.message().substr(0, kMaxRejectReason));
        set_rejected(req_->answer);
      }
    }
    req_->answered.Set();
    if (!failed.ok()) co_return Annotate(failed, where);
    Established e;
    e.link = std::make_unique<LoopLink>(std::move(st), 1, qp,
                                        absl::StrCat("loop <- ", ep));
    co_return std::move(e);
  }

 private:
  std::shared_ptr<Request> req_;
};

// Refuses every request still queued (the listener closed).
void RefuseAll(Listener& l) {
  std::deque<std::shared_ptr<Request>> q;
  {
    std::lock_guard<std::mutex> lock(l.mu);
    l.closed = true;
    q.swap(l.queue);
  }
  l.ready.Set();
  for (auto& r : q) {
    {
      std::lock_guard<std::mutex> lock(r->mu);
      if (r->state != Request::kPending) continue;
      r->state = Request::kRefused;
    }
    r->answered.Set();
  }
}

class LoopEndpoint final : public PassiveEndpoint {
 public:
  LoopEndpoint(std::shared_ptr<Listener> l, std::string address, uint16_t port)
      : l_(std::move(l)), address_(std::move(address)), port_(port) {}
  ~LoopEndpoint() override { Close(); }

  uint16_t port() const override { return port_; }

  void Close() override {
    {
      Ports& p = Ports::Get();
      std::lock_guard<std::mutex> lock(p.mu);
      auto it = p.by_port.find(port_);
      if (it != p.by_port.end() && it->second == l_) p.by_port.erase(it);
    }
    RefuseAll(*l_);
  }

  Task<absl::StatusOr<std::unique_ptr<IncomingRequest>>> Next(
      absl::Duration wait) override {
    const std::string where =
        absl::StrCat("listener ", Endpoint(address_, port_));
    const absl::Time deadline = absl::Now() + wait;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(l_->mu);
        if (l_->closed) {
          co_return absl::CancelledError(absl::StrCat(where, ": closed"));
        }
        if (!l_->queue.empty()) {
          std::shared_ptr<Request> r = std::move(l_->queue.front());
          l_->queue.pop_front();
          co_return std::unique_ptr<IncomingRequest>(
              new LoopRequest(std::move(r)));
        }
        // Set again by the next push, under the same lock: no lost wake-up.
        l_->ready.Reset();
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        co_return absl::DeadlineExceededError(
            absl::StrCat(where, ": no connection request"));
      }
      absl::Status s = co_await l_->ready.WaitFor(left);
      if (absl::IsDeadlineExceeded(s)) co_return s;
      if (!s.ok()) co_return Annotate(s, where);
    }
  }

 private:
  std::shared_ptr<Listener> l_;
  std::string address_;
  uint16_t port_;
};

class LoopConnector final : public Connector {
 public:
  explicit LoopConnector(Reactor& reactor) : reactor_(&reactor) {}
  Reactor* reactor() const { return reactor_; }

  Task<absl::StatusOr<Established>> Connect(const ConnectParams& params,
                                            QpSetup& setup) override {
    const std::string ep = Endpoint(params.address, params.port);
    const std::string where = absl::StrCat("connect to ", ep);
    // The address selects nothing (listeners are keyed by port), but a
    // name that does not resolve fails as it would on the other providers.
    auto addresses = co_await connector_util::Resolve(
        params.address, params.port, params.resolve_timeout);
    if (!addresses.ok()) co_return Annotate(addresses.status(), where);
    std::shared_ptr<Listener> l;
    {
      Ports& p = Ports::Get();
      std::lock_guard<std::mutex> lock(p.mu);
      auto it = p.by_port.find(params.port);
      if (it != p.by_port.end()) l = it->second;
    }
    auto refused = [&where] {
      return absl::UnavailableError(absl::StrCat(
          where, ": connection refused (no loop listener on that port)"));
    };
    if (l == nullptr) co_return refused();
    QueuePair* qp = nullptr;
    auto pd = SetUpQp(setup, nullptr, &qp);
    if (!pd.ok()) co_return Annotate(pd.status(), where);
    auto req = std::make_shared<Request>();
    req->client_data = *std::move(pd);
    req->client_qp = qp->provider();
    req->client_reactor = reactor_;
    req->client_address = addresses->empty() ? params.address
                                             : addresses->front().Numeric();
    req->client_port = g_next_client_port.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(l->mu);
      if (l->closed) co_return refused();
      l->queue.push_back(req);
      l->ready.Set();
    }
    absl::Status waited = co_await req->answered.WaitFor(params.connect_timeout);
    Request::State state;
    {
      std::lock_guard<std::mutex> lock(req->mu);
      if (req->state == Request::kPending) req->state = Request::kAbandoned;
      state = req->state;
    }
    switch (state) {
      case Request::kAccepted: {
        Established e;
        e.link = std::make_unique<LoopLink>(req->link, 0, qp,
                                            absl::StrCat("loop -> ", ep));
        e.private_data = std::move(req->answer);
        co_return std::move(e);
      }
      case Request::kRejected:
        co_return absl::PermissionDeniedError(absl::StrCat(
            where, ": rejected by the peer: ",
            req->answer.empty() ? "(no reason given)" : req->answer));
      case Request::kRefused:
        co_return absl::UnavailableError(
            absl::StrCat(where, ": connection refused (the listener closed)"));
      default:
        break;
    }
    if (absl::IsDeadlineExceeded(waited)) {
      co_return absl::DeadlineExceededError(
          absl::StrCat(where, ": no answer within ",
                       absl::FormatDuration(params.connect_timeout)));
    }
    co_return Annotate(waited.ok() ? absl::CancelledError("cancelled") : waited,
                       where);
  }

  absl::StatusOr<std::shared_ptr<PassiveEndpoint>> Listen(
      const std::string& address, uint16_t port, int) override {
    // Checked as the other connectors check it, though only the port
    // matters here.
    auto sa = connector_util::ListenAddress(address, port);
    if (!sa.ok()) {
      return Annotate(sa.status(),
                      absl::StrCat("listen on ", Endpoint(address, port)));
    }
    Ports& p = Ports::Get();
    std::lock_guard<std::mutex> lock(p.mu);
    if (port == 0) {
      for (int i = 0; i < 65536 && port == 0; ++i) {
        uint16_t c = p.next_free++;
        if (p.next_free == 0) p.next_free = 49152;
        if (c != 0 && !p.by_port.contains(c)) port = c;
      }
      if (port == 0) {
        return absl::ResourceExhaustedError(
            absl::StrCat("listen on ", Endpoint(address, 0),
                         ": every loop port is taken"));
      }
    } else if (p.by_port.contains(port)) {
      return absl::UnavailableError(
          absl::StrCat("listen on ", Endpoint(address, port),
                       ": bind: address already in use (another loop "
                       "listener has the port)"));
    }
    auto l = std::make_shared<Listener>();
    p.by_port[port] = l;
    return std::make_shared<LoopEndpoint>(std::move(l), address, port);
  }

 private:
  Reactor* reactor_;
};

Reactor* ReactorOf(Connector& c) {
  if (auto* l = dynamic_cast<LoopConnector*>(&c)) return l->reactor();
  return Reactor::Current();
}

}  // namespace

std::unique_ptr<Connector> CreateLoopConnector(Reactor& reactor) {
  return std::make_unique<LoopConnector>(reactor);
}

}  // namespace coverbs::transport
