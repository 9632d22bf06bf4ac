// rpc::Codec without a connection: each kind of type round-trips, views do
// not copy, and payloads that do not match the type are refused with
// INVALID_ARGUMENT (sizes, bad protobuf, msgpack that lies about its
// counts or trails bytes) rather than read out of bounds or allocated for.
#include "rpc/codec.h"

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "rpc/typed.h"
#include "tests/rpc/typed_test.pb.h"

namespace coverbs::rpc {
namespace {

struct Pod {
  uint64_t a = 0;
  uint32_t b = 0;
  uint32_t c = 0;
};

struct Plain {
  std::string name;
  std::vector<uint32_t> values;
  std::map<std::string, std::string> attrs;
  MSGPACK_DEFINE(name, values, attrs);
};

// Trivially copyable, but msgpack by choice (MSGPACK_DEFINE wins).
struct PodAsMsgpack {
  int32_t x = 0;
  MSGPACK_DEFINE(x);
};

template <typename T>
T RoundTrip(const T& v) {
  std::string bytes;
  Codec<T>::Encode(v, bytes);
  absl::StatusOr<T> back = Codec<T>::Decode(std::as_bytes(std::span(bytes)));
  EXPECT_TRUE(back.ok()) << back.status();
  return back.ok() ? *std::move(back) : T{};
}

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span(s));
}

TEST(CodecTest, TriviallyCopyableTravelsAsItsBytesFromTheObject) {
  static_assert(TrivialMessage<Pod>);
  Pod p{1, 2, 3};
  Pod back = RoundTrip(p);
  EXPECT_EQ(back.a, 1u);
  EXPECT_EQ(back.b, 2u);
  EXPECT_EQ(back.c, 3u);
  internal::EncodedArg<Pod> enc(p);
  EXPECT_EQ(static_cast<const void*>(enc.view().data()),
            static_cast<const void*>(&p));  // sent in place
  EXPECT_EQ(enc.view().size(), sizeof(Pod));
  // An exact size, else refused.
  std::string short_bytes(sizeof(Pod) - 1, 'x');
  auto bad = Codec<Pod>::Decode(Bytes(short_bytes));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("16-byte"), std::string_view::npos)
      << bad.status();
  // Unaligned input decodes (copied out, never read in place).
  std::string unaligned(sizeof(Pod) + 1, '\0');
  std::memcpy(unaligned.data() + 1, &p, sizeof(Pod));
  auto u = Codec<Pod>::Decode(Bytes(unaligned).subspan(1));
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->a, 1u);
}

TEST(CodecTest, StringsAndViews) {
  EXPECT_EQ(RoundTrip(std::string("hello")), "hello");
  std::string s = "view";
  auto v = Codec<std::string_view>::Decode(Bytes(s));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->data(), s.data());  // no copy
  auto sp = Codec<std::span<const std::byte>>::Decode(Bytes(s));
  ASSERT_TRUE(sp.ok());
  EXPECT_EQ(static_cast<const void*>(sp->data()),
            static_cast<const void*>(s.data()));
  internal::EncodedArg<std::string> enc(s);
  EXPECT_EQ(static_cast<const void*>(enc.view().data()),
            static_cast<const void*>(s.data()));
  // Results: a string moves into the payload.
  std::string big(1000, 'z');
  const char* where = big.data();
  Payload p = internal::ToPayload(std::move(big));
  EXPECT_EQ(static_cast<const void*>(p.data().data()),
            static_cast<const void*>(where));
}

TEST(CodecTest, MsgpackStructsAndContainers) {
  static_assert(UseMsgpack<Plain>::value);
  static_assert(UseMsgpack<PodAsMsgpack>::value &&
                !TrivialMessage<PodAsMsgpack>);
  static_assert(!UseMsgpack<std::vector<std::byte>>::value);
  Plain p{"n", {1, 2, 3}, {{"a", "b"}}};
  Plain back = RoundTrip(p);
  EXPECT_EQ(back.name, "n");
  EXPECT_EQ(back.values, (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_EQ(back.attrs.at("a"), "b");
  auto vec = RoundTrip(std::vector<std::string>{"x", "", "yy"});
  EXPECT_EQ(vec, (std::vector<std::string>{"x", "", "yy"}));
  EXPECT_EQ(RoundTrip(PodAsMsgpack{-7}).x, -7);
}

TEST(CodecTest, MsgpackRefusesLiesAndTrailingBytes) {
  // array32 claiming 2^32-1 elements in 5 bytes: refused before anything
  // is allocated for it.
  std::string huge_array = "\xdd\xff\xff\xff\xff";
  auto a = Codec<std::vector<uint32_t>>::Decode(Bytes(huge_array));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  std::string huge_map = "\xdf\xff\xff\xff\xff";
  auto m = Codec<std::map<std::string, std::string>>::Decode(Bytes(huge_map));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  // str32 claiming 1 GiB.
  std::string huge_str = std::string("\x91\xdb\x40\x00\x00\x00", 6);
  auto s = Codec<std::vector<std::string>>::Decode(Bytes(huge_str));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  // Deep nesting: 100 one-element arrays.
  std::string deep(100, '\x91');
  deep += '\x01';
  auto d = Codec<std::vector<uint32_t>>::Decode(Bytes(deep));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  // Wrong shape and trailing bytes.
  std::string good;
  Codec<std::vector<uint32_t>>::Encode({1, 2}, good);
  auto t = Codec<std::vector<uint32_t>>::Decode(Bytes(good + "x"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("after its value"),
            std::string_view::npos);
  auto shape = Codec<Plain>::Decode(Bytes(good));
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument);
  auto empty = Codec<Plain>::Decode({});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CodecTest, Protobuf) {
  static_assert(ProtobufMessage<test::KvPut>);
  test::KvPut put;
  put.set_key("k");
  put.set_value(std::string("\0v", 2));
  put.add_tags(7);
  test::KvPut back = RoundTrip(put);
  EXPECT_EQ(back.key(), "k");
  EXPECT_EQ(back.value(), std::string("\0v", 2));
  ASSERT_EQ(back.tags_size(), 1);
  EXPECT_EQ(back.tags(0), 7u);
  std::string garbage = "\xff\xff\xff\xff";
  auto bad = Codec<test::KvPut>::Decode(Bytes(garbage));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("coverbs.rpc.test.KvPut"),
            std::string_view::npos)
      << bad.status();
}

TEST(CodecTest, ResponseThatDoesNotDecodeIsInternalNamingTheMethod) {
  auto r = internal::FromResponse<Pod>("Get", Payload::Copy("abc"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("method Get"), std::string_view::npos);
  auto p = internal::FromResponse<Payload>("Get", Payload::Copy("abc"));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->text(), "abc");
}

}  // namespace
}  // namespace coverbs::rpc
