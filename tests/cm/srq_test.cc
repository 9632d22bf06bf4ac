// The connection layer's shared receive queue (ConnectionOptions::use_srq)
// on every available provider: promises against posted receives, the
// credit window that grows and shrinks, a full SRQ, the lean defaults
// (small buffers: larger payloads by WRITE) and the CQ room it needs. On
// the host it runs on the soft provider; tests/vm runs it on rxe and siw.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cm/connect.h"
#include "cm/connection.h"
#include "cm/listener.h"
#include "cm/worker.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/cm/test_util.h"

namespace coverbs::cm {
namespace {

TEST_P(CmTest, SrqBothSidesMessagesOfEverySizeAndAMessageOutlivesIt) {
  Run(
      [](CmTest* t) -> Task<void> {
        CO_ASSERT_OK(t->UseSrq(t->server_ctx_, 256));
        CO_ASSERT_OK(t->UseSrq(t->client_ctx_, 256));
        ConnectOptions co;
        co.connection.use_srq = true;
        co.connection.qp.rnr_retry = 0;  // any RNR fails the connection
        ListenerOptions lo;
        lo.connection.use_srq = true;
        lo.connection.qp.rnr_retry = 0;
        auto p = co_await t->MakePair(co, lo);
        CO_ASSERT_OK(p);
        EXPECT_EQ(p->server->peer().handshake.credits, 2u);
        EXPECT_EQ(p->server->peer().handshake.max_credits, 64u);
        // The SRQ's buffers (2 KiB by default) are announced: what does not
        // fit them goes by WRITE although the threshold is 8 KiB.
        size_t fits = WorkerOptions().srq_buffer_size - 16;
        EXPECT_EQ(p->server->peer().handshake.recv_buffer_size, fits + 16);
        size_t thr = ConnectionOptions().rendezvous_threshold;
        std::vector<size_t> sizes = {1,       fits, fits + 1, 4096,
                                     thr - 1, thr,  thr + 1,  1u << 20};
        uint8_t seed = 0;
        for (size_t n : sizes) {
          auto data = Pattern(n, ++seed);
          Connection::Stats before = p->client->stats();
          CO_ASSERT_OK(co_await p->client->Send(data));
          Connection::Stats after = p->client->stats();
          EXPECT_EQ(after.landed_sent + after.rendezvous_sent -
                        before.landed_sent - before.rendezvous_sent,
                    n > fits ? 1u : 0u)
              << "size " << n;
          auto m = co_await p->server->Recv();
          CO_ASSERT_OK(m);
          EXPECT_TRUE(Same(m->data(), data)) << "size " << n;
          CO_ASSERT_OK(co_await p->server->Send(m->data()));
          auto back = co_await p->client->Recv();
          CO_ASSERT_OK(back);
          EXPECT_TRUE(Same(back->data(), data)) << "echo of size " << n;
        }
        // A message received through the SRQ stays intact after its
        // connection is gone; releasing it then reposts its buffer.
        auto last = Pattern(100, 99);
        CO_ASSERT_OK(co_await p->client->Send(last));
        auto kept = co_await p->server->Recv();
        CO_ASSERT_OK(kept);
        CO_ASSERT_OK(co_await p->client->Close());
        co_await p->server->Close();
        p->server.reset();
        p->client.reset();
        EXPECT_TRUE(Same(kept->data(), last));
        *kept = Message();
        // The SRQ serves the next connection.
        auto q = co_await t->MakePair(co, lo);
        CO_ASSERT_OK(q);
        CO_ASSERT_OK(co_await q->client->Send(last));
        auto m = co_await q->server->Recv();
        CO_ASSERT_OK(m);
        EXPECT_TRUE(Same(m->data(), last));
        CO_ASSERT_OK(co_await q->client->Close());
        co_await q->server->Close();
      }(this),
      absl::Seconds(120));
}

TEST_P(CmTest, SrqWindowGrowsForABusySenderAndShrinksWhenItIsNot) {
  Run(
      [](CmTest* t) -> Task<void> {
        CO_ASSERT_OK(t->UseSrq(t->server_ctx_, 512));
        ConnectOptions co;
        co.connection.qp.rnr_retry = 0;
        ListenerOptions lo;
        lo.connection.use_srq = true;
        lo.connection.recv_credits = 32;
        lo.connection.srq_initial_credits = 2;
        lo.connection.qp.rnr_retry = 0;
        auto p = co_await t->MakePair(co, lo);
        CO_ASSERT_OK(p);
        EXPECT_EQ(p->server->stats().recv_window, 2u);
        // 1,000 messages ahead of a receiver that keeps up: the sender
        // runs out of its 2 credits, so the window grows (never past 32).
        int failures = 0;
        co_await t->SendAhead(p->client.get(), p->server.get(), 1000, 100, 2,
                              &failures);
        EXPECT_EQ(failures, 0);
        Connection::Stats grown = p->server->stats();
        EXPECT_GT(grown.recv_window_peak, 2u);
        EXPECT_LE(grown.recv_window_peak, 32u);
        // One message at a time, each answered: the sender rarely runs out
        // (only when a credit has not come back yet), so the window shrinks
        // back to about the initial grant.
        for (int i = 0; i < 400; ++i) {
          uint32_t v = i;
          CO_ASSERT_OK(
              co_await p->client->Send(std::as_bytes(std::span(&v, 1))));
          auto m = co_await p->server->Recv();
          CO_ASSERT_OK(m);
          CO_ASSERT_OK(co_await p->server->Send(m->data()));
          auto r = co_await p->client->Recv();
          CO_ASSERT_OK(r);
        }
        EXPECT_LE(p->server->stats().recv_window, 4u)
            << "peak was " << grown.recv_window_peak;
        EXPECT_GE(p->server->stats().recv_window, 2u);
        EXPECT_TRUE(p->client->status().ok()) << p->client->status();
        EXPECT_TRUE(p->server->status().ok()) << p->server->status();
        co_await p->client->Close();
        co_await p->server->Close();
      }(this),
      absl::Seconds(120));
}

TEST_P(CmTest, SrqFullRejectsWithReasonAndCloseGivesTheReceivesBack) {
  Run(
      [](CmTest* t) -> Task<void> {
        // Each connection is promised 2 credits + 6 reserve receives.
        constexpr int kConns = 8;
        constexpr int kPromised = 8;
        CO_ASSERT_OK(t->UseSrq(t->server_ctx_, kConns * kPromised));
        ListenerOptions lo;
        lo.connection.use_srq = true;
        lo.connection.recv_credits = 8;
        lo.connection.send_depth = 8;
        lo.connection.qp.rnr_retry = 0;
        ConnectOptions co;
        co.connection.recv_credits = 8;
        co.connection.send_depth = 8;
        co.connection.qp.rnr_retry = 0;
        auto ln = Listener::Create(*t->server_ctx_, t->addr_, 0, lo);
        CO_ASSERT_OK(ln);
        std::vector<std::unique_ptr<Connection>> servers, clients;
        auto acc = [](Listener* l, std::vector<std::unique_ptr<Connection>>* v,
                      WaitGroup* wg) -> Task<void> {
          auto c = co_await l->Accept();
          if (c.ok()) v->push_back(*std::move(c));
          wg->Done();
        };
        for (int i = 0; i < kConns; ++i) {
          WaitGroup wg;
          wg.Add();
          t->reactor_->Spawn(acc(ln->get(), &servers, &wg));
          auto c =
              co_await Connect(*t->client_ctx_, t->addr_, (*ln)->port(), co);
          CO_ASSERT_OK(c);
          co_await wg.Wait();
          clients.push_back(*std::move(c));
        }
        CO_ASSERT_TRUE(servers.size() == static_cast<size_t>(kConns));
        Worker::SrqUsage u = t->server_ctx_->srq_usage();
        EXPECT_EQ(u.promised, kConns * kPromised);
        EXPECT_EQ(u.buffers, static_cast<uint32_t>(kConns * kPromised));
        EXPECT_EQ(u.posted, u.buffers);  // nothing held by Messages
        EXPECT_EQ(u.bytes, u.buffers * size_t{2048 + 64});
        // Full: the next peer is rejected with the reason (the acceptor
        // goes on and takes the connection made after a close below).
        WaitGroup wg;
        wg.Add();
        t->reactor_->Spawn(acc(ln->get(), &servers, &wg));
        auto extra =
            co_await Connect(*t->client_ctx_, t->addr_, (*ln)->port(), co);
        CO_ASSERT_TRUE(!extra.ok());
        EXPECT_NE(std::string(extra.status().message())
                      .find("shared receive queue is full"),
                  std::string::npos)
            << extra.status();
        EXPECT_EQ((*ln)->stats().rejected, 1u);
        // Every connection works, each with its own messages.
        for (int i = 0; i < kConns; ++i) {
          auto data = Pattern(64 + i, static_cast<uint8_t>(i));
          CO_ASSERT_OK(co_await clients[i]->Send(data));
        }
        for (int i = 0; i < kConns; ++i) {
          auto m = co_await servers[i]->Recv();
          CO_ASSERT_OK(m);
          EXPECT_TRUE(
              Same(m->data(), Pattern(64 + i, static_cast<uint8_t>(i))));
        }
        // Closing one gives its receives back: a new peer gets in.
        CO_ASSERT_OK(co_await clients[0]->Close());
        co_await servers[0]->Close();
        servers[0].reset();
        auto again =
            co_await Connect(*t->client_ctx_, t->addr_, (*ln)->port(), co);
        CO_ASSERT_OK(again);
        co_await wg.Wait();
        CO_ASSERT_TRUE(servers.size() == static_cast<size_t>(kConns + 1));
        EXPECT_EQ(t->server_ctx_->srq_usage().promised, kConns * kPromised);
        auto hi = Pattern(10, 7);
        CO_ASSERT_OK(co_await (*again)->Send(hi));
        auto m = co_await servers.back()->Recv();
        CO_ASSERT_OK(m);
        EXPECT_TRUE(Same(m->data(), hi));
        clients.push_back(*std::move(again));
        for (auto& c : clients) co_await c->Close();
        for (auto& s : servers) {
          if (s) co_await s->Close();
        }
        (*ln)->Close();
      }(this),
      absl::Seconds(120));
}

// Medium messages to an SRQ server on several connections at once, as
// echo_client sends them: each connection's first ones take the rendezvous
// (no landing grants yet), several in flight, with a window of 2.
TEST_P(CmTest, SrqServerTakesConcurrentMediumMessagesOnEveryConnection) {
  Run(
      [](CmTest* t) -> Task<void> {
        CO_ASSERT_OK(t->UseSrq(t->server_ctx_, 1024));
        ConnectOptions co;
        co.connection.qp.rnr_retry = 0;
        ListenerOptions lo;
        lo.connection.use_srq = true;
        lo.connection.qp.rnr_retry = 0;
        constexpr int kConns = 4, kInFlight = 8, kRounds = 3;
        constexpr size_t kSize = 4096;  // above the SRQ's 2 KiB buffers
        std::vector<Pair> pairs;
        for (int i = 0; i < kConns; ++i) {
          auto p = co_await t->MakePair(co, lo);
          CO_ASSERT_OK(p);
          pairs.push_back(*std::move(p));
        }
        auto send = [](Connection* c, std::vector<std::byte> data,
                       WaitGroup* wg) -> Task<void> {
          absl::Status s = co_await c->Send(data);
          EXPECT_TRUE(s.ok()) << s;
          wg->Done();
        };
        auto echo = [](Connection* c, int n, WaitGroup* wg) -> Task<void> {
          for (int i = 0; i < n; ++i) {
            auto m = co_await c->Recv();
            if (!m.ok()) {
              ADD_FAILURE() << m.status();
              break;
            }
            absl::Status s = co_await c->Send(m->data());
            EXPECT_TRUE(s.ok()) << s;
          }
          wg->Done();
        };
        for (int round = 0; round < kRounds; ++round) {
          WaitGroup wg;
          for (int i = 0; i < kConns; ++i) {
            wg.Add(1 + kInFlight);
            t->reactor_->Spawn(echo(pairs[i].server.get(), kInFlight, &wg));
            for (int k = 0; k < kInFlight; ++k) {
              t->reactor_->Spawn(
                  send(pairs[i].client.get(),
                       Pattern(kSize, static_cast<uint8_t>(i * 16 + k)), &wg));
            }
          }
          co_await wg.Wait();
          // Each connection's echoes come back in the order sent.
          for (int i = 0; i < kConns; ++i) {
            for (int k = 0; k < kInFlight; ++k) {
              auto m = co_await pairs[i].client->Recv();
              CO_ASSERT_OK(m);
              EXPECT_TRUE(Same(
                  m->data(), Pattern(kSize, static_cast<uint8_t>(i * 16 + k))))
                  << "connection " << i << ", message " << k;
            }
          }
        }
        for (Pair& p : pairs) {
          EXPECT_GT(
              p.client->stats().rendezvous_sent + p.client->stats().landed_sent,
              0u);
          CO_ASSERT_OK(co_await p.client->Close());
          co_await p.server->Close();
        }
      }(this),
      absl::Seconds(60));
}

// srq_depth alone sizes the Worker's CQ for the SRQ's receives; an explicit
// cq_entries too small for it is refused when the Worker is made, naming
// both knobs (not at the first connection).
TEST_P(CmTest, SrqDepthSizesTheCompletionQueue) {
  Run([](CmTest* t) -> Task<void> {
    CO_ASSERT_OK(t->UseSrq(t->server_ctx_, 8192));
    EXPECT_GE(t->server_ctx_->cq().capacity(), 8192 + 4096);
    ConnectOptions co;
    ListenerOptions lo;
    lo.connection.use_srq = true;
    auto p = co_await t->MakePair(co, lo);
    CO_ASSERT_OK(p);
    auto hi = Pattern(64, 3);
    CO_ASSERT_OK(co_await p->client->Send(hi));
    auto m = co_await p->server->Recv();
    CO_ASSERT_OK(m);
    EXPECT_TRUE(Same(m->data(), hi));
    CO_ASSERT_OK(co_await p->client->Close());
    co_await p->server->Close();

    WorkerOptions o;
    o.srq_depth = 1024;
    o.cq_entries = 256;
    auto w = Worker::Create(*t->reactor_, *t->device_, o);
    CO_ASSERT_TRUE(!w.ok());
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(w.status().message().find("srq_depth 1024"), std::string::npos)
        << w.status();
    EXPECT_NE(w.status().message().find("cq_entries"), std::string::npos);
  }(this));
}

TEST_P(CmTest, SrqNeedsAWorkerWithOne) {
  Run([](CmTest* t) -> Task<void> {
    ListenerOptions lo;
    auto ln = Listener::Create(*t->server_ctx_, t->addr_, 0, lo);
    CO_ASSERT_OK(ln);
    ConnectOptions co;
    co.connection.use_srq = true;  // client_ctx_ has no SRQ
    auto c = co_await Connect(*t->client_ctx_, t->addr_, (*ln)->port(), co);
    CO_ASSERT_TRUE(!c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition)
        << c.status();
    EXPECT_NE(std::string(c.status().message()).find("srq_depth"),
              std::string::npos)
        << c.status();
    (*ln)->Close();
  }(this));
}

INSTANTIATE_TEST_SUITE_P(Providers, CmTest,
                         ::testing::ValuesIn(InProcessProviders()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
