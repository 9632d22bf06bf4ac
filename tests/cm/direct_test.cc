// Connection::SendVDirect and Connection::TryRecv: the frameless send and
// receive steps the rpc layer uses per message. Each must keep Send's and
// Recv's contract: order with the other sends, the slow path when no
// credit is free, errors once the connection is down.
#include <cstdint>
#include <optional>
#include <span>
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
    ConnectOptions co;
    co.connection.recv_credits = 4;
    ListenerOptions lo;
    lo.connection.recv_credits = 4;
    auto p = co_await t->MakePair(co, lo);
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

INSTANTIATE_TEST_SUITE_P(Providers, DirectTest,
                         ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
