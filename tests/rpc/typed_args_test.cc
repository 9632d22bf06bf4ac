// Typed methods of none, one or several arguments (rpc::Method<R(A...)>)
// and transport::RemoteRegion as a msgpack value. The codec level without
// a connection (RemoteRegion inside structs and vectors, the argument
// list's encoding, and a mutation sweep over it: there is no msgpack fuzz
// target, the sweep stands in), then end to end on every available
// provider, through rpc::Client and rpc::ClientPool: arities 0 to 3, wrong
// arity and garbage refused with INVALID_ARGUMENT on a connection that
// keeps serving, a struct holding a region a handler exposed and the
// caller READs, and the decode bound and off-reactor decode of a large
// argument list.
#include <cctype>
#include <future>
#include <optional>
#include <random>
#include <thread>

#include "cm/worker_pool.h"
#include "rpc/client_pool.h"
#include "rpc/typed.h"
#include "tests/rpc/rpc_fixture.h"

namespace coverbs::rpc {
namespace {

using namespace rpc_test_util;  // NOLINT: the fixture and its helpers
using transport::RemoteRegion;

struct Stats {
  uint64_t calls = 0;
  std::string method;
  MSGPACK_DEFINE(calls, method);
};

// A region inside a msgpack struct, and an optional one (nil when absent).
struct Snapshot {
  std::string label;
  RemoteRegion region;
  std::optional<RemoteRegion> first;
  MSGPACK_DEFINE(label, region, first);
};

// The same as a map (msgpack-c converts it: a region through its adaptor).
struct Keyed {
  RemoteRegion region;
  MSGPACK_DEFINE_MAP(region);
};

// A value with an adaptor of its own (opted in below) that notes the
// thread it was decoded on.
struct Where {
  int32_t v = 0;
  std::thread::id decoded_on;
};

struct Pod {
  uint64_t a = 0;
};

}  // namespace

template <>
struct UseMsgpack<Where> : std::true_type {};

}  // namespace coverbs::rpc

namespace msgpack {
MSGPACK_API_VERSION_NAMESPACE(MSGPACK_DEFAULT_API_NS) {
  namespace adaptor {
  template <>
  struct convert<coverbs::rpc::Where> {
    const msgpack::object& operator()(const msgpack::object& o,
                                      coverbs::rpc::Where& w) const {
      w.v = o.as<int32_t>();
      w.decoded_on = std::this_thread::get_id();
      return o;
    }
  };
  template <>
  struct pack<coverbs::rpc::Where> {
    template <typename S>
    packer<S>& operator()(packer<S>& o, const coverbs::rpc::Where& w) const {
      return o.pack(w.v);
    }
  };
  }  // namespace adaptor
}  // MSGPACK_API_VERSION_NAMESPACE(MSGPACK_DEFAULT_API_NS)
}  // namespace msgpack

namespace coverbs::rpc {
namespace {

inline constexpr Method<uint64_t(std::string, std::vector<float>)> kPush{
    "Push"};
inline constexpr Method<Stats()> kStats{"Stats"};
inline constexpr Method<int32_t()> kSeven{"Seven"};
// Three arguments, spelled as a C++ signature would be.
inline constexpr Method<std::string(const std::string&, int32_t, bool)> kJoin{
    "Join"};
// One argument: the two spellings are one method on the wire.
inline constexpr Method<std::string(std::string)> kUpper{"Upper"};
inline constexpr Method<std::string, std::string> kUpperTwo{"Upper"};
inline constexpr Method<Snapshot(std::string, uint32_t)> kExpose{"Expose"};
inline constexpr Method<uint64_t(RemoteRegion, std::string_view)> kMeasure{
    "Measure"};
inline constexpr Method<uint64_t(std::string, std::vector<std::string>)> kTags{
    "Tags"};
inline constexpr Method<uint64_t(std::string, std::vector<std::string>)>
    kTagsRoomy{"TagsRoomy"};
inline constexpr Method<std::string(Where, std::string)> kWhere{"Where"};
inline constexpr Method<std::string(Where, std::string)> kWhereOwn{"WhereOwn"};
// Seven's name with another result type.
inline constexpr Method<Stats()> kSevenAsStats{"Seven"};

static_assert(std::is_same_v<decltype(kJoin)::ArgTypes,
                             std::tuple<std::string, int32_t, bool>>);
static_assert(MsgpackArg<RemoteRegion> && MsgpackArg<Snapshot> &&
              MsgpackArg<std::string_view> && MsgpackArg<std::vector<float>>);
static_assert(!MsgpackArg<Pod> && !MsgpackArg<Payload>);

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span(s));
}

// The values as one msgpack array (what a peer of another language sends).
template <typename... T>
std::string Pack(const T&... v) {
  std::string out;
  internal::StringSink sink{&out};
  msgpack::pack(sink, std::make_tuple(v...));
  return out;
}

std::string Bin(const std::string& bytes) {
  return std::string("\xc4") + static_cast<char>(bytes.size()) + bytes;
}

// A msgpack array32 of n copies of `elem`.
std::string ArrayOf(size_t n, const std::string& elem) {
  std::string s = "\xdd";
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>(n >> (8 * i)));
  for (size_t i = 0; i < n; ++i) s += elem;
  return s;
}

void ExpectRegion(const RemoteRegion& got, const RemoteRegion& want) {
  EXPECT_EQ(got.addr, want.addr);
  EXPECT_EQ(got.length, want.length);
  EXPECT_EQ(got.rkey, want.rkey);
}

// --- The codec level.

TEST(RemoteRegionMsgpack, TravelsAsABinInStructsAndVectors) {
  Snapshot s;
  s.label = "l";
  s.region = RemoteRegion{0x1000, 64, 7};
  s.first = RemoteRegion{0x1000, 4, 7};
  std::string bytes;
  Codec<Snapshot>::Encode(s, bytes);
  // ["l", bin 20, bin 20].
  ASSERT_EQ(bytes.size(), 1u + 2u + 2 * 22u);
  EXPECT_EQ(bytes.substr(3, 2), std::string("\xc4\x14"));
  auto back = Codec<Snapshot>::Decode(Bytes(bytes));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectRegion(back->region, s.region);
  ASSERT_TRUE(back->first.has_value());
  ExpectRegion(*back->first, *s.first);
  // msgpack-c's own unpack and object tree agree.
  msgpack::object_handle oh = msgpack::unpack(bytes.data(), bytes.size());
  ExpectRegion(oh.get().as<Snapshot>().region, s.region);
  msgpack::zone zone;
  msgpack::object o(s, zone);
  ExpectRegion(o.as<Snapshot>().region, s.region);
  // Absent: nil.
  s.first.reset();
  bytes.clear();
  Codec<Snapshot>::Encode(s, bytes);
  back = Codec<Snapshot>::Decode(Bytes(bytes));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->first.has_value());
  // A vector of them, and a map-shaped struct (through msgpack-c).
  std::vector<RemoteRegion> v = {{1, 2, 3}, {4, 5, 6}};
  std::string vb;
  Codec<std::vector<RemoteRegion>>::Encode(v, vb);
  auto vback = Codec<std::vector<RemoteRegion>>::Decode(Bytes(vb));
  ASSERT_TRUE(vback.ok()) << vback.status();
  ASSERT_EQ(vback->size(), 2u);
  ExpectRegion((*vback)[1], v[1]);
  std::string kb;
  Codec<Keyed>::Encode(Keyed{v[0]}, kb);
  auto kback = Codec<Keyed>::Decode(Bytes(kb));
  ASSERT_TRUE(kback.ok()) << kback.status();
  ExpectRegion(kback->region, v[0]);
  // The whole-value codec is unchanged: the 20 bytes, no msgpack header.
  std::string raw;
  Codec<RemoteRegion>::Encode(s.region, raw);
  EXPECT_EQ(raw.size(), RemoteRegion::kEncodedSize);
}

TEST(RemoteRegionMsgpack, RefusesOtherLengthsAndTypes) {
  const std::string good(reinterpret_cast<const char*>(
                             RemoteRegion{0x1000, 64, 7}.Encode().data()),
                         RemoteRegion::kEncodedSize);
  const std::string empty(
      reinterpret_cast<const char*>(RemoteRegion{0x1000, 0, 7}.Encode().data()),
      RemoteRegion::kEncodedSize);
  const std::string wraps(reinterpret_cast<const char*>(
                              RemoteRegion{~0ull - 3, 64, 7}.Encode().data()),
                          RemoteRegion::kEncodedSize);
  const std::pair<std::string, std::string> cases[] = {
      {Bin(good.substr(0, 19)), "19 bytes, expected 20"},
      {Bin(good + "x"), "21 bytes, expected 20"},
      {Bin(""), "0 bytes, expected 20"},
      {"\xb4" + good, "expected a bin (a RemoteRegion), found str"},
      {"\x07", "found non-negative integer"},
      {"\xc0", "found nil"},
      {Bin(empty), "empty or wrapping range"},
      {Bin(wraps), "empty or wrapping range"},
  };
  for (const auto& [region, why] : cases) {
    const std::string bytes = "\x93\xa1l" + region + "\xc0";
    auto r = Codec<Snapshot>::Decode(Bytes(bytes));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << why;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status();
    // Through msgpack-c (a map-shaped struct): refused, not a crash.
    const std::string keyed = "\x81\xa6region" + region;
    EXPECT_EQ(Codec<Keyed>::Decode(Bytes(keyed)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << why;
    // msgpack-c's own convert throws its type_error, as its adaptors do.
    msgpack::object_handle oh = msgpack::unpack(bytes.data(), bytes.size());
    EXPECT_THROW(oh.get().as<Snapshot>(), msgpack::type_error) << why;
  }
}

using PushSpec = internal::ArgsOf<false, std::string, std::vector<float>>;
using JoinSpec = internal::ArgsOf<false, std::string, int32_t, bool>;
using MeasureSpec = internal::ArgsOf<false, RemoteRegion, std::string_view>;
using NoneSpec = internal::ArgsOf<false>;

TEST(ArgList, EncodesOneArrayAndDecodesExactlyItsArity) {
  const std::string name = "abc";
  std::vector<float> d = {1.5f, 2.5f};
  using Push = internal::CallArgs<CallOptions,
                                  std::tuple<std::string, std::vector<float>>,
                                  const std::string&, std::vector<float>&>;
  static_assert(Push::kValid && !Push::kWithOptions);
  internal::CallPayload p = Push::Encode(name, d);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(p.bytes().data()),
                        p.bytes().size()),
            Pack(name, d));
  auto back = PushSpec::Decode(p.bytes(), DecodeOptions());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(std::get<0>(*back), "abc");
  EXPECT_EQ(std::get<1>(*back), d);
  // Converting arguments (a literal, an int), then options.
  using Join =
      internal::CallArgs<CallOptions, std::tuple<std::string, int32_t, bool>,
                         const char(&)[3], int, bool, CallOptions&>;
  static_assert(Join::kValid && Join::kWithOptions);
  CallOptions o;
  o.deadline = absl::UnixEpoch();
  EXPECT_EQ(Join::Options("ab", 2, true, o).deadline, absl::UnixEpoch());
  internal::CallPayload j = Join::Encode("ab", 2, true, o);
  auto jb = JoinSpec::Decode(j.bytes(), DecodeOptions());
  ASSERT_TRUE(jb.ok()) << jb.status();
  EXPECT_EQ(*jb, std::make_tuple(std::string("ab"), 2, true));
  // One argument: in place when of the method's type (as Method<A, R>),
  // encoded when converted.
  using One = internal::CallArgs<CallOptions, std::tuple<std::string>,
                                 const std::string&>;
  EXPECT_EQ(One::Encode(name).bytes().data(), Bytes(name).data());
  using OneLiteral = internal::CallArgs<CallOptions, std::tuple<std::string>,
                                        const char(&)[4]>;
  EXPECT_EQ(OneLiteral::Encode("xyz").bytes().size(), 3u);
  // None: empty.
  using None = internal::CallArgs<CallOptions, std::tuple<>>;
  EXPECT_TRUE(None::Encode().bytes().empty());
  EXPECT_TRUE(NoneSpec::Decode({}, DecodeOptions()).ok());
  EXPECT_EQ(NoneSpec::Decode(Bytes("\x90"), DecodeOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);

  // Other arities, other shapes, trailing bytes.
  const std::pair<std::string, std::string> bad[] = {
      {Pack(name), "an argument list of 2 element(s) came as an array of 1"},
      {Pack(name, d, 3), "of 2 element(s) came as an array of 3"},
      {"\x90", "came as an array of 0"},
      {"\xa3"
       "abc",
       "expected an array (an argument list), found str"},
      {Pack(name, name), "expected an array, found str"},
      {Pack(name, d) + "\xc0", "1 bytes after its value"},
      {"", "truncated"},
      {"\xc1", "never used"},
  };
  for (const auto& [bytes, why] : bad) {
    auto r = PushSpec::Decode(Bytes(bytes), DecodeOptions());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << why;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status();
  }
  // A string_view argument is a view of the request.
  const std::string m = Pack(RemoteRegion{1, 2, 3}, std::string("tag"));
  auto mb = MeasureSpec::Decode(Bytes(m), DecodeOptions());
  ASSERT_TRUE(mb.ok()) << mb.status();
  EXPECT_EQ(std::get<1>(*mb), "tag");
  EXPECT_GE(std::get<1>(*mb).data(), m.data());
  EXPECT_LT(std::get<1>(*mb).data(), m.data() + m.size());
}

TEST(ArgList, DecodeIsBoundedByThePayload) {
  // ["k", [1M empty strings]]: 32x, refused before allocating.
  const std::string empties = "\x92\xa1k" + ArrayOf(1 << 20, "\xa0");
  using TagsSpec =
      internal::ArgsOf<false, std::string, std::vector<std::string>>;
  auto r = TagsSpec::Decode(Bytes(empties), DecodeOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted)
      << r.status();
  DecodeOptions roomy;
  roomy.memory_factor = 40;
  auto ok = TagsSpec::Decode(Bytes(empties), roomy);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(std::get<1>(*ok).size(), 1u << 20);
}

// Mutations of valid argument lists (bytes flipped, dropped, inserted,
// truncated) decode or are refused with a status: never a crash, an
// out-of-bounds read (ASan) or an allocation past the bound.
TEST(ArgList, MutatedPayloadsDecodeOrAreRefused) {
  const std::vector<std::string> seeds = {
      Pack(std::string("abc"), std::vector<float>{1, 2, 3}),
      Pack(std::string("ab"), 2, true),
      Pack(RemoteRegion{0x1000, 64, 7}, std::string("tag")),
      Pack(std::string("s"), Snapshot{"l", {1, 2, 3}, RemoteRegion{1, 1, 1}}),
  };
  std::mt19937 rng(37);
  DecodeOptions tight;
  tight.memory_slack = 256;
  auto check = [](const absl::Status& s) {
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kInvalidArgument ||
                s.code() == absl::StatusCode::kResourceExhausted)
        << s;
  };
  for (int i = 0; i < 20000; ++i) {
    std::string b = seeds[i % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !b.empty(); ++e) {
      const size_t at = rng() % b.size();
      switch (rng() % 4) {
        case 0:
          b[at] = static_cast<char>(rng());
          break;
        case 1:
          b.erase(at, 1);
          break;
        case 2:
          b.insert(at, 1, static_cast<char>(rng()));
          break;
        default:
          b.resize(at);
          break;
      }
    }
    const DecodeOptions& o = i % 2 == 0 ? tight : DecodeOptions();
    check(PushSpec::Decode(Bytes(b), o).status());
    check(JoinSpec::Decode(Bytes(b), o).status());
    check(MeasureSpec::Decode(Bytes(b), o).status());
    check(internal::ArgsOf<false, std::string, Snapshot>::Decode(Bytes(b), o)
              .status());
    check(NoneSpec::Decode(Bytes(b), o).status());
  }
}

// --- End to end.

Task<absl::StatusOr<std::string>> WhereDecoded(Where w, std::string s) {
  co_return absl::StrCat(
      w.decoded_on == std::this_thread::get_id() ? "inline" : "offloaded", " ",
      w.v, " ", s.size());
}

Task<absl::StatusOr<uint64_t>> CountTags(std::string key,
                                         std::vector<std::string> tags) {
  co_return key.size() + tags.size();
}

class TypedArgsTest : public RpcTest {
 public:
  void StartTyped() {
    server_ = std::make_unique<Server>();
    Server& s = *server_;
    std::atomic<uint64_t>* stats_calls = &stats_calls_;
    ASSERT_TRUE(
        s.Register(kPush,
                   [](std::string name,
                      std::vector<float> d) -> Task<absl::StatusOr<uint64_t>> {
                     float sum = 0;
                     for (float f : d) sum += f;
                     co_return name.size() * 1000 + static_cast<uint64_t>(sum);
                   })
            .ok());
    ASSERT_TRUE(
        s.Register(kStats,
                   [stats_calls](Context& ctx) -> Task<absl::StatusOr<Stats>> {
                     Stats st;
                     st.calls = stats_calls->fetch_add(1) + 1;
                     st.method = std::string(ctx.method);
                     co_return st;
                   })
            .ok());
    ASSERT_TRUE(s.Register(kSeven, []() -> Task<absl::StatusOr<int32_t>> {
                   co_return 7;
                 }).ok());
    ASSERT_TRUE(
        s.Register(kJoin,
                   [](const Context&, const std::string& part, int32_t times,
                      bool upper) -> Task<absl::StatusOr<std::string>> {
                     std::string out;
                     for (int32_t i = 0; i < times; ++i) out += part;
                     if (upper) {
                       for (char& c : out) c = std::toupper(c);
                     }
                     co_return out;
                   })
            .ok());
    ASSERT_TRUE(
        s.Register(kUpper,
                   [](std::string in) -> Task<absl::StatusOr<std::string>> {
                     for (char& c : in) c = std::toupper(c);
                     co_return in;
                   })
            .ok());
    // A region of `text` exposed to this caller in a struct, with its
    // first `first` bytes as the optional one.
    ASSERT_TRUE(
        s.Register(kExpose,
                   [](Context& ctx, std::string text,
                      uint32_t first) -> Task<absl::StatusOr<Snapshot>> {
                     auto buf = std::make_shared<std::string>(std::move(text));
                     ctx.KeepUntilClose(buf);
                     auto mr = ctx.connection().worker().pd().Register(
                         std::as_writable_bytes(std::span(*buf)),
                         transport::Access::kRemoteRead);
                     if (!mr.ok()) co_return mr.status();
                     transport::MemoryRegion& kept =
                         ctx.KeepUntilClose(*std::move(mr));
                     auto region = ctx.Expose(kept);
                     if (!region.ok()) co_return region.status();
                     Snapshot snap;
                     snap.label = "snap";
                     snap.region = *region;
                     if (first > 0) snap.first = region->Slice(0, first);
                     co_return snap;
                   })
            .ok());
    ASSERT_TRUE(s.Register(kMeasure,
                           [](RemoteRegion r, std::string_view tag)
                               -> Task<absl::StatusOr<uint64_t>> {
                             co_return r.length + tag.size();
                           })
                    .ok());
    ASSERT_TRUE(s.Register(kTags, &CountTags).ok());
    DecodeOptions roomy;
    roomy.memory_factor = 40;
    ASSERT_TRUE(s.Register(kTagsRoomy, &CountTags, roomy).ok());
    ASSERT_TRUE(s.Register(kWhere, &WhereDecoded).ok());
    DecodeOptions own;
    own.offload_above = 0;  // every argument list off the reactor
    ASSERT_TRUE(s.Register(kWhereOwn, &WhereDecoded, own).ok());
    std::vector<cm::Worker*> ctxs;
    for (auto& c : server_ctxs_) ctxs.push_back(c.get());
    absl::Status st = server_->Start(ctxs, addr_, 0);
    ASSERT_TRUE(st.ok()) << st;
  }

  std::atomic<uint64_t> stats_calls_{0};
};

// Every arity through one client (arguments named in locals: gcc 12,
// README "Building").
Task<absl::Status> CallEveryArity(Client& client) {
  const std::string name = "abc";
  std::vector<float> d = {1.5f, 2.5f};
  auto pushed = co_await client.Call(kPush, name, d);
  if (!pushed.ok()) co_return pushed.status();
  if (*pushed != 3004) co_return absl::DataLossError("push");
  auto stats = co_await client.Call(kStats);
  if (!stats.ok()) co_return stats.status();
  if (stats->method != "Stats" || stats->calls == 0) {
    co_return absl::DataLossError("stats");
  }
  auto seven = co_await client.Call(kSeven);
  if (!seven.ok()) co_return seven.status();
  if (*seven != 7) co_return absl::DataLossError("seven");
  CallOptions o;
  o.deadline = absl::Now() + absl::Seconds(30);
  const bool upper = true;
  auto joined = co_await client.Call(kJoin, "ab", 3, upper, o);
  if (!joined.ok()) co_return joined.status();
  if (*joined != "ABABAB") co_return absl::DataLossError(*joined);
  // One argument: by the function form (in place, and converted from a
  // literal) and by the two-type form, one method.
  auto up = co_await client.Call(kUpper, name);
  if (!up.ok()) co_return up.status();
  auto lit = co_await client.Call(kUpper, "xyz");
  if (!lit.ok()) co_return lit.status();
  auto two = co_await client.Call(kUpperTwo, name);
  if (!two.ok()) co_return two.status();
  if (*up != "ABC" || *lit != "XYZ" || *two != "ABC") {
    co_return absl::DataLossError("upper");
  }
  const RemoteRegion r{0x1000, 40, 9};
  const std::string_view tag = "four";
  auto measured = co_await client.Call(kMeasure, r, tag);
  if (!measured.ok()) co_return measured.status();
  if (*measured != 44) co_return absl::DataLossError("measure");
  co_return absl::OkStatus();
}

TEST_P(TypedArgsTest, EveryArityThroughAClient) {
  StartTyped();
  Run([](TypedArgsTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    CO_ASSERT_OK(co_await CallEveryArity(**c));
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

TEST_P(TypedArgsTest, WrongArityAndGarbageAreRefusedAndTheConnectionServes) {
  StartTyped();
  Run([](TypedArgsTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client& client = **c;
    const std::vector<float> d = {1};
    const std::string region19 = Bin(std::string(19, 'r'));
    const std::pair<std::string, std::pair<std::string, std::string>> cases[] =
        {
            {"Push", {Pack(std::string("a"), d, 3), "array of 3"}},
            {"Push", {Pack(std::string("a")), "array of 1"}},
            {"Push", {"\xc1\x00garbage", "never used"}},
            {"Push", {"", "truncated"}},
            {"Push", {Pack(std::string("a"), 5), "expected an array"}},
            {"Join", {Pack(std::string("a"), 1), "an argument list of 3"}},
            {"Stats", {"x", "a method without arguments got a payload"}},
            {"Seven", {"\x90", "a method without arguments got a payload"}},
            {"Measure", {"\x92" + region19 + "\xa1t", "19 bytes, expected 20"}},
        };
    for (const auto& [method, payload_why] : cases) {
      const auto& [payload, why] = payload_why;
      auto r = co_await client.Call(method, Bytes(payload));
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
          << method << " " << why << ": " << r.status();
      EXPECT_NE(r.status().message().find(absl::StrCat("method ", method)),
                std::string::npos)
          << r.status();
      EXPECT_NE(r.status().message().find(why), std::string::npos)
          << r.status();
    }
    // The response must decode as the caller's R: Seven returns an int32.
    auto wrong = co_await client.Call(kSevenAsStats);
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInternal)
        << wrong.status();
    EXPECT_TRUE(client.status().ok()) << client.status();
    CO_ASSERT_OK(co_await CallEveryArity(client));
    CO_ASSERT_OK(co_await client.Close());
  }(this));
}

// A handler exposes memory to its caller in a msgpack struct (a region and
// an optional one); the caller READs both.
TEST_P(TypedArgsTest, StructHoldingARegionIsReadByTheCaller) {
  StartTyped();
  Run([](TypedArgsTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client& client = **c;
    const std::string text = "bytes this caller reads from a struct's region";
    const uint32_t first = 5;
    auto snap = co_await client.Call(kExpose, text, first);
    CO_ASSERT_OK(snap);
    EXPECT_EQ(snap->label, "snap");
    EXPECT_EQ(snap->region.length, text.size());
    std::string copy(snap->region.length, '\0');
    CO_ASSERT_OK(co_await client.connection().Read(
        std::as_writable_bytes(std::span(copy)), snap->region));
    EXPECT_EQ(copy, text);
    CO_ASSERT_TRUE(snap->first.has_value());
    std::string head(snap->first->length, '\0');
    CO_ASSERT_OK(co_await client.connection().Read(
        std::as_writable_bytes(std::span(head)), *snap->first));
    EXPECT_EQ(head, "bytes");
    // Without the optional one: nil on the wire.
    const uint32_t none = 0;
    auto bare = co_await client.Call(kExpose, text, none);
    CO_ASSERT_OK(bare);
    EXPECT_FALSE(bare->first.has_value());
    CO_ASSERT_OK(co_await client.Close());
  }(this));
}

// The decode bound and the offload rule, as for one msgpack argument.
TEST_P(TypedArgsTest, LargeArgumentListsAreBoundedAndDecodedOffTheReactor) {
  StartTyped();
  Run([](TypedArgsTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client& client = **c;
    // ["k", [1M empty strings]]: 32 MiB of std::string for 1 MiB.
    const std::string empties = "\x92\xa1k" + ArrayOf(1 << 20, "\xa0");
    auto big = co_await client.Call("Tags", Bytes(empties));
    EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted)
        << big.status();
    EXPECT_NE(big.status().message().find("method Tags"), std::string::npos)
        << big.status();
    EXPECT_NE(big.status().message().find("8x the payload + 65536 bytes"),
              std::string::npos)
        << big.status();
    // The method's own bound admits it.
    auto roomy = co_await client.Call("TagsRoomy", Bytes(empties));
    CO_ASSERT_OK(roomy);
    auto n = internal::FromResponse<uint64_t>("TagsRoomy", *std::move(roomy));
    CO_ASSERT_OK(n);
    EXPECT_EQ(*n, 1u + (1u << 20));
    // Where the list decoded: above offload_above on a pool thread.
    const Where w{3, {}};
    const std::string small(100, 's'), large(200 << 10, 'l');
    auto a = co_await client.Call(kWhere, w, small);
    CO_ASSERT_OK(a);
    EXPECT_EQ(*a, "inline 3 100");
    auto b = co_await client.Call(kWhere, w, large);
    CO_ASSERT_OK(b);
    EXPECT_EQ(*b, absl::StrCat("offloaded 3 ", large.size()));
    auto own = co_await client.Call(kWhereOwn, w, small);
    CO_ASSERT_OK(own);
    EXPECT_EQ(*own, "offloaded 3 100");
    CO_ASSERT_OK(co_await client.Close());
  }(this));
  EXPECT_EQ(server_->stats().reactor_stalls, 0u);
}

// The same calls through a ClientPool, and the struct's region read on a
// leased connection.
Task<absl::Status> CallThroughAPool(ClientPool& p) {
  const std::string name = "abc";
  std::vector<float> d = {1.5f, 2.5f};
  auto pushed = co_await p.Call(kPush, name, d);
  if (!pushed.ok()) co_return pushed.status();
  if (*pushed != 3004) co_return absl::DataLossError("push");
  auto stats = co_await p.Call(kStats);
  if (!stats.ok()) co_return stats.status();
  if (stats->method != "Stats") co_return absl::DataLossError("stats");
  CallOptions o;
  o.deadline = absl::Now() + absl::Seconds(30);
  const bool upper = false;
  auto joined = co_await p.Call(kJoin, name, 2, upper, o);
  if (!joined.ok()) co_return joined.status();
  if (*joined != "abcabc") co_return absl::DataLossError(*joined);
  auto up = co_await p.Call(kUpper, name);
  if (!up.ok()) co_return up.status();
  if (*up != "ABC") co_return absl::DataLossError(*up);
  // A lease: the region is usable on the connection that made it.
  auto lease = co_await p.Lease();
  if (!lease.ok()) co_return lease.status();
  const std::string text = "pooled region";
  const uint32_t none = 0;
  auto snap = co_await (*lease)->Call(kExpose, text, none);
  if (!snap.ok()) co_return snap.status();
  std::string copy(snap->region.length, '\0');
  absl::Status read = co_await (*lease)->connection().Read(
      std::as_writable_bytes(std::span(copy)), snap->region);
  if (!read.ok()) co_return read;
  if (copy != text) co_return absl::DataLossError(copy);
  co_return absl::OkStatus();
}

TEST_P(TypedArgsTest, EveryArityThroughAClientPool) {
  StartTyped();
  cm::WorkerPool::Options wo;
  wo.threads = 1;
  auto workers = cm::WorkerPool::Create(*device_, wo);
  ASSERT_TRUE(workers.ok()) << workers.status();
  ClientPoolOptions po;
  po.servers = {{addr_, server_->port()}};
  po.wait_for_ready = true;
  auto pool = ClientPool::Create(**workers, std::move(po));
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::promise<absl::Status> done;
  (*workers)->reactors().Spawn(
      0, [](ClientPool* p, std::promise<absl::Status>* done) -> Task<void> {
        absl::Status s = co_await CallThroughAPool(*p);
        done->set_value(s);
      }(pool->get(), &done));
  absl::Status s = done.get_future().get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ((*pool)->stats().calls, 4u);
  (*pool)->Shutdown();
  pool->reset();
  workers->reset();
}

INSTANTIATE_TEST_SUITE_P(Providers, TypedArgsTest,
                         ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::rpc
