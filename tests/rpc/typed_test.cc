// Typed methods, the handler's context, admission and app_data, and the
// thread-safety of registration, end to end on every available provider
// (soft on the host; the fixture's server runs on a 2-reactor pool).
#include "rpc/typed.h"

#include <thread>

#include "tests/rpc/rpc_fixture.h"
#include "tests/rpc/typed_test.pb.h"

namespace coverbs::rpc {
namespace {

using namespace rpc_test_util;  // NOLINT: the fixture and its helpers

struct Pod {
  uint64_t a = 0;
  uint64_t b = 0;
};

struct Entry {
  std::string key;
  std::vector<std::string> values;
  MSGPACK_DEFINE(key, values);
};

inline constexpr Method<Entry, Entry> kReverse{"Reverse"};

// A type with a codec of its own (below) that notes the thread it decoded
// on and the decode bound it was given.
struct Noted {
  std::string bytes;
  std::thread::id decoded_on;
  uint32_t factor = 0;
};

}  // namespace

template <>
struct Codec<Noted> {
  static absl::StatusOr<Noted> Decode(std::span<const std::byte> b) {
    return Decode(b, DecodeOptions());
  }
  static absl::StatusOr<Noted> Decode(std::span<const std::byte> b,
                                      const DecodeOptions& o) {
    return Noted{std::string(reinterpret_cast<const char*>(b.data()), b.size()),
                 std::this_thread::get_id(), o.memory_factor};
  }
  static void Encode(const Noted& v, std::string& out) { out.append(v.bytes); }
};

namespace {

// Where and with which bound the argument decoded: "inline 8 100".
Task<absl::StatusOr<std::string>> WhereDecoded(Noted n) {
  co_return absl::StrCat(
      n.decoded_on == std::this_thread::get_id() ? "inline" : "offloaded", " ",
      n.factor, " ", n.bytes.size());
}

// A msgpack array32 of n copies of `elem`.
std::string ArrayOf(size_t n, const std::string& elem) {
  std::string s = "\xdd";
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>(n >> (8 * i)));
  for (size_t i = 0; i < n; ++i) s += elem;
  return s;
}
inline constexpr Method<std::string, std::string> kWho{"Who"};

Task<absl::StatusOr<Pod>> SwapPod(Pod p) { co_return Pod{p.b, p.a}; }

class TypedTest : public RpcTest {
 public:
  // Registers the typed methods of these tests and starts the server.
  void StartTyped(ServerOptions o = {}) {
    server_ = std::make_unique<Server>(std::move(o));
    Server& s = *server_;
    ASSERT_TRUE(s.Register("Swap", &SwapPod).ok());
    ASSERT_TRUE(s.Register("Upper",
                           [](Context&, std::string_view in)
                               -> Task<absl::StatusOr<std::string>> {
                             std::string out(in);
                             for (char& ch : out) ch = std::toupper(ch);
                             co_return out;
                           })
                    .ok());
    ASSERT_TRUE(
        s.Register(kReverse, [](Entry e) -> Task<absl::StatusOr<Entry>> {
           std::reverse(e.values.begin(), e.values.end());
           co_return e;
         }).ok());
    ASSERT_TRUE(
        s.Register("Put",
                   [](const Context&,
                      test::KvPut p) -> Task<absl::StatusOr<test::KvReply>> {
                     if (p.key().empty()) {
                       co_return absl::InvalidArgumentError("empty key");
                     }
                     test::KvReply r;
                     r.set_ok(true);
                     r.set_version(p.tags_size());
                     co_return r;
                   })
            .ok());
    ASSERT_TRUE(s.Register("Where", &WhereDecoded).ok());
    DecodeOptions own;
    own.memory_factor = 3;
    own.offload_above = 0;  // every argument off the reactor
    ASSERT_TRUE(s.Register("WhereOwn", &WhereDecoded, own).ok());
    // The caller's identity as the handler sees it.
    ASSERT_TRUE(
        s.Register(kWho,
                   [](Context& ctx,
                      std::string) -> Task<absl::StatusOr<std::string>> {
                     co_return absl::StrCat(ctx.app_data(), "@",
                                            ctx.peer_address(), " ",
                                            std::string(ctx.method), " on ",
                                            ctx.connection().name());
                   })
            .ok());
    // A region exposed to this caller, alive until its connection closes.
    ASSERT_TRUE(
        s.Register("Snapshot",
                   [](Context& ctx, std::string text)
                       -> Task<absl::StatusOr<transport::RemoteRegion>> {
                     // Both forms: a shared owner, and a value kept in
                     // place. Released newest first: region, then bytes.
                     auto buf = std::make_shared<std::string>(std::move(text));
                     ctx.KeepUntilClose(buf);
                     auto mr = ctx.connection().worker().pd().Register(
                         AsWritable(*buf), transport::Access::kRemoteRead);
                     if (!mr.ok()) co_return mr.status();
                     transport::MemoryRegion& kept =
                         ctx.KeepUntilClose(*std::move(mr));
                     co_return ctx.Expose(kept);
                   })
            .ok());
    // Waits for its caller to give up, and says whether it saw the stop.
    Observed* obs = &obs_;
    ASSERT_TRUE(
        s.Register("Wait",
                   [obs](Context& ctx, Pod) -> Task<absl::StatusOr<Pod>> {
                     obs->slow_started.fetch_add(1);
                     (void)co_await Reactor::Current()->Sleep(
                         absl::Seconds(30));
                     if (ctx.cancelled() && ctx.stop_token().stop_requested()) {
                       obs->slow_cancelled.fetch_add(1);
                     }
                     co_return Pod{};
                   })
            .ok());
    std::vector<cm::Worker*> ctxs;
    for (auto& c : server_ctxs_) ctxs.push_back(c.get());
    absl::Status st = server_->Start(ctxs, addr_, 0);
    ASSERT_TRUE(st.ok()) << st;
  }

  static std::span<std::byte> AsWritable(std::string& s) {
    return std::as_writable_bytes(std::span(s));
  }

  Task<absl::StatusOr<Client*>> NewClientWith(std::string app_data) {
    ClientOptions o;
    o.connect.app_data = std::move(app_data);
    auto c = co_await Client::Connect(*client_ctx_, addr_, server_->port(), o);
    if (!c.ok()) co_return c.status();
    clients_.push_back(*std::move(c));
    co_return clients_.back().get();
  }
};

TEST_P(TypedTest, EveryCodecKindRoundTrips) {
  StartTyped();
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client& client = **c;
    auto swapped = co_await client.Call<Pod>("Swap", Pod{1, 2});
    CO_ASSERT_OK(swapped);
    EXPECT_EQ(swapped->a, 2u);
    EXPECT_EQ(swapped->b, 1u);
    auto upper = co_await client.Call<std::string>("Upper", std::string("abc"));
    CO_ASSERT_OK(upper);
    EXPECT_EQ(*upper, "ABC");
    // A payload above the eager limit goes by RDMA WRITE, typed all the same.
    std::string big(Threshold() * 3, 'q');
    auto big_upper = co_await client.Call<std::string>("Upper", big);
    CO_ASSERT_OK(big_upper);
    EXPECT_EQ(*big_upper, std::string(big.size(), 'Q'));
    // (A local: gcc 12 miscompiles initializer lists inside co_await.)
    Entry entry;
    entry.key = "k";
    entry.values = {"a", "b", "c"};
    auto rev = co_await client.Call(kReverse, entry);
    CO_ASSERT_OK(rev);
    EXPECT_EQ(rev->key, "k");
    EXPECT_EQ(rev->values, (std::vector<std::string>{"c", "b", "a"}));
    test::KvPut put;
    put.set_key("k");
    put.add_tags(1);
    put.add_tags(2);
    auto reply = co_await client.Call<test::KvReply>("Put", put);
    CO_ASSERT_OK(reply);
    EXPECT_TRUE(reply->ok());
    EXPECT_EQ(reply->version(), 2u);
    CO_ASSERT_OK(co_await client.Close());
  }(this));
}

TEST_P(TypedTest, ErrorsTravelAsStatus) {
  StartTyped();
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client& client = **c;
    // The handler's own error.
    auto empty = co_await client.Call<test::KvReply>("Put", test::KvPut());
    EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(empty.status().message().find("empty key"), std::string::npos)
        << empty.status();
    // A request that does not decode: the handler does not run.
    const std::string three = "three";
    auto bad = co_await client.Call("Swap", std::as_bytes(std::span(three)));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("method Swap"), std::string::npos)
        << bad.status();
    // A response that does not decode as what the caller expects.
    auto wrong = co_await client.Call<Pod>("Upper", std::string("abc"));
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInternal);
    EXPECT_NE(wrong.status().message().find("method Upper"), std::string::npos)
        << wrong.status();
    auto missing = co_await client.Call<Pod>("Nope", Pod{});
    EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
    // The connection is still fine.
    auto ok = co_await client.Call<Pod>("Swap", Pod{3, 4});
    CO_ASSERT_OK(ok);
    CO_ASSERT_OK(co_await client.Close());
  }(this));
}

// Issue 36, point 2: an argument whose decode would take more memory than
// the bound is refused with RESOURCE_EXHAUSTED naming the method and the
// bound, a struct must come with its arity, and large arguments decode off
// the reactor; the server's ServerOptions::decode and a method's own
// options.
TEST_P(TypedTest, DecodeIsBoundedAndLargeOnesRunOffTheReactor) {
  StartTyped();
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client& client = **c;
    // ["k", [1M empty strings]]: 32 MiB of std::string for 1 MiB.
    const std::string empties = "\x92\xa1k" + ArrayOf(1 << 20, "\xa0");
    auto big = co_await client.Call("Reverse", std::as_bytes(std::span(empties)));
    EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted)
        << big.status();
    EXPECT_NE(big.status().message().find("method Reverse"), std::string::npos)
        << big.status();
    EXPECT_NE(big.status().message().find("8x the payload + 65536 bytes"),
              std::string::npos)
        << big.status();
    // Arity: [] and ["k", [], extra] are not an Entry.
    for (const std::string& bad :
         {std::string("\x90"), std::string("\x93\xa1k\x90\xc0")}) {
      auto r = co_await client.Call("Reverse", std::as_bytes(std::span(bad)));
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
          << r.status();
      EXPECT_NE(r.status().message().find("a struct of 2 element(s)"),
                std::string::npos)
          << r.status();
    }
    // A large legitimate argument decodes (off the reactor) and is served.
    Entry entry;
    entry.key = "k";
    for (int i = 0; i < 50000; ++i) entry.values.push_back(absl::StrCat("v", i));
    auto rev = co_await client.Call(kReverse, entry);
    CO_ASSERT_OK(rev);
    EXPECT_EQ(rev->values.front(), "v49999");
    // Where the argument decoded, and with which bound.
    const std::string small(100, 's'), large(200 << 10, 'l');
    auto a = co_await client.Call<std::string>("Where", small);
    CO_ASSERT_OK(a);
    EXPECT_EQ(*a, "inline 8 100");
    auto b = co_await client.Call<std::string>("Where", large);
    CO_ASSERT_OK(b);
    EXPECT_EQ(*b, absl::StrCat("offloaded 8 ", large.size()));
    auto own = co_await client.Call<std::string>("WhereOwn", small);
    CO_ASSERT_OK(own);
    EXPECT_EQ(*own, "offloaded 3 100");
    CO_ASSERT_OK(co_await client.Close());
  }(this));
  EXPECT_EQ(server_->stats().reactor_stalls, 0u);
}

TEST_P(TypedTest, ServerDecodeOptionsApplyToMethodsWithoutTheirOwn) {
  ServerOptions o;
  o.decode.memory_factor = 40;
  StartTyped(std::move(o));
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client& client = **c;
    const std::string empties = "\x92\xa1k" + ArrayOf(1 << 20, "\xa0");
    auto r = co_await client.Call("Reverse", std::as_bytes(std::span(empties)));
    CO_ASSERT_OK(r);
    // The client's default bound refuses this response (FromResponse); it
    // decodes with a bound of its own.
    EXPECT_EQ(internal::FromResponse<Entry>("Reverse", Payload::Copy(r->data()))
                  .status()
                  .code(),
              absl::StatusCode::kInternal);
    DecodeOptions roomy;
    roomy.memory_factor = 40;
    auto entry = Codec<Entry>::Decode(r->data(), roomy);
    CO_ASSERT_OK(entry);
    EXPECT_EQ(entry->values.size(), 1u << 20);
    auto a = co_await client.Call<std::string>("Where", std::string("x"));
    CO_ASSERT_OK(a);
    EXPECT_EQ(*a, "inline 40 1");
    auto own = co_await client.Call<std::string>("WhereOwn", std::string("x"));
    CO_ASSERT_OK(own);
    EXPECT_EQ(*own, "offloaded 3 1");
    CO_ASSERT_OK(co_await client.Close());
  }(this));
}

TEST_P(TypedTest, HandlerSeesItsCallersIdentity) {
  StartTyped();
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClientWith("tenant-a");
    CO_ASSERT_OK(c);
    auto who = co_await (*c)->Call(kWho, std::string());
    CO_ASSERT_OK(who);
    EXPECT_EQ(who->rfind(absl::StrCat("tenant-a@", t->addr_, " Who on "), 0),
              0u)
        << *who;
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

// The handler registers memory in its connection's PD and exposes it to
// its caller, who reads it by RDMA READ after the call; the region lives
// until that connection closes.
TEST_P(TypedTest, HandlerExposesARegionToItsCaller) {
  StartTyped();
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    std::string text = "bytes only this caller reads";
    auto token = co_await (*c)->Call<transport::RemoteRegion>("Snapshot", text);
    CO_ASSERT_OK(token);
    EXPECT_EQ(token->length, text.size());
    std::string copy(token->length, '\0');
    CO_ASSERT_OK(co_await (*c)->connection().Read(
        std::as_writable_bytes(std::span(copy)), *token));
    EXPECT_EQ(copy, text);
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

TEST_P(TypedTest, CancelledCallStopsTheHandlersToken) {
  StartTyped();
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    CallOptions o;
    o.deadline = absl::Now() + absl::Milliseconds(100);
    auto r = co_await (*c)->Call<Pod>("Wait", Pod{}, o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(co_await Eventually(
        [t] { return t->obs_.slow_cancelled.load() == 1; }));
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

TEST_P(TypedTest, AdmissionRefusesWithAReasonTheClientSees) {
  ServerOptions o;
  std::atomic<int> asked{0};
  o.admit = [&asked](const cm::PeerInfo& peer) -> absl::Status {
    asked.fetch_add(1);
    if (peer.handshake.app_data == "let-me-in") return absl::OkStatus();
    return absl::PermissionDeniedError(
        absl::StrCat("unknown tenant '", peer.handshake.app_data, "'"));
  };
  StartTyped(std::move(o));
  Run([](TypedTest* t) -> Task<void> {
    auto refused = co_await t->NewClientWith("mallory");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_NE(refused.status().message().find("unknown tenant 'mallory'"),
              std::string::npos)
        << refused.status();
    auto admitted = co_await t->NewClientWith("let-me-in");
    CO_ASSERT_OK(admitted);
    auto who = co_await (*admitted)->Call(kWho, std::string());
    CO_ASSERT_OK(who);
    CO_ASSERT_OK(co_await (*admitted)->Close());
  }(this));
  EXPECT_EQ(asked.load(), 2);
  EXPECT_GE(server_->stats().rejected_connections, 1u);
}

// Registration: from several threads at once before Start (a mutex guards
// the table), refused once the server started (serving reads the table
// without a lock).
TEST_P(TypedTest, RegisterIsThreadSafeBeforeStartAndRefusedAfter) {
  server_ = std::make_unique<Server>();
  constexpr int kThreads = 4, kPerThread = 25;
  std::vector<std::thread> threads;
  std::atomic<int> failed{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([this, i, &failed] {
      for (int j = 0; j < kPerThread; ++j) {
        absl::Status s = server_->Register(
            absl::StrCat("M", i, "_", j),
            [i, j](Pod) -> Task<absl::StatusOr<Pod>> {
              co_return Pod{static_cast<uint64_t>(i), static_cast<uint64_t>(j)};
            });
        if (!s.ok()) failed.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(server_->Register("M0_0", &SwapPod).code(),
            absl::StatusCode::kAlreadyExists);
  std::vector<cm::Worker*> ctxs;
  for (auto& c : server_ctxs_) ctxs.push_back(c.get());
  ASSERT_TRUE(server_->Start(ctxs, addr_, 0).ok());
  EXPECT_EQ(server_->Register("Late", &SwapPod).code(),
            absl::StatusCode::kFailedPrecondition);
  Run([](TypedTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    for (int i = 0; i < kThreads; ++i) {
      for (int j = 0; j < kPerThread; j += 6) {
        auto r = co_await (*c)->Call<Pod>(absl::StrCat("M", i, "_", j), Pod{});
        CO_ASSERT_OK(r);
        EXPECT_EQ(r->a, static_cast<uint64_t>(i));
        EXPECT_EQ(r->b, static_cast<uint64_t>(j));
      }
    }
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

// ProtectionDomain::Register and deregistration from several threads at
// once on one PD (what handlers on a WorkerPool sharing a PD do): every
// registration succeeds (TSan checks the provider's tables).
TEST_P(TypedTest, ProtectionDomainRegisterIsThreadSafe) {
  auto pd = device_->AllocPd();
  ASSERT_TRUE(pd.ok()) << pd.status();
  constexpr int kThreads = 4, kRounds = 100;
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      std::vector<std::byte> mem(4096);
      std::vector<transport::MemoryRegion> live;
      for (int r = 0; r < kRounds; ++r) {
        auto mr = (*pd)->Register(std::span(mem).subspan(r % 64, 1024),
                                  transport::Access::kRemoteRead);
        if (!mr.ok()) {
          failed.fetch_add(1);
          continue;
        }
        live.push_back(*std::move(mr));
        if (live.size() > 8) live.erase(live.begin());  // deregisters
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Providers, TypedTest, ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::rpc
