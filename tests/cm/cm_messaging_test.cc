// The connection layer's messaging on every available provider (the
// CmTest suite; cm_test.cc has establishment and instantiates it):
// message sizes, credits, the rendezvous, ordering, closing with
// operations in flight, one-sided access through exposures, and
// cancellation.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cm/connect.h"
#include "cm/connect_for_test.h"
#include "cm/connection.h"
#include "cm/handshake.h"
#include "cm/listener.h"
#include "cm/worker.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/cm/test_util.h"
#include "transport/device.h"
#include "transport/errors.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::cm {
namespace {

// --- Messaging.

TEST_P(CmTest, MessageSizesWithVerification) {
  Run(
      [](CmTest* t) -> Task<void> {
        auto p = co_await t->MakePair();
        CO_ASSERT_OK(p);
        size_t thr = ConnectionOptions().rendezvous_threshold;
        std::vector<size_t> sizes = {1,       4096,     thr - 1,  thr,
                                     thr + 1, 1u << 20, 64u << 20};
        uint8_t seed = 0;
        for (size_t n : sizes) {
          auto data = Pattern(n, ++seed);
          // client -> server, then the server echoes it back.
          CO_ASSERT_OK(co_await p->client->Send(data));
          auto m = co_await p->server->Recv();
          CO_ASSERT_OK(m);
          EXPECT_EQ(m->size(), n);
          EXPECT_TRUE(Same(m->data(), data)) << "size " << n;
          CO_ASSERT_OK(co_await p->server->Send(m->data()));
          auto back = co_await p->client->Recv();
          CO_ASSERT_OK(back);
          EXPECT_TRUE(Same(back->data(), data)) << "echo of size " << n;
        }
        auto st = p->client->stats();
        EXPECT_EQ(st.rendezvous_sent, 3u);  // thr+1, 1 MiB, 64 MiB
        CO_ASSERT_OK(co_await p->client->Close());
        co_await p->server->Close();
      }(this),
      absl::Seconds(300));
}

TEST_P(CmTest, OversizedMessageFailsBeforeSending) {
  Run([](CmTest* t) -> Task<void> {
    ConnectOptions co;
    co.connection.max_message_size = 1 << 20;
    auto p = co_await t->MakePair(co);
    CO_ASSERT_OK(p);
    std::vector<std::byte> big((1 << 20) + 1);
    auto s = co_await p->client->Send(big);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(p->client->stats().messages_sent, 0u);
    // The connection is unaffected.
    auto ok = Pattern(1 << 20, 3);
    CO_ASSERT_OK(co_await p->client->Send(ok));
    auto m = co_await p->server->Recv();
    CO_ASSERT_OK(m);
    EXPECT_TRUE(Same(m->data(), ok));
    co_await p->client->Close();
    co_await p->server->Close();
  }(this));
}

TEST_P(CmTest, OrderingAcrossSmallAndLarge) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    constexpr int kMsgs = 60;
    std::vector<std::vector<std::byte>> msgs;
    for (int i = 0; i < kMsgs; ++i) {
      size_t n = (i % 3 == 0) ? 100000 + i : (i % 3 == 1 ? 10 + i : 8192);
      auto v = Pattern(n, static_cast<uint8_t>(i));
      v[0] = static_cast<std::byte>(i);
      msgs.push_back(std::move(v));
    }
    WaitGroup wg;
    for (int i = 0; i < kMsgs; ++i) {
      wg.Add();
      auto one = [](Connection* c, std::span<const std::byte> d,
                    WaitGroup* wg) -> Task<void> {
        auto s = co_await c->Send(d);
        EXPECT_TRUE(s.ok()) << s;
        wg->Done();
      };
      t->reactor_->Spawn(one(p->client.get(), msgs[i], &wg));
    }
    for (int i = 0; i < kMsgs; ++i) {
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), msgs[i])) << "message " << i;
    }
    co_await wg.Wait();
    co_await p->client->Close();
    co_await p->server->Close();
  }(this));
}

TEST_P(CmTest, SenderFarAheadOfSlowReceiverNeverCausesRnr) {
  Run(
      [](CmTest* t) -> Task<void> {
        ConnectionOptions o;
        o.recv_credits = 16;
        o.qp.rnr_retry = 0;  // any RNR fails the connection
        auto p = co_await t->MakePairWith(o);
        CO_ASSERT_OK(p);
        int failures = 0;
        co_await t->SendAhead(p->client.get(), p->server.get(), 1000, 50, 5,
                              &failures);
        EXPECT_EQ(failures, 0);
        EXPECT_GT(p->client->stats().credit_waits, 0u);
        EXPECT_GT(p->server->stats().credit_messages_sent, 0u);
        EXPECT_TRUE(p->client->status().ok()) << p->client->status();
        co_await p->client->Close();
        co_await p->server->Close();
      }(this),
      absl::Seconds(120));
}

TEST_P(CmTest, CloseWithOperationsInFlight) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    WaitGroup wg;
    int done = 0;
    auto big = Pattern(4 << 20, 1);
    for (int i = 0; i < 40; ++i) {
      wg.Add();
      auto one = [](Connection* c, std::span<const std::byte> d, WaitGroup* wg,
                    int* done) -> Task<void> {
        co_await c->Send(d);  // OK or an error: it must resume either way
        ++*done;
        wg->Done();
      };
      t->reactor_->Spawn(one(p->client.get(),
                             i % 4 == 0
                                 ? std::span<const std::byte>(big)
                                 : std::span<const std::byte>(big).first(64),
                             &wg, &done));
    }
    wg.Add();
    auto rcv = [](Connection* c, WaitGroup* wg, int* done) -> Task<void> {
      auto m = co_await c->Recv();  // nothing is ever sent to the client
      EXPECT_FALSE(m.ok());
      ++*done;
      wg->Done();
    };
    t->reactor_->Spawn(rcv(p->client.get(), &wg, &done));
    co_await t->reactor_->Yield();
    co_await p->client->Close();
    co_await wg.Wait();
    EXPECT_EQ(done, 41);
    auto s = co_await p->client->Send(big);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    co_await p->server->Close();
  }(this));
}

TEST_P(CmTest, PeerQpErrorFailsEveryWaiter) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    WaitGroup wg;
    absl::Status recv_status, send_status;
    wg.Add(2);
    auto rcv = [](Connection* c, WaitGroup* wg,
                  absl::Status* out) -> Task<void> {
      auto m = co_await c->Recv();
      *out = m.status();
      wg->Done();
    };
    auto snd = [](Connection* c, WaitGroup* wg,
                  absl::Status* out) -> Task<void> {
      std::vector<std::byte> big(8 << 20);
      *out = co_await c->Send(big);  // a rendezvous the peer never finishes
      wg->Done();
    };
    t->reactor_->Spawn(rcv(p->client.get(), &wg, &recv_status));
    co_await t->reactor_->Sleep(absl::Milliseconds(20));
    // The server dies abruptly (its QP goes to error, its link drops).
    p->server.reset();
    t->reactor_->Spawn(snd(p->client.get(), &wg, &send_status));
    co_await wg.Wait();
    EXPECT_EQ(recv_status.code(), absl::StatusCode::kUnavailable)
        << recv_status;
    EXPECT_FALSE(send_status.ok());
    EXPECT_FALSE(p->client->status().ok());
    co_await p->client->Close();
  }(this));
}

TEST_P(CmTest, MalformedHeaderFailsOnlyThatConnection) {
  Run([](CmTest* t) -> Task<void> {
    auto bad = co_await t->MakePair();
    CO_ASSERT_OK(bad);
    auto good = co_await t->MakePair();
    CO_ASSERT_OK(good);
    // A raw SEND of garbage straight on the QP, bypassing the framing.
    std::vector<std::byte> junk = Pattern(64, 0xee);
    junk[0] = std::byte{0x7f};  // no such message type
    CO_ASSERT_OK(co_await SendRaw(*bad->client, junk));
    auto m = co_await bad->server->Recv();
    EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
    EXPECT_NE(std::string(m.status().message()).find("protocol violation"),
              std::string::npos);
    // The other connection is untouched.
    auto msg = Pattern(3000, 4);
    CO_ASSERT_OK(co_await good->client->Send(msg));
    auto g = co_await good->server->Recv();
    CO_ASSERT_OK(g);
    EXPECT_TRUE(Same(g->data(), msg));
    co_await bad->client->Close();
    co_await bad->server->Close();
    co_await good->client->Close();
    co_await good->server->Close();
  }(this));
}

TEST_P(CmTest, ExposedRegionReadWriteAtomicsRevoke) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    // The server exposes 64 KiB; the token travels in a message.
    std::vector<std::byte> region = Pattern(65536, 7);
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                 IBV_ACCESS_REMOTE_WRITE |
                 (t->device_->caps().atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0);
    auto mr =
        t->server_ctx_->pd().Register(region.data(), region.size(), access);
    CO_ASSERT_OK(mr);
    auto bad = p->server->Expose(*mr, IBV_ACCESS_REMOTE_ATOMIC | 0x100000);
    EXPECT_FALSE(bad.ok());
    // Scoped to the connection where the device has memory windows; siw
    // has none and says so, so there the PD-wide key is asked for.
    const bool windows = t->device_->caps().memory_windows;
    const cm::ExposeScope scope = windows ? cm::ExposeScope::kConnection
                                          : cm::ExposeScope::kProtectionDomain;
    if (!windows) {
      auto no = p->server->Expose(*mr);
      EXPECT_EQ(no.status().code(), absl::StatusCode::kFailedPrecondition)
          << no.status();
    }
    auto tok = p->server->Expose(
        *mr,
        IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
            (t->device_->caps().atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0),
        0, transport::MemoryRegion::npos, scope);
    CO_ASSERT_OK(tok);
    // Expose(mr): the whole region with its own access; a window of its
    // own (another rkey) where there are windows.
    if (windows) {
      auto whole = p->server->Expose(*mr);
      CO_ASSERT_OK(whole);
      EXPECT_NE(whole->rkey, tok->rkey);
      EXPECT_EQ(whole->addr, tok->addr);
      EXPECT_EQ(whole->length, region.size());
      CO_ASSERT_OK(p->server->Revoke(*whole));
      EXPECT_EQ(p->server->Revoke(*whole).code(), absl::StatusCode::kNotFound);
    }
    // A region with no remote access cannot be exposed.
    std::vector<std::byte> private_bytes(64);
    auto local_only = t->server_ctx_->pd().Register(
        private_bytes.data(), private_bytes.size(), IBV_ACCESS_LOCAL_WRITE);
    CO_ASSERT_OK(local_only);
    auto refused_expose = p->server->Expose(*local_only);
    EXPECT_EQ(refused_expose.status().code(),
              absl::StatusCode::kInvalidArgument)
        << refused_expose.status();
    // iWARP: the active side (client) speaks first, so it asks for it.
    CO_ASSERT_OK(co_await p->client->Send(Pattern(4, 1)));
    auto ask = co_await p->server->Recv();
    CO_ASSERT_OK(ask);
    auto enc = tok->Encode();
    CO_ASSERT_OK(co_await p->server->Send(enc));
    auto m = co_await p->client->Recv();
    CO_ASSERT_OK(m);
    auto remote = transport::RemoteRegion::Decode(m->data());
    CO_ASSERT_OK(remote);
    std::vector<std::byte> local(65536);
    auto lmr = t->client_ctx_->pd().Register(local.data(), local.size(),
                                             IBV_ACCESS_LOCAL_WRITE);
    CO_ASSERT_OK(lmr);
    CO_ASSERT_OK(co_await p->client->Read(lmr->Local(), (*remote)));
    EXPECT_TRUE(Same(local, region));
    auto fresh = Pattern(4096, 99);
    std::memcpy(local.data(), fresh.data(), fresh.size());
    CO_ASSERT_OK(co_await p->client->Write(lmr->Local(0, 4096),
                                           (*remote).Slice(8192, 4096)));
    // A WRITE completes once placed on IB/RoCE but once handed to TCP on
    // iWARP (siw: the region was seen unchanged right after it). A READ
    // behind it on the same connection is served after the WRITE is placed.
    CO_ASSERT_OK(co_await p->client->Read(lmr->Local(4096, 4096),
                                          (*remote).Slice(8192, 4096)));
    EXPECT_TRUE(Same(std::span(local).subspan(4096, 4096), fresh));
    EXPECT_TRUE(Same(std::span(region).subspan(8192, 4096), fresh));
    // The same on plain memory (registered through the Worker's cache).
    std::vector<std::byte> plain(4096);
    CO_ASSERT_OK(co_await p->client->Read(std::span(plain),
                                          (*remote).Slice(8192, 4096)));
    EXPECT_TRUE(Same(plain, fresh));
    const auto plain_src = Pattern(2048, 55);
    CO_ASSERT_OK(co_await p->client->Write(std::span(plain_src),
                                           (*remote).Slice(16384, 2048)));
    std::vector<std::byte> back(2048);
    CO_ASSERT_OK(co_await p->client->Read(std::span(back),
                                          (*remote).Slice(16384, 2048)));
    EXPECT_TRUE(Same(back, plain_src));
    EXPECT_TRUE(Same(std::span(region).subspan(16384, 2048), plain_src));
    // Nothing to read into: refused before anything is posted.
    std::span<std::byte> none;
    auto empty = co_await p->client->Read(none, (*remote).Slice(0, 8));
    EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
    if (t->device_->caps().atomics) {
      uint64_t before;
      std::memcpy(&before, region.data(), 8);
      auto v = co_await p->client->FetchAdd((*remote).Slice(0, 8), 5);
      CO_ASSERT_OK(v);
      EXPECT_EQ(*v, before);
      uint64_t after;
      std::memcpy(&after, region.data(), 8);
      EXPECT_EQ(after, before + 5);
      auto c =
          co_await p->client->CompareSwap((*remote).Slice(0, 8), after, 42);
      CO_ASSERT_OK(c);
      std::memcpy(&after, region.data(), 8);
      EXPECT_EQ(after, 42u);
    } else {
      auto v = co_await p->client->FetchAdd((*remote).Slice(0, 8), 5);
      EXPECT_EQ(v.status().code(), absl::StatusCode::kFailedPrecondition);
    }
    // Revoke: every later access fails and changes no byte on either side.
    // Each operation runs on a connection of its own: the first failure
    // puts its connection in error, which would fail anything after it.
    std::vector<std::byte> snapshot = region;
    if (windows) CO_ASSERT_OK(p->server->Revoke(*tok));
    mr->Deregister();
    std::memset(local.data(), 0x5a, local.size());
    const std::vector<std::byte> local_before = local;
    // The operation's own failure: REM_ACCESS_ERR (PERMISSION_DENIED), or the
    // connection's loss (UNAVAILABLE), which cm reports instead when it has
    // already seen the receives that the failed QP flushed.
    auto refused = [](const absl::Status& s, const char* op) {
      return !s.ok() && absl::StrContains(s.message(), op) &&
             (s.code() == absl::StatusCode::kPermissionDenied ||
              s.code() == absl::StatusCode::kUnavailable);
    };
    auto w = co_await p->client->Write(lmr->Local(0, 4096),
                                       (*remote).Slice(0, 4096));
    // iWARP completes a WRITE once TCP has it; the responder refuses it and
    // ends the connection (conformance_test.cc: ExpectRemoteError).
    if (!t->iwarp() || !w.ok()) {
      EXPECT_TRUE(refused(w, "RDMA WRITE on ")) << "after revocation: " << w;
    }
    auto q = co_await t->MakePair();
    CO_ASSERT_OK(q);
    auto r =
        co_await q->client->Read(lmr->Local(0, 4096), (*remote).Slice(0, 4096));
    EXPECT_TRUE(refused(r, "RDMA READ on ")) << "after revocation: " << r;
    if (t->device_->caps().atomics) {
      auto a = co_await t->MakePair();
      CO_ASSERT_OK(a);
      auto v = co_await a->client->FetchAdd((*remote).Slice(0, 8), 5);
      EXPECT_TRUE(refused(v.status(), "FETCH_ADD on "))
          << "after revocation: " << v.status();
      co_await a->client->Close();
      co_await a->server->Close();
    }
    EXPECT_TRUE(Same(region, snapshot)) << "revoked region was modified";
    EXPECT_TRUE(Same(local, local_before)) << "a refused READ placed data";
    co_await q->client->Close();
    co_await q->server->Close();
    co_await p->client->Close();
    co_await p->server->Close();
  }(this));
}

// Close from a task whose stop token is already stopped (a cancelled
// caller cleaning up) still drains and closes: the flush wait is not
// cancellable (it once spun the CPU until close_timeout here).
TEST_P(CmTest, CloseUnderAStoppedTokenStillClosesCleanly) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    auto hi = Pattern(64, 1);
    CO_ASSERT_OK(co_await p->client->Send(hi));
    std::stop_source stop;
    stop.request_stop();
    Task<absl::Status> close = p->client->Close();
    close.SetStopToken(stop.get_token());
    absl::Status s = co_await close;
    (void)s;  // OK, or what the cancelled goodbye reported
    EXPECT_FALSE(p->client->status().ok());
    EXPECT_EQ(p->client->qp().outstanding(), 0u);
    auto m = co_await p->server->Recv();
    CO_ASSERT_OK(m);
    EXPECT_TRUE(Same(m->data(), hi));
    auto end = co_await p->server->Recv();
    EXPECT_FALSE(end.ok());
    co_await p->server->Close();
  }(this));
}

// A Send cancelled once its message is posted still completes (the NIC
// cannot take the work request back): it does not move the QP to the
// error state, which would fail the connection for every other caller.
TEST_P(CmTest, CancellingAPostedSendKeepsTheConnection) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    auto first = Pattern(64, 3);
    std::stop_source stop;
    absl::Status sent = absl::UnknownError("not run");
    Event done;
    auto send = [](Connection* c, std::span<const std::byte> b,
                   absl::Status* out, Event* done) -> Task<void> {
      *out = co_await c->Send(b);
      done->Set();
    };
    t->reactor_->Spawn(send(p->client.get(), first, &sent, &done),
                       stop.get_token());
    // The send runs first: it takes its turn, credit and buffer and posts,
    // then waits for its completion; the stop comes while it waits.
    co_await t->reactor_->Yield();
    stop.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_TRUE(sent.ok()) << sent;
    EXPECT_TRUE(p->client->status().ok()) << p->client->status();
    auto second = Pattern(64, 4);
    CO_ASSERT_OK(co_await p->client->Send(second));
    auto m1 = co_await p->server->Recv();
    CO_ASSERT_OK(m1);
    EXPECT_TRUE(Same(m1->data(), first));
    auto m2 = co_await p->server->Recv();
    CO_ASSERT_OK(m2);
    EXPECT_TRUE(Same(m2->data(), second));
    co_await Close(*p);
  }(this));
}

// The same for one-sided operations: a READ, WRITE or atomic cancelled
// once posted runs to its completion and reports it; the connection stays
// up for every other caller.
TEST_P(CmTest, CancellingPostedOneSidedOpsKeepsTheConnection) {
  Run([](CmTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    std::vector<std::byte> region = Pattern(65536, 5);
    const bool atomics = t->device_->caps().atomics;
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                 IBV_ACCESS_REMOTE_WRITE |
                 (atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0);
    auto mr =
        t->server_ctx_->pd().Register(region.data(), region.size(), access);
    CO_ASSERT_OK(mr);
    const cm::ExposeScope scope = t->device_->caps().memory_windows
                                      ? cm::ExposeScope::kConnection
                                      : cm::ExposeScope::kProtectionDomain;
    auto tok = p->server->Expose(*mr, access & ~IBV_ACCESS_LOCAL_WRITE, 0,
                                 transport::MemoryRegion::npos, scope);
    CO_ASSERT_OK(tok);
    std::vector<std::byte> local(65536);
    // 0: Read, 1: Write, 2: FetchAdd (on the region's first 8 bytes).
    auto op = [](Connection* c, int kind, std::span<std::byte> buf,
                 transport::RemoteRegion r, absl::Status* out,
                 Event* done) -> Task<void> {
      if (kind == 0) {
        *out = co_await c->Read(buf, r);
      } else if (kind == 1) {
        *out = co_await c->Write(std::span<const std::byte>(buf), r);
      } else {
        auto v = co_await c->FetchAdd(r.Slice(0, 8), 1);
        *out = v.status();
      }
      done->Set();
    };
    for (int kind = 0; kind < (atomics ? 3 : 2); ++kind) {
      std::stop_source stop;
      absl::Status result = absl::UnknownError("not run");
      Event done;
      t->reactor_->Spawn(op(p->client.get(), kind, std::span(local), *tok,
                            &result, &done),
                         stop.get_token());
      co_await t->reactor_->Yield();
      stop.request_stop();
      CO_ASSERT_OK(co_await done.Wait());
      EXPECT_TRUE(result.ok() || absl::IsCancelled(result))
          << kind << ": " << result;
      EXPECT_TRUE(p->client->status().ok())
          << kind << ": " << p->client->status();
      if (kind == 0 && result.ok()) EXPECT_TRUE(Same(local, region));
      // Messages still go both ways.
      CO_ASSERT_OK(co_await p->client->Send(Pattern(64, 1)));
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      CO_ASSERT_OK(co_await p->server->Send(Pattern(64, 2)));
      auto back = co_await p->client->Recv();
      CO_ASSERT_OK(back);
    }
    co_await Close(*p);
  }(this));
}

}  // namespace
}  // namespace coverbs::cm
