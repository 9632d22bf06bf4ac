// Connection::SendVDirect, Connection::Recv's awaiter and TryRecv: the
// frameless send and receive steps used per message. Each must keep Send's
// and Recv's contract: order with the other sends, the slow path when no
// credit is free, receivers served in order, errors once the connection is
// down, and no receiver left waiting when it goes down.
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/cm/test_util.h"

namespace coverbs::cm {
namespace {

using DirectTest = CmTest;

// Direct sends interleaved with SendV and Send keep Send order, and the
// receiver's TryRecv and Recv together see every message once, in order.
TEST_P(DirectTest, DirectSendsKeepOrderWithOtherSends) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    constexpr int kMsgs = 40;
    std::vector<std::vector<std::byte>> msgs;
    for (int i = 0; i < kMsgs; ++i) {
      // Some above the eager limit: those take SendV's rendezvous path.
      size_t n = i % 7 == 0 ? 20000 + i : 1 + i * 3;
      msgs.push_back(Pattern(n, static_cast<uint8_t>(i)));
    }
    WaitGroup wg;
    for (int i = 0; i < kMsgs; ++i) {
      wg.Add();
      auto one = [](Connection* c, std::span<const std::byte> d, int i,
                    WaitGroup* wg) -> Task<void> {
        absl::Status s;
        if (i % 2 == 0) {
          std::span<const std::byte> parts[2] = {d.first(d.size() / 2),
                                                 d.subspan(d.size() / 2)};
          s = co_await c->SendVDirect(parts);
        } else {
          s = co_await c->Send(d);
        }
        EXPECT_TRUE(s.ok()) << s;
        wg->Done();
      };
      t->reactor_->Spawn(one(p->client.get(), msgs[i], i, &wg));
    }
    for (int i = 0; i < kMsgs; ++i) {
      std::optional<Message> m = p->server->TryRecv();
      if (!m.has_value()) {
        auto r = co_await p->server->Recv();
        CO_ASSERT_OK(r);
        m.emplace(*std::move(r));
      }
      EXPECT_TRUE(Same(m->data(), msgs[i])) << "message " << i;
    }
    EXPECT_FALSE(p->server->TryRecv().has_value());
    co_await wg.Wait();
    EXPECT_EQ(p->client->stats().messages_sent, static_cast<uint64_t>(kMsgs));
    co_await Close(*p);
  }(this));
}

// With every credit spent, a direct send waits (SendV's path) until the
// receiver returns credits, and then arrives after the sends before it.
TEST_P(DirectTest, DirectSendWaitsForACredit) {
  Run([](CmTest* t) -> Task<void> {
    ConnectionOptions o;
    o.recv_credits = 4;
    auto p = co_await t->MakePairWith(o);
    CO_ASSERT_OK(p);
    constexpr int kMsgs = 32;
    std::vector<std::vector<std::byte>> msgs;
    for (int i = 0; i < kMsgs; ++i) {
      msgs.push_back(Pattern(16 + i, static_cast<uint8_t>(i)));
    }
    WaitGroup wg;
    wg.Add();
    auto all = [](Connection* c, const std::vector<std::vector<std::byte>>* m,
                  WaitGroup* wg) -> Task<void> {
      for (const auto& b : *m) {
        std::span<const std::byte> parts[1] = {b};
        absl::Status s = co_await c->SendVDirect(parts);
        EXPECT_TRUE(s.ok()) << s;
      }
      wg->Done();
    };
    t->reactor_->Spawn(all(p->client.get(), &msgs, &wg));
    // Nothing received yet, so no credit comes back: the sender runs out
    // after 4 messages and waits (bounded poll, 10 s).
    for (int i = 0; i < 10000 && p->client->stats().credit_waits == 0; ++i) {
      (void)co_await t->reactor_->Sleep(absl::Milliseconds(1));
    }
    EXPECT_GT(p->client->stats().credit_waits, 0u);
    for (int i = 0; i < kMsgs; ++i) {
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), msgs[i])) << "message " << i;
    }
    co_await wg.Wait();
    co_await Close(*p);
  }(this));
}

// Once the connection is closed a direct send fails with Unavailable
// (nothing posted), and TryRecv has nothing.
TEST_P(DirectTest, DirectSendAfterCloseFails) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    co_await Close(*p);
    auto b = Pattern(64, 1);
    std::span<const std::byte> parts[1] = {b};
    absl::Status s = co_await p->client->SendVDirect(parts);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_FALSE(p->server->TryRecv().has_value());
  }(this));
}

// Send(LocalBuffer) from registered memory, small (inline or as a second
// SGE) and large, interleaved with Send(span) and run short of credits
// (the slow path): every message arrives once, in Send order, intact.
TEST_P(DirectTest, RegisteredSendsKeepOrder) {
  Run([](CmTest* t) -> Task<void> {
    ConnectionOptions o;
    o.recv_credits = 4;
    auto p = co_await t->MakePairWith(o);
    CO_ASSERT_OK(p);
    constexpr int kMsgs = 48;
    std::vector<std::vector<std::byte>> msgs;
    for (int i = 0; i < kMsgs; ++i) {
      size_t n = i % 11 == 0 ? 20000 + i : i % 3 == 0 ? 1000 + i : i;
      msgs.push_back(Pattern(n, static_cast<uint8_t>(i)));
    }
    // One registration over all the payloads' copies.
    size_t total = 0;
    for (const auto& m : msgs) total += m.size();
    std::vector<std::byte> mem(total);
    auto mr = p->client->worker().pd().Register(mem.data(), mem.size(),
                                                IBV_ACCESS_LOCAL_WRITE);
    CO_ASSERT_OK(mr);
    std::vector<transport::LocalBuffer> regs;
    size_t off = 0;
    for (const auto& m : msgs) {
      std::memcpy(mem.data() + off, m.data(), m.size());
      transport::LocalBuffer lb = mr->Local();
      lb.addr = mem.data() + off;
      lb.length = static_cast<uint32_t>(m.size());
      regs.push_back(lb);
      off += m.size();
    }
    WaitGroup wg;
    for (int i = 0; i < kMsgs; ++i) {
      wg.Add();
      auto one = [](Connection* c, transport::LocalBuffer lb,
                    std::span<const std::byte> d, int i,
                    WaitGroup* wg) -> Task<void> {
        absl::Status s;
        if (i % 2 == 0) {
          s = co_await c->Send(lb);
        } else {
          s = co_await c->Send(d);
        }
        EXPECT_TRUE(s.ok()) << s;
        wg->Done();
      };
      t->reactor_->Spawn(one(p->client.get(), regs[i], msgs[i], i, &wg));
    }
    for (int i = 0; i < kMsgs; ++i) {
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), msgs[i])) << "message " << i;
    }
    co_await wg.Wait();
    EXPECT_GT(p->client->stats().credit_waits, 0u);
    EXPECT_EQ(p->client->stats().messages_sent, static_cast<uint64_t>(kMsgs));
    co_await Close(*p);
  }(this));
}

// A Send awaiter stored first and awaited later (moved before use) sends,
// and a registered Send after close fails with Unavailable.
TEST_P(DirectTest, StoredSendAndSendAfterClose) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    std::string text = "stored";
    auto send = p->client->Send(text);
    Connection::SendAwaiter moved = std::move(send);
    CO_ASSERT_OK(co_await std::move(moved));
    auto m = co_await p->server->Recv();
    CO_ASSERT_OK(m);
    EXPECT_EQ(m->text(), "stored");
    std::vector<std::byte> mem(64);
    auto mr = p->client->worker().pd().Register(mem.data(), mem.size(),
                                                IBV_ACCESS_LOCAL_WRITE);
    CO_ASSERT_OK(mr);
    co_await Close(*p);
    absl::Status s = co_await p->client->Send(mr->Local());
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  }(this));
}

// A message already deliverable completes co_await Recv() without
// suspending; with none there the receiver waits and gets the next one.
TEST_P(DirectTest, RecvCompletesAtOnceOrWaits) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    std::string first = "first";
    CO_ASSERT_OK(co_await p->client->Send(first));
    // Wait until it is there (bounded poll, 10 s), then take it at once.
    for (int i = 0; i < 10000 && p->server->stats().messages_received == 0;
         ++i) {
      (void)co_await t->reactor_->Sleep(absl::Milliseconds(1));
    }
    {
      Connection::RecvAwaiter r = p->server->Recv();
      EXPECT_TRUE(r.await_ready());  // deliverable: no suspension
      absl::StatusOr<Message> m = r.await_resume();
      CO_ASSERT_OK(m);
      EXPECT_EQ(m->text(), "first");
    }
    // Nothing there: the receiver waits until the next Send.
    bool done = false;
    std::string got;
    WaitGroup wg;
    wg.Add();
    auto rcv = [](Connection* c, bool* done, std::string* got,
                  WaitGroup* wg) -> Task<void> {
      auto m = co_await c->Recv();
      EXPECT_TRUE(m.ok()) << m.status();
      if (m.ok()) *got = std::string(m->text());
      *done = true;
      wg->Done();
    };
    t->reactor_->Spawn(rcv(p->server.get(), &done, &got, &wg));
    co_await t->reactor_->Sleep(absl::Milliseconds(20));
    EXPECT_FALSE(done);
    std::string second = "second";
    CO_ASSERT_OK(co_await p->client->Send(second));
    co_await wg.Wait();
    EXPECT_TRUE(done);
    EXPECT_EQ(got, "second");
    co_await Close(*p);
  }(this));
}

// A receiver that keeps most of its window held -- a sliding window of
// recv_credits - recv_credits / 4 Messages, the oldest released as each new
// one arrives -- still gets every message: receives released in batches
// (ConnectionImpl::FlushRefill) go back to the peer as credits no later
// than one at a time would, and never before they are posted (rnr_retry 0:
// a SEND into an empty receive queue fails the connection). Reposting only
// full batches would owe up to a batch more and stall here.
TEST_P(DirectTest, HoldingMostOfTheWindowNeverStalls) {
  Run([](CmTest* t) -> Task<void> {
    constexpr uint32_t kCredits = 64;
    ConnectionOptions o;
    o.recv_credits = kCredits;
    o.qp.rnr_retry = 0;
    auto p = co_await t->MakePairWith(o);
    CO_ASSERT_OK(p);
    constexpr int kMsgs = 400;
    WaitGroup wg;
    wg.Add();
    t->reactor_->Spawn([](Connection* c, WaitGroup* wg) -> Task<void> {
      for (int i = 0; i < kMsgs; ++i) {
        auto b = Pattern(24, static_cast<uint8_t>(i));
        absl::Status s = co_await c->Send(b);
        EXPECT_TRUE(s.ok()) << "message " << i << ": " << s;
        if (!s.ok()) break;
      }
      wg->Done();
    }(p->client.get(), &wg));
    constexpr size_t kHold = kCredits - kCredits / 4;
    std::deque<Message> held;
    for (int i = 0; i < kMsgs; ++i) {
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), Pattern(24, static_cast<uint8_t>(i))))
          << "message " << i;
      held.push_back(*std::move(m));
      if (held.size() > kHold) held.pop_front();
    }
    co_await wg.Wait();
    EXPECT_TRUE(p->client->status().ok()) << p->client->status();
    EXPECT_TRUE(p->server->status().ok()) << p->server->status();
    held.clear();
    co_await Close(*p);
  }(this));
}

// Receivers that wait at once are served in the order they began to wait,
// one message each.
TEST_P(DirectTest, ConcurrentReceiversKeepOrder) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    constexpr int kReceivers = 8;
    std::vector<std::string> got(kReceivers);
    WaitGroup wg;
    auto rcv = [](Connection* c, std::string* out,
                  WaitGroup* wg) -> Task<void> {
      auto m = co_await c->Recv();
      EXPECT_TRUE(m.ok()) << m.status();
      if (m.ok()) *out = std::string(m->text());
      wg->Done();
    };
    for (int i = 0; i < kReceivers; ++i) {
      wg.Add();
      t->reactor_->Spawn(rcv(p->server.get(), &got[i], &wg));
      co_await t->reactor_->Yield();  // parked before the next one starts
    }
    for (int i = 0; i < kReceivers; ++i) {
      std::string m = "message " + std::to_string(i);
      CO_ASSERT_OK(co_await p->client->Send(m));
    }
    co_await wg.Wait();
    for (int i = 0; i < kReceivers; ++i) {
      EXPECT_EQ(got[i], "message " + std::to_string(i)) << "receiver " << i;
    }
    co_await Close(*p);
  }(this));
}

// Receivers waiting when the connection goes down all resume with the
// error: the peer closing (one close, several receivers), and the peer
// dying.
TEST_P(DirectTest, WaitingReceiversResumeWhenTheConnectionEnds) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    constexpr int kReceivers = 3;
    std::vector<absl::Status> server_got(kReceivers), client_got(kReceivers);
    WaitGroup wg;
    auto rcv = [](Connection* c, absl::Status* out,
                  WaitGroup* wg) -> Task<void> {
      auto m = co_await c->Recv();
      *out = m.status();
      wg->Done();
    };
    for (int i = 0; i < kReceivers; ++i) {
      wg.Add();
      t->reactor_->Spawn(rcv(p->server.get(), &server_got[i], &wg));
    }
    co_await t->reactor_->Sleep(absl::Milliseconds(20));
    co_await p->client->Close();  // the server's receivers see the close
    co_await wg.Wait();
    for (const absl::Status& s : server_got) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    }
    // A later Recv reports the close at once.
    auto again = co_await p->server->Recv();
    EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable)
        << again.status();
    co_await p->server->Close();

    // The peer dies while receivers wait.
    auto q = co_await t->MakePair();
    CO_ASSERT_OK(q);
    for (int i = 0; i < kReceivers; ++i) {
      wg.Add();
      t->reactor_->Spawn(rcv(q->client.get(), &client_got[i], &wg));
    }
    co_await t->reactor_->Sleep(absl::Milliseconds(20));
    q->server.reset();
    co_await wg.Wait();
    for (const absl::Status& s : client_got) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    }
    co_await q->client->Close();
  }(this));
}

// A waiting receiver whose stop token fires ends with Cancelled and takes
// nothing: the next message goes to the next Recv.
TEST_P(DirectTest, CancelledRecvTakesNothing) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    std::stop_source stop;
    absl::Status cancelled;
    WaitGroup wg;
    wg.Add();
    auto rcv = [](Connection* c, absl::Status* out,
                  WaitGroup* wg) -> Task<void> {
      auto m = co_await c->Recv();
      *out = m.status();
      wg->Done();
    };
    t->reactor_->Spawn(rcv(p->server.get(), &cancelled, &wg), stop.get_token());
    co_await t->reactor_->Sleep(absl::Milliseconds(20));
    stop.request_stop();
    co_await wg.Wait();
    EXPECT_EQ(cancelled.code(), absl::StatusCode::kCancelled) << cancelled;
    std::string text = "after the cancel";
    CO_ASSERT_OK(co_await p->client->Send(text));
    auto m = co_await p->server->Recv();
    CO_ASSERT_OK(m);
    EXPECT_EQ(m->text(), "after the cancel");
    co_await Close(*p);
  }(this));
}

INSTANTIATE_TEST_SUITE_P(Providers, DirectTest,
                         ::testing::ValuesIn(InProcessProviders()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
