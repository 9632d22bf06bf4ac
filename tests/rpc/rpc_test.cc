// RPC end to end on every available provider: a Server on a 2-thread
// ReactorPool (accepted connections spread over both reactors) and Clients
// on the test thread's reactor. On the host it runs on the soft provider
// over 127.0.0.1; tests/vm runs it with COVERBS_PROVIDER=verbs on Soft-RoCE
// and SoftiWARP. Deadlines, cancellation and stop tokens: rpc_cancel_test.cc
// (same binary, same fixture: rpc_fixture.h).
#include "tests/rpc/rpc_fixture.h"

namespace coverbs::rpc {
namespace {

using namespace rpc_test_util;  // NOLINT: the fixture and its helpers

TEST_P(RpcTest, EchoAcrossSizes) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    size_t th = Threshold();
    for (size_t n : {size_t{0}, size_t{1}, th - 1, th, th + 1, size_t{1} << 20,
                     size_t{16} << 20}) {
      auto req = Pattern(n, static_cast<uint32_t>(n));
      auto r = co_await (*c)->Call("Echo", req);
      CO_ASSERT_OK(r);
      EXPECT_TRUE(Same(r->data(), req)) << n << " bytes";
      // Large responses are handed over without a copy (at the threshold
      // the client copies conservatively: it compares with its receive
      // buffer size, which includes the connection's own header).
      if (n <= th) {
        EXPECT_FALSE(r->zero_copy()) << n << " bytes";
      }
      if (n >= (size_t{1} << 20)) {
        EXPECT_TRUE(r->zero_copy()) << n << " bytes";
      }
    }
    EXPECT_GE((*c)->connection().stats().rendezvous_sent, 3u);
    EXPECT_GE((*c)->connection().stats().rendezvous_received, 3u);
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

// Small requests reach the handler in their receive buffer while few are
// held: one at a time, none is copied. (A lease whose count was given back
// twice once made every request after the first a copy.)
TEST_P(RpcTest, SequentialSmallRequestsAreNotCopied) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    auto req = Pattern(64, 7);
    for (int i = 0; i < 100; ++i) {
      auto r = co_await (*c)->Call("Echo", req);
      CO_ASSERT_OK(r);
      EXPECT_TRUE(Same(r->data(), req));
    }
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
  Server::Stats st = server_->stats();
  EXPECT_GE(st.calls, 100u);
  EXPECT_EQ(st.copied_requests, 0u);
}

// 10,000 echo calls (COVERBS_TEST_REPEAT_PERCENT scales them, down to 1,024:
// each of the 256 slots refilled 4 times) from 256 coroutines sharing one
// connection; every `large_every`-th request (0: none) goes by rendezvous.
// `server_credits`: the initial grant the server must announce (0: any).
void PipelinedEcho(RpcTest* t, int large_every, uint32_t server_credits = 0);

TEST_P(RpcTest, TenThousandPipelinedCallsWith256InFlight) {
  StartServer();
  PipelinedEcho(this, 0);
}

// Rendezvous in both directions while every receive buffer is taken by
// messages queued behind a rendezvous: this deadlocked while CTS needed a
// credit (cm protocol 1); CTS now lands in reserved receives.
TEST_P(RpcTest, PipelinedCallsWithLargePayloads) {
  StartServer();
  PipelinedEcho(this, 97);
}

// The same through a server whose connections receive from their
// Worker's shared receive queue: credit windows start at 2 and grow, and
// requests above its 2 KiB buffers come by WRITE.
TEST_P(RpcTest, PipelinedCallsThroughAnSrqServer) {
  ServerOptions o;
  o.listener.connection.use_srq = true;
  o.listener.connection.qp.rnr_retry = 0;  // any RNR fails the connection
  StartServer(std::move(o));
  PipelinedEcho(this, 97, 2);
}

void PipelinedEcho(RpcTest* test, int large_every, uint32_t server_credits) {
  test->Run([](RpcTest* t, int large_every,
               uint32_t server_credits) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client* client = *c;
    if (server_credits != 0) {
      EXPECT_EQ(client->connection().peer().handshake.credits, server_credits);
    }
    const int kDepth = 256;
    const int calls = coverbs::testing::Repeat(10000, 4 * kDepth);
    int next = 0, ok = 0, max_in_flight = 0;
    WaitGroup wg;
    wg.Add(kDepth);
    auto worker = [](Client* client, int large_every, int calls, int* next,
                     int* ok, int* max_in_flight, WaitGroup* wg) -> Task<void> {
      while (*next < calls) {
        int i = (*next)++;
        // Mostly small, some above the threshold.
        size_t n = large_every > 0 && i % large_every == 0
                       ? RpcTest::Threshold() + 100 + i
                       : 16 + i % 200;
        auto req = Pattern(n, i);
        *max_in_flight = std::max<int>(*max_in_flight, client->in_flight() + 1);
        auto r = co_await client->Call("Echo", req);
        if (r.ok() && Same(r->data(), req)) {
          ++*ok;
        } else {
          ADD_FAILURE() << "call " << i << ": " << r.status();
        }
      }
      wg->Done();
    };
    for (int k = 0; k < kDepth; ++k) {
      Reactor::Current()->Spawn(
          worker(client, large_every, calls, &next, &ok, &max_in_flight, &wg));
    }
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(ok, calls);
    EXPECT_EQ(max_in_flight, kDepth);
    CO_ASSERT_OK(co_await client->Close());
  }(test, large_every, server_credits));
}

TEST_P(RpcTest, UnknownMethodIsNotFound) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    auto req = Pattern(10, 1);
    auto r = co_await (*c)->Call("NoSuchMethod", req);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
    // The connection stays usable.
    auto e = co_await (*c)->Call("Echo", req);
    CO_ASSERT_OK(e);
    EXPECT_EQ(t->server_->stats().unknown_method, 1u);
  }(this));
}

TEST_P(RpcTest, HandlerErrorTravelsBackWithCodeAndMessage) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    std::string why = "no thanks";
    auto r = co_await (*c)->Call("Fail", std::as_bytes(std::span(why)));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(r.status().message(), "refused: no thanks");
  }(this));
}

// Handlers holding more than half of the server's receive buffers: the
// requests beyond that are copied; once those handlers ended (their leases
// came back, on whatever count the server keeps), requests are views again.
TEST_P(RpcTest, RequestsBeyondHalfTheReceiveBuffersAreCopied) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    const int half =
        static_cast<int>((*c)->connection().peer().handshake.credits / 2);
    const int n = half + 4;
    std::stop_source stop;
    WaitGroup wg;
    wg.Add(n);
    for (int i = 0; i < n; ++i) {
      Reactor::Current()->Spawn(
          [](Client* c, WaitGroup* wg) -> Task<void> {
            auto req = Pattern(64, 1);
            (void)co_await c->Call("Slow", req);
            wg->Done();
          }(*c, &wg),
          stop.get_token());
    }
    Observed* obs = &t->obs_;
    EXPECT_TRUE(
        co_await Eventually([obs, n] { return obs->slow_started == n; }));
    Server* server = t->server_.get();
    EXPECT_GE(server->stats().copied_requests, 4u);
    stop.request_stop();
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_TRUE(
        co_await Eventually([obs, n] { return obs->slow_cancelled == n; }));
    const uint64_t copied = server->stats().copied_requests;
    auto req = Pattern(64, 2);
    for (int i = 0; i < 10; ++i) {
      auto r = co_await (*c)->Call("Echo", req);
      CO_ASSERT_OK(r);
    }
    EXPECT_EQ(server->stats().copied_requests, copied);
  }(this));
}

// The client keeps pending calls in a 256-slot ring by call id and the
// ids that find their slot taken in a map: 600 calls in flight at once, and
// a slow call lapped by 300 later ones (whose ids then collide with its
// slot), go through both.
TEST_P(RpcTest, MoreCallsInFlightThanThePendingRing) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client* client = *c;
    int ok = 0;
    WaitGroup wg;
    constexpr int kEcho = 600;
    wg.Add(kEcho);
    for (int i = 0; i < kEcho; ++i) {
      Reactor::Current()->Spawn(
          [](Client* c, int i, int* ok, WaitGroup* wg) -> Task<void> {
            auto req = Pattern(64, i);
            auto r = co_await c->Call("Echo", req);
            if (r.ok() && Same(r->data(), req)) ++*ok;
            wg->Done();
          }(client, i, &ok, &wg));
    }
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(ok, kEcho);
    EXPECT_EQ(client->in_flight(), 0u);

    std::stop_source stop;
    absl::StatusOr<Response> slow = absl::UnknownError("pending");
    Event slow_done;
    SpawnCall(client->Call("Slow", {}), &slow, &slow_done, stop.get_token());
    Observed* obs = &t->obs_;
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 1; }));
    for (int i = 0; i < 300; ++i) {
      auto req = Pattern(64, i);
      auto r = co_await client->Call("Echo", req);
      CO_ASSERT_OK(r);
      EXPECT_TRUE(Same(r->data(), req)) << i;
      EXPECT_EQ(client->in_flight(), 1u);
    }
    stop.request_stop();
    CO_ASSERT_OK(co_await slow_done.Wait());
    EXPECT_EQ(slow.status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(client->in_flight(), 0u);
    // The cancel frame reached the server (and its send is over before the
    // fixture tears the reactors down).
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_cancelled == 1; }));
  }(this));
}

TEST_P(RpcTest, PerConnectionLimitIsBackPressureNotFailure) {
  ServerOptions so;
  so.max_concurrent_calls = 2;
  so.max_queued_calls = 3;
  StartServer(std::move(so));
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    constexpr int kCalls = 40;
    int ok = 0;
    WaitGroup wg;
    wg.Add(kCalls);
    for (int i = 0; i < kCalls; ++i) {
      Reactor::Current()->Spawn(
          [](Client* c, int i, int* ok, WaitGroup* wg) -> Task<void> {
            auto req = Pattern(64, i);
            auto r = co_await c->Call("Gate", req);
            if (r.ok() && Same(r->data(), req)) ++*ok;
            wg->Done();
          }(*c, i, &ok, &wg));
    }
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(ok, kCalls);
    EXPECT_LE(t->obs_.gate_max.load(), 2);
    EXPECT_GE(t->obs_.gate_max.load(), 1);
  }(this));
}

TEST_P(RpcTest, ConnectionsSpreadAcrossReactors) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    for (int i = 0; i < 4; ++i) {
      auto c = co_await t->NewClient();
      CO_ASSERT_OK(c);
      auto r = co_await (*c)->Call("Echo", Pattern(10, i));
      CO_ASSERT_OK(r);
    }
  }(this));
  // Each server reactor hosts connections: the workers' CQs saw traffic.
  EXPECT_EQ(server_->stats().connections, 4u);
}

TEST_P(RpcTest, MalformedFrameGetsAnErrorAndClosesOnlyThatConnection) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto good = co_await t->NewClient();
    CO_ASSERT_OK(good);
    auto raw =
        co_await cm::Connect(*t->client_ctx_, t->addr_, t->server_->port());
    CO_ASSERT_OK(raw);
    // A request whose payload_len lies about the message size.
    HeaderBytes h = RequestHeader(42, MethodId("Echo"), 100);
    std::vector<std::byte> bad(h.begin(), h.end());
    bad.resize(kHeaderSize + 10);
    CO_ASSERT_OK(co_await (*raw)->Send(bad));
    // The call id could be read: call 42 gets the error, then the connection.
    auto m1 = co_await (*raw)->Recv();
    CO_ASSERT_OK(m1);
    auto f1 = DecodeFrame(m1->data(), Side::kClient);
    CO_ASSERT_OK(f1);
    EXPECT_EQ(f1->header.type, FrameType::kError);
    EXPECT_EQ(f1->header.call_id, 42u);
    absl::Status why = StatusFromErrorFrame(*f1);
    EXPECT_EQ(why.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(why.message().find("payload_len 100"), std::string::npos) << why;
    auto m2 = co_await (*raw)->Recv();
    CO_ASSERT_OK(m2);
    auto f2 = DecodeFrame(m2->data(), Side::kClient);
    CO_ASSERT_OK(f2);
    EXPECT_EQ(f2->header.call_id, 0u);
    // Then the server closes it.
    auto m3 = co_await (*raw)->Recv();
    EXPECT_EQ(m3.status().code(), absl::StatusCode::kUnavailable)
        << m3.status();
    // Garbage on another connection: a connection-level error.
    auto raw2 =
        co_await cm::Connect(*t->client_ctx_, t->addr_, t->server_->port());
    CO_ASSERT_OK(raw2);
    std::vector<std::byte> junk(7, std::byte{0xee});
    CO_ASSERT_OK(co_await (*raw2)->Send(junk));
    auto g = co_await (*raw2)->Recv();
    CO_ASSERT_OK(g);
    auto fg = DecodeFrame(g->data(), Side::kClient);
    CO_ASSERT_OK(fg);
    EXPECT_EQ(fg->header.call_id, 0u);
    EXPECT_NE(StatusFromErrorFrame(*fg).message().find("truncated"),
              std::string::npos);
    (void)co_await (*raw)->Close();
    (void)co_await (*raw2)->Close();
    // The well-behaved client is unaffected.
    auto r = co_await (*good)->Call("Echo", Pattern(1000, 9));
    CO_ASSERT_OK(r);
    EXPECT_EQ(t->server_->stats().protocol_errors, 2u);
  }(this));
}

TEST_P(RpcTest, ServerKilledDuringCallsFailsEveryPendingCall) {
  // Under bazel test: the runfiles path; run directly (the VM harness): the
  // helper built next to this binary.
  const char* helper = std::getenv("COVERBS_RPC_SERVER_PEER");
  std::string path = helper ? helper : "tests/rpc/rpc_server_peer";
  if (access(path.c_str(), X_OK) != 0) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
      std::string exe(self, n);
      path = exe.substr(0, exe.rfind('/') + 1) + "rpc_server_peer";
    }
  }
  ASSERT_EQ(access(path.c_str(), X_OK), 0) << "helper not found: " << path;
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  // The child keeps only the write end (dup'ed without CLOEXEC).
  std::string provider = GetParam();
  std::string fd_arg = "3";
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 3);
    execl(path.c_str(), path.c_str(), provider.c_str(), addr_.c_str(),
          fd_arg.c_str(), nullptr);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  close(fds[1]);
  // Read the port (bounded: the helper is killed below if it never says).
  std::string port_text;
  char ch;
  for (int i = 0; i < 16 && read(fds[0], &ch, 1) == 1 && ch != '\n'; ++i) {
    port_text.push_back(ch);
  }
  close(fds[0]);
  uint16_t port = static_cast<uint16_t>(std::atoi(port_text.c_str()));
  if (port == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    FAIL() << "the server helper did not report a port";
  }
  Run(
      [](RpcTest* t, uint16_t port, pid_t pid) -> Task<void> {
        auto c = co_await Client::Connect(*t->client_ctx_, t->addr_, port);
        CO_ASSERT_OK(c);
        auto e = co_await (*c)->Call("Echo", Pattern(100, 1));
        CO_ASSERT_OK(e);
        constexpr int kPending = 32;
        std::vector<absl::Status> results(kPending,
                                          absl::UnknownError("pending"));
        WaitGroup wg;
        wg.Add(kPending);
        for (int i = 0; i < kPending; ++i) {
          // Some small and one large request in flight.
          Reactor::Current()->Spawn(
              [](Client* c, absl::Status* out, WaitGroup* wg) -> Task<void> {
                auto r = co_await c->Call("Hang", {});
                *out = r.status();
                wg->Done();
              }(c->get(), &results[i], &wg));
        }
        Client* client = c->get();
        EXPECT_TRUE(co_await Eventually(
            [client] { return client->in_flight() == kPending; }));
        co_await Reactor::Current()->Sleep(absl::Milliseconds(50));
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        CO_ASSERT_OK(co_await wg.Wait());
        for (const absl::Status& s : results) {
          EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
        }
        EXPECT_FALSE((*c)->status().ok());
        // Later calls fail at once.
        auto late = co_await (*c)->Call("Echo", Pattern(10, 2));
        EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
        (void)co_await (*c)->Close();
      }(this, port, pid),
      absl::Seconds(60));
}

INSTANTIATE_TEST_SUITE_P(Providers, RpcTest, ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::rpc
