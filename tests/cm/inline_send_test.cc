// Small messages sent inline (ConnectionImpl::TrySendInline): a Send whose
// frame fits the QP's inline limit completes at its post -- the bytes were
// copied into the work request -- while at most kMaxUnackedInline of them
// are unacknowledged. Order with other sends, Close delivering them, and the
// bound on a flood must hold on every provider; where the device's inline
// limit is too small for the frame, the ordinary path runs and the same
// checks still pass.
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "cm/connection.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/cm/test_util.h"

namespace coverbs::cm {
namespace {

using InlineSendTest = CmTest;
constexpr size_t kHeader = 16;        // cm's wire header
constexpr uint32_t kMaxUnacked = 16;  // ConnectionImpl::kMaxUnackedInline

// Sent one after another (each awaited), small messages never leave more
// than the bound unacknowledged, and they keep order with messages too
// big to go inline (one in eight) and with rendezvous ones.
TEST_P(InlineSendTest, SmallSendsKeepOrderAndTheBound) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    const uint32_t limit = p->client->qp().max_inline_data();
    constexpr int kMsgs = 200;
    std::vector<std::vector<std::byte>> msgs;
    for (int i = 0; i < kMsgs; ++i) {
      size_t n = i % 50 == 49 ? 30000 : i % 8 == 7 ? 1000 : 1 + i % 64;
      msgs.push_back(Pattern(n, static_cast<uint8_t>(i)));
    }
    uint32_t most_in_flight = 0;
    int posted_inline = 0;
    WaitGroup wg;
    wg.Add();
    t->reactor_->Spawn([](Connection* c,
                          const std::vector<std::vector<std::byte>>* m,
                          uint32_t* most, int* inl, uint32_t limit,
                          WaitGroup* wg) -> Task<void> {
      for (const auto& b : *m) {
        const uint32_t before = c->qp().inline_sends_in_flight();
        absl::Status s = co_await c->Send(b);
        EXPECT_TRUE(s.ok()) << s;
        const uint32_t after = c->qp().inline_sends_in_flight();
        *most = std::max(*most, after);
        if (after > before) ++*inl;
        if (kHeader + b.size() > limit) EXPECT_LE(after, before);
      }
      wg->Done();
    }(p->client.get(), &msgs, &most_in_flight, &posted_inline, limit, &wg));
    for (int i = 0; i < kMsgs; ++i) {
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), msgs[i])) << "message " << i;
    }
    co_await wg.Wait();
    EXPECT_LE(most_in_flight, kMaxUnacked);
    if (limit >= kHeader + 64) {
      EXPECT_GT(posted_inline, 0) << "max_inline_data " << limit;
    }
    co_await Close(*p);
  }(this));
}

// Many concurrent senders: beyond the bound a Send waits for its
// acknowledgement instead of completing at its post, so the in-flight
// count stays bounded and every message arrives once, in Send order.
TEST_P(InlineSendTest, AFloodIsPacedByAcknowledgements) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    constexpr int kMsgs = 300;
    std::vector<std::vector<std::byte>> msgs;
    for (int i = 0; i < kMsgs; ++i) {
      msgs.push_back(Pattern(8 + i % 32, static_cast<uint8_t>(i)));
    }
    uint32_t most = 0;
    WaitGroup wg;
    for (int i = 0; i < kMsgs; ++i) {
      wg.Add();
      t->reactor_->Spawn([](Connection* c, std::span<const std::byte> d,
                            uint32_t* most, WaitGroup* wg) -> Task<void> {
        absl::Status s = co_await c->Send(d);
        EXPECT_TRUE(s.ok()) << s;
        *most = std::max(*most, c->qp().inline_sends_in_flight());
        wg->Done();
      }(p->client.get(), msgs[i], &most, &wg));
    }
    for (int i = 0; i < kMsgs; ++i) {
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), msgs[i])) << "message " << i;
    }
    co_await wg.Wait();
    EXPECT_LE(most, kMaxUnacked);
    co_await Close(*p);
  }(this));
}

// Small sends completed at their post, then Close at once -- also from a
// cancelled caller: the peer gets every message, then the end.
TEST_P(InlineSendTest, CloseDeliversWhatWasSentBeforeIt) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    constexpr int kMsgs = 12;
    std::vector<std::vector<std::byte>> msgs;
    for (int i = 0; i < kMsgs; ++i) {
      msgs.push_back(Pattern(32, static_cast<uint8_t>(i)));
      CO_ASSERT_OK(co_await p->client->Send(msgs.back()));
    }
    std::stop_source stop;
    stop.request_stop();
    Task<absl::Status> close = p->client->Close();
    close.SetStopToken(stop.get_token());
    (void)co_await close;  // OK, or what the cancelled goodbye reported
    EXPECT_EQ(p->client->qp().inline_sends_in_flight(), 0u);
    for (int i = 0; i < kMsgs; ++i) {
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), msgs[i])) << "message " << i;
    }
    auto end = co_await p->server->Recv();
    EXPECT_FALSE(end.ok());
    co_await p->server->Close();
  }(this));
}

// After the connection is down, a small Send fails at once (nothing
// posted) with the reason.
TEST_P(InlineSendTest, ASmallSendAfterTheEndFailsAtOnce) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    co_await Close(*p);
    auto b = Pattern(16, 3);
    absl::Status s = co_await p->client->Send(b);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_EQ(p->client->qp().inline_sends_in_flight(), 0u);
  }(this));
}

INSTANTIATE_TEST_SUITE_P(Providers, InlineSendTest,
                         ::testing::ValuesIn(InProcessProviders()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
