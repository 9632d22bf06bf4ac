// rpc::Codec without a connection: each kind of type round-trips, views do
// not copy, and payloads that do not match the type are refused with
// INVALID_ARGUMENT (sizes, bad protobuf, msgpack that lies about its
// counts or trails bytes) rather than read out of bounds or allocated for.
// The decode bound (issue 36): legitimate shapes decode within it, with
// the heap they really take measured (heap_counter.h);
// amplifying payloads are refused with RESOURCE_EXHAUSTED before anything
// is allocated for them; a struct must come with exactly its arity; the
// direct msgpack decoder converts like msgpack-c.
#include "rpc/codec.h"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "rpc/typed.h"
#include "tests/rpc/heap_counter.h"
#include "tests/rpc/typed_test.pb.h"

// Outside the anonymous namespace: msgpack's adaptor specializations must
// name them.
enum class Color { kRed = 1, kGreen = 2 };
MSGPACK_ADD_ENUM(Color);

namespace coverbs::rpc {
namespace {

using testing::PeakHeapDuring;

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

// --- The decode bound (issue 36, point 2).

struct Point {
  int32_t x = 0, y = 0;
  float weight = 0;
  std::string label;
  MSGPACK_DEFINE(x, y, weight, label);
};

struct Entry {
  std::string key;
  std::vector<std::string> values;
  MSGPACK_DEFINE(key, values);
};

struct Shape {
  std::string name;
  std::vector<Point> points;
  std::optional<Plain> extra;
  MSGPACK_DEFINE(name, points, extra);
};

template <typename T>
std::string Pack(const T& v) {
  std::string s;
  Codec<T>::Encode(v, s);
  return s;
}

// Decodes `bytes` as T with the default bound, expecting success, and
// checks that the heap the decode really took stays within that bound.
template <typename T>
void ExpectFits(const std::string& what, const std::string& bytes) {
  const DecodeOptions o;
  absl::StatusOr<T> v = absl::UnknownError("");
  const int64_t peak = PeakHeapDuring(
      [&] { v = Codec<T>::Decode(Bytes(bytes), o); });
  ASSERT_TRUE(v.ok()) << what << ": " << v.status();
  const size_t limit = ProtobufMessage<T> ? o.ProtobufMemoryLimit(bytes.size())
                                          : o.MemoryLimit(bytes.size());
  EXPECT_LE(peak, static_cast<int64_t>(limit)) << what;
  // The estimate the bound is checked against covers what the decode
  // really took (so the bound bounds the real thing).
  size_t estimate = 0;
  if constexpr (ProtobufMessage<T>) {
    ASSERT_TRUE(internal::pb::Check<T>(Bytes(bytes), "T", SIZE_MAX, 0, 0,
                                       &estimate)
                    .ok());
  } else {
    T scratch{};
    ASSERT_TRUE(internal::mp::Decode(Bytes(bytes), SIZE_MAX, 0, 0, scratch,
                                     &estimate)
                    .ok());
  }
  EXPECT_GE(static_cast<int64_t>(estimate), peak) << what;
  std::printf("  %-40s %9zu bytes -> %10lld bytes of heap (%.2fx), "
              "estimated %zu\n",
              what.c_str(), bytes.size(), static_cast<long long>(peak),
              static_cast<double>(peak) / bytes.size(), estimate);
}

// Decodes `bytes` as T expecting RESOURCE_EXHAUSTED naming the bound, with
// (next to) nothing allocated on the way.
template <typename T>
void ExpectRefused(const std::string& what, const std::string& bytes) {
  absl::StatusOr<T> v = absl::UnknownError("");
  const int64_t peak =
      PeakHeapDuring([&] { v = Codec<T>::Decode(Bytes(bytes)); });
  EXPECT_EQ(v.status().code(), absl::StatusCode::kResourceExhausted)
      << what << ": " << v.status();
  EXPECT_NE(v.status().message().find(ProtobufMessage<T>
                                          ? "16x the payload + 65536 bytes"
                                          : "8x the payload + 65536 bytes"),
            std::string_view::npos)
      << what << ": " << v.status();
  // The error's own text, and nothing of the payload's elements.
  EXPECT_LT(peak, 16 << 10) << what;
  std::printf("  %-40s %9zu bytes -> refused, %lld bytes of heap\n",
              what.c_str(), bytes.size(), static_cast<long long>(peak));
}

constexpr size_t kN = 1 << 20;  // elements: payloads of 1-9 MiB

std::string MsgpackArrayOf(size_t n, const std::string& elem) {
  std::string s = "\xdd";
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>(n >> (8 * i)));
  s.reserve(s.size() + n * elem.size());
  for (size_t i = 0; i < n; ++i) s += elem;
  return s;
}

TEST(DecodeBound, LegitimateShapesFitTheDefaultBound) {
  std::mt19937 rng(36);
  std::vector<float> floats(kN);
  for (float& f : floats) f = std::uniform_real_distribution<float>(-1, 1)(rng);
  ExpectFits<std::vector<float>>("vector<float>", Pack(floats));
  std::vector<double> doubles(kN, 0.0);
  ExpectFits<std::vector<double>>("vector<double> of zeros", Pack(doubles));
  std::vector<int32_t> small(kN), wide(kN);
  for (size_t i = 0; i < kN; ++i) {
    small[i] = static_cast<int32_t>(i % 128);  // 1 byte each on the wire
    wide[i] = static_cast<int32_t>(rng());
  }
  ExpectFits<std::vector<int32_t>>("vector<int32> of 0..127", Pack(small));
  ExpectFits<std::vector<int32_t>>("vector<int32>, full range", Pack(wide));
  std::vector<int64_t> small64(small.begin(), small.end());
  ExpectFits<std::vector<int64_t>>("vector<int64> of 0..127", Pack(small64));
  std::vector<uint8_t> bytes(kN, 7);
  ExpectFits<std::vector<uint8_t>>("vector<uint8> (bin)", Pack(bytes));
  std::vector<std::string> strings(kN / 4);
  for (size_t i = 0; i < strings.size(); ++i) {
    strings[i] = absl::StrCat("s", i % 1000);  // 2-4 characters
  }
  ExpectFits<std::vector<std::string>>("vector<string>, 2-4 chars (most 4)",
                                       Pack(strings));
  for (size_t i = 0; i < strings.size(); ++i) {
    strings[i] = absl::StrCat("a longer value, number ", i);
  }
  ExpectFits<std::vector<std::string>>("vector<string> of 24-30 chars",
                                       Pack(strings));
  std::vector<Point> points(kN / 8);
  for (size_t i = 0; i < points.size(); ++i) {
    points[i] = Point{static_cast<int32_t>(i), -static_cast<int32_t>(i), 0.5f,
                      absl::StrCat("p", i % 100)};
  }
  ExpectFits<std::vector<Point>>("vector<struct{2 int32,float,str}>",
                                 Pack(points));
  std::vector<Shape> shapes(kN / 64);
  for (size_t i = 0; i < shapes.size(); ++i) {
    shapes[i].name = absl::StrCat("shape-", i);
    shapes[i].points.assign(4, Point{1, 2, 3, "corner"});
    if (i % 2 == 0) {
      shapes[i].extra = Plain{"x", {1, 2, 3}, {{"key", "value"}}};
    }
  }
  ExpectFits<std::vector<Shape>>("vector<nested structs>", Pack(shapes));
  std::map<std::string, std::vector<int32_t>> series;
  for (size_t i = 0; i < kN / 64; ++i) {
    series[absl::StrCat("series-", i)] = std::vector<int32_t>(16, 1000);
  }
  ExpectFits<std::map<std::string, std::vector<int32_t>>>(
      "map<string, vector<int32>>", Pack(series));
  // protobuf: a batch of filled items, packed floats, a map.
  test::Batch b;
  for (size_t i = 0; i < kN / 32; ++i) {
    test::Item* it = b.add_items();
    it->set_name(absl::StrCat("item-", i));
    it->set_id(i);
    it->add_tags(i % 7);
    it->add_tags(i % 11);
  }
  for (size_t i = 0; i < kN / 8; ++i) b.add_weights(0.25f * i);
  for (size_t i = 0; i < kN / 256; ++i) {
    (*b.mutable_counts())[absl::StrCat("count-", i)] = i;
  }
  ExpectFits<test::Batch>("protobuf Batch", b.SerializeAsString());
  test::Batch items;  // small sub-messages only: 7-8x in libprotobuf
  for (size_t i = 0; i < kN / 32; ++i) {
    test::Item* it = items.add_items();
    it->set_name(absl::StrCat("item-", i));
    it->set_id(i);
    it->add_tags(i % 7);
    it->add_tags(i % 11);
  }
  ExpectFits<test::Batch>("protobuf Batch of small Items",
                          items.SerializeAsString());
  test::KvPut put;
  put.set_key("key");
  put.set_value(std::string(kN, 'v'));
  for (size_t i = 0; i < kN / 4; ++i) put.add_tags(i % 100);
  ExpectFits<test::KvPut>("protobuf KvPut, packed tags", put.SerializeAsString());
}

// A message's first unknown field makes its unknown-field set as well as
// the field: the estimate covers both (found by codec_fuzzer: a KvPut with
// one unknown varint took 8 bytes more than its bound).
TEST(DecodeBound, EstimateCoversAMessagesUnknownFieldSet) {
  // What is made once per process (the types' scan plans, libprotobuf's
  // descriptors and default instances) is not a decode's.
  const std::string warm("\x0a\x02\x78\x01\x78\x01", 6);
  ASSERT_TRUE(Codec<test::KvPut>::Decode(Bytes(warm)).ok());
  ASSERT_TRUE(Codec<test::Batch>::Decode(Bytes(warm)).ok());
  ExpectFits<test::KvPut>("protobuf one unknown varint",
                          std::string("\x78\x01", 2));
  ExpectFits<test::KvPut>("protobuf one unknown string",
                          std::string("\x7a\x03" "abc", 5));
  std::string items;  // Items with one unknown field each
  for (int i = 0; i < 64; ++i) items.append("\x0a\x02\x78\x01", 4);
  ExpectFits<test::Batch>("protobuf Items with an unknown field", items);
}

TEST(DecodeBound, AmplifyingPayloadsAreRefusedBeforeAllocating) {
  const std::string nils = MsgpackArrayOf(kN, "\xc0");
  ExpectRefused<std::vector<std::string>>("nils as vector<string>", nils);
  ExpectRefused<std::vector<std::optional<std::string>>>(
      "nils as vector<optional<string>>", nils);
  ExpectRefused<std::vector<std::optional<int64_t>>>(
      "nils as vector<optional<int64>>", nils);
  ExpectRefused<std::vector<std::string>>("empty strings as vector<string>",
                                          MsgpackArrayOf(kN, "\xa0"));
  ExpectRefused<std::vector<std::vector<int32_t>>>(
      "empty arrays as vector<vector<int32>>", MsgpackArrayOf(kN, "\x90"));
  ExpectRefused<std::vector<std::map<std::string, std::string>>>(
      "empty maps as vector<map>", MsgpackArrayOf(kN, "\x80"));
  // Inside a struct, after good fields: refused all the same.
  std::string plain = "\x93\xa1n" + MsgpackArrayOf(kN, std::string(1, '\0')) + "\x80";
  ExpectFits<Plain>("Plain with 1M small values", plain);  // uint32: 4x
  ExpectRefused<Entry>("Entry{key, 1M empty strings}",
                       "\x92\xa1k" + MsgpackArrayOf(kN, "\xa0"));
  ExpectRefused<std::vector<Entry>>(
      "vector<Entry> of empty Entries",
      MsgpackArrayOf(kN / 3, std::string("\x92\xa0\x90", 3)));
  // protobuf: empty sub-messages (2 bytes each), empty strings in a
  // repeated field, unknown fields.
  std::string items;
  for (size_t i = 0; i < kN; ++i) items.append("\x0a\x00", 2);  // items {}
  ExpectRefused<test::Batch>("protobuf Batch of empty Items", items);
  std::string unknown;
  for (size_t i = 0; i < kN; ++i) unknown.append("\x78\x00", 2);  // 15: 0
  ExpectRefused<test::Batch>("protobuf unknown varint fields", unknown);
  std::string unknown_len;
  for (size_t i = 0; i < kN; ++i) unknown_len.append("\x7a\x00", 2);  // 15: ""
  ExpectRefused<test::Batch>("protobuf unknown empty strings", unknown_len);
  // Items holding an unknown empty string each (4 bytes an Item).
  std::string nested;
  for (size_t i = 0; i < kN / 2; ++i) nested.append("\x0a\x02\x22\x00", 4);
  ExpectRefused<test::Batch>("protobuf Items with unknown fields", nested);
  std::string entries;
  for (size_t i = 0; i < kN; ++i) entries.append("\x22\x00", 2);  // counts {}
  ExpectRefused<test::Batch>("protobuf empty map entries", entries);
}

TEST(DecodeBound, IsAnOption) {
  // 100,000 entries of 8 bytes: ~10x in std::map nodes.
  std::map<std::string, int32_t> dense;
  for (int i = 0; i < 100000; ++i) dense[absl::StrFormat("k%05d", i)] = 1;
  const std::string bytes = Pack(dense);
  auto refused = Codec<std::map<std::string, int32_t>>::Decode(Bytes(bytes));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  DecodeOptions roomy;
  roomy.memory_factor = 16;
  auto fits = Codec<std::map<std::string, int32_t>>::Decode(Bytes(bytes), roomy);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->size(), dense.size());
  // The slack alone lets small payloads of any shape through.
  const std::string few_empty = MsgpackArrayOf(100, "\xa0");
  auto small = Codec<std::vector<std::string>>::Decode(Bytes(few_empty));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->size(), 100u);
  DecodeOptions tight;
  tight.memory_factor = 1;
  tight.memory_slack = 0;
  auto none = Codec<std::vector<std::string>>::Decode(Bytes(few_empty), tight);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("1x the payload + 0 bytes"),
            std::string_view::npos)
      << none.status();
  EXPECT_EQ(tight.MemoryLimit(10), 10u);
  DecodeOptions huge;
  huge.memory_slack = SIZE_MAX;
  EXPECT_EQ(huge.MemoryLimit(SIZE_MAX / 2), SIZE_MAX);  // saturates
}

struct KV {
  std::string k, v;
  MSGPACK_DEFINE(k, v);
};

TEST(CodecTest, MsgpackStructsMustComeWithTheirArity) {
  auto decode = [](const std::string& b) { return Codec<KV>::Decode(Bytes(b)); };
  auto ok = decode("\x92\xa1k\xa1v");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->k, "k");
  EXPECT_EQ(ok->v, "v");
  for (const std::string& bad :
       {std::string("\x90"), std::string("\x91\xa1k"),
        std::string("\x93\xa1k\xa1v\xa1x"), std::string("\x93\xa1k\xa1v\xc0")}) {
    auto r = decode(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("a struct of 2 element(s) came as an "
                                        "array of"),
              std::string_view::npos)
        << r.status();
  }
  // Nested, and tuples and pairs alike.
  auto nested = Codec<std::vector<KV>>::Decode(
      Bytes(std::string("\x92\x92\xa1k\xa1v\x93\xa1k\xa1v\xa1x")));
  EXPECT_EQ(nested.status().code(), absl::StatusCode::kInvalidArgument);
  auto tuple = Codec<std::tuple<int, int>>::Decode(Bytes(std::string("\x93\x01\x02\x03")));
  EXPECT_EQ(tuple.status().code(), absl::StatusCode::kInvalidArgument);
  auto tuple_ok = Codec<std::tuple<int, int>>::Decode(Bytes(std::string("\x92\x01\x02")));
  ASSERT_TRUE(tuple_ok.ok());
  EXPECT_EQ(std::get<1>(*tuple_ok), 2);
  auto pair = Codec<std::pair<int, int>>::Decode(Bytes(std::string("\x91\x01")));
  EXPECT_EQ(pair.status().code(), absl::StatusCode::kInvalidArgument);
}

// The direct decoder against msgpack-c's unpack + convert: for every input
// below, both accept or both refuse, with the same value.
template <typename T>
std::optional<T> ViaMsgpackC(const std::string& b) {
  try {
    msgpack::object_handle oh = msgpack::unpack(b.data(), b.size());
    T v{};
    oh.get().convert(v);
    return v;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

template <typename T>
void ExpectSameAsMsgpackC(const std::vector<std::string>& inputs) {
  for (const std::string& in : inputs) {
    std::optional<T> want = ViaMsgpackC<T>(in);
    // The msgpack decoder itself (Codec<T> of a scalar is its bytes).
    T got{};
    absl::Status st = internal::mp::Decode(Bytes(in), 1 << 20, 1, 0, got);
    EXPECT_EQ(st.ok(), want.has_value())
        << typeid(T).name() << " from " << absl::CHexEscape(in) << ": " << st;
    if (st.ok() && want.has_value()) {
      EXPECT_TRUE(got == *want) << typeid(T).name() << " from "
                                << absl::CHexEscape(in);
    }
  }
}

TEST(CodecTest, MsgpackDecodesLikeMsgpackC) {
  std::vector<std::string> in;
  auto add = [&in](const auto& v) {
    msgpack::sbuffer sb;
    msgpack::pack(sb, v);
    in.emplace_back(sb.data(), sb.size());
  };
  for (int64_t v : {int64_t{0}, int64_t{1}, int64_t{127}, int64_t{128},
                    int64_t{255}, int64_t{256}, int64_t{32767}, int64_t{32768},
                    int64_t{65535}, int64_t{65536}, int64_t{INT32_MAX},
                    int64_t{INT32_MAX} + 1, int64_t{UINT32_MAX},
                    int64_t{UINT32_MAX} + 1, INT64_MAX, int64_t{-1},
                    int64_t{-32}, int64_t{-33}, int64_t{-128}, int64_t{-129},
                    int64_t{-32768}, int64_t{-32769}, int64_t{INT32_MIN},
                    int64_t{INT32_MIN} - 1, INT64_MIN}) {
    add(v);
  }
  add(uint64_t{UINT64_MAX});
  add(1.5f);
  add(-2.25);
  add(1e300);
  add(true);
  add(false);
  add(msgpack::type::nil_t());
  add(std::string("text"));
  add(std::string(40, 'l'));
  add(std::vector<char>{'b', 'i', 'n'});
  add(std::vector<int>{1, -2, 300});
  add(std::vector<bool>{true, false});
  add(std::map<std::string, int>{{"a", 1}, {"b", 2}});
  in.push_back("\xd0\x05");          // int8 holding a non-negative value
  in.push_back("\x82\xa1k\x01\xa1k\x02");  // a repeated key: the last wins
  in.push_back("\x92\xc0\x01");      // [nil, 1]
  in.push_back("\xd4\x01\x02");      // fixext1
  ExpectSameAsMsgpackC<int8_t>(in);
  ExpectSameAsMsgpackC<uint8_t>(in);
  ExpectSameAsMsgpackC<char>(in);
  ExpectSameAsMsgpackC<int16_t>(in);
  ExpectSameAsMsgpackC<uint16_t>(in);
  ExpectSameAsMsgpackC<int32_t>(in);
  ExpectSameAsMsgpackC<uint32_t>(in);
  ExpectSameAsMsgpackC<int64_t>(in);
  ExpectSameAsMsgpackC<uint64_t>(in);
  ExpectSameAsMsgpackC<float>(in);
  ExpectSameAsMsgpackC<double>(in);
  ExpectSameAsMsgpackC<bool>(in);
  ExpectSameAsMsgpackC<std::string>(in);
  ExpectSameAsMsgpackC<std::vector<char>>(in);
  ExpectSameAsMsgpackC<std::vector<unsigned char>>(in);
  ExpectSameAsMsgpackC<std::vector<int>>(in);
  ExpectSameAsMsgpackC<std::vector<bool>>(in);
  ExpectSameAsMsgpackC<std::vector<std::optional<int>>>(in);
  ExpectSameAsMsgpackC<std::optional<std::string>>(in);
  ExpectSameAsMsgpackC<std::map<std::string, int>>(in);
  ExpectSameAsMsgpackC<std::unordered_map<std::string, int>>(in);
  ExpectSameAsMsgpackC<std::pair<std::optional<int>, int>>(in);
  ExpectSameAsMsgpackC<std::vector<Color>>(in);
}

// Types with msgpack adaptors of their own go through msgpack-c for their
// value, inside directly decoded containers and structs.
struct Keyed {
  std::string name;
  int32_t age = 0;
  MSGPACK_DEFINE_MAP(name, age);
  bool operator==(const Keyed&) const = default;
};

struct WithAdaptors {
  Color color = Color::kRed;
  std::array<int32_t, 3> triple{};
  Keyed keyed;
  MSGPACK_DEFINE(color, triple, keyed);
};

struct Base {
  int32_t id = 0;
  MSGPACK_DEFINE(id);
};
struct Derived : Base {
  std::string extra;
  MSGPACK_DEFINE(MSGPACK_BASE(Base), extra);
};

TEST(CodecTest, MsgpackOtherAdaptorsGoThroughMsgpackC) {
  WithAdaptors w;
  w.color = Color::kGreen;
  w.triple = {1, 2, 3};
  w.keyed = Keyed{"ann", 41};
  WithAdaptors back = RoundTrip(w);
  EXPECT_EQ(back.color, Color::kGreen);
  EXPECT_EQ(back.triple, (std::array<int32_t, 3>{1, 2, 3}));
  EXPECT_EQ(back.keyed, (Keyed{"ann", 41}));
  EXPECT_EQ(RoundTrip(Keyed{"bob", 7}), (Keyed{"bob", 7}));
  EXPECT_EQ(RoundTrip(std::vector<Keyed>{{"a", 1}, {"b", 2}}).size(), 2u);
  Derived d;
  d.id = 9;
  d.extra = "more";
  Derived dback = RoundTrip(d);
  EXPECT_EQ(dback.id, 9);
  EXPECT_EQ(dback.extra, "more");
  // A container through msgpack-c is charged its tree: 24 bytes an element.
  std::string many = "\x93\x01" + MsgpackArrayOf(1 << 20, "\x01") + "\x80";
  auto tree = Codec<WithAdaptors>::Decode(Bytes(many));
  EXPECT_FALSE(tree.ok());  // std::array<int32_t, 3> of 1M: refused
  EXPECT_EQ(tree.status().code(), absl::StatusCode::kResourceExhausted)
      << tree.status();
}

TEST(CodecTest, ProtobufScanRefusesWhatTheParseWould) {
  auto decode = [](const std::string& b) {
    return Codec<test::Batch>::Decode(Bytes(b));
  };
  // Sub-messages nested 101 deep (Batch.items = 1 holds an Item; an
  // unknown group nests without a schema).
  std::string deep;
  for (int i = 0; i < 101; ++i) deep += "\x7b";  // START_GROUP 15
  for (int i = 0; i < 101; ++i) deep += "\x7c";  // END_GROUP 15
  auto d = decode(deep);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
  std::string shallow;
  for (int i = 0; i < 10; ++i) shallow += "\x7b";
  for (int i = 0; i < 10; ++i) shallow += "\x7c";
  EXPECT_TRUE(decode(shallow).ok()) << decode(shallow).status();
  for (const std::string& bad :
       {std::string("\x0a\x05\x00", 3), std::string("\x0f"),
        std::string("\x00\x00", 2), std::string("\x7c"), std::string("\x7b"),
        std::string("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"),
        std::string("\x1a\x03\x01\x02\x80")}) {
    auto r = decode(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << absl::CHexEscape(bad) << ": " << r.status();
    EXPECT_NE(r.status().message().find("coverbs.rpc.test.Batch"),
              std::string_view::npos);
  }
  // Repeated scalars packed and unpacked, a known field with another wire
  // type (kept as unknown by the parse).
  test::Batch b;
  b.add_weights(1);
  b.add_weights(2);
  std::string packed = b.SerializeAsString();
  std::string unpacked = "\x1d" + std::string("\x00\x00\x80\x3f", 4) + "\x1d" +
                         std::string("\x00\x00\x00\x40", 4);
  std::string mismatched = std::string("\x10\x05", 2);  // note as a varint
  for (const std::string& good : {packed, unpacked, mismatched}) {
    auto r = decode(good);
    ASSERT_TRUE(r.ok()) << absl::CHexEscape(good) << ": " << r.status();
  }
  EXPECT_EQ(decode(unpacked)->weights_size(), 2);
}

// Messages without descriptors (the lite runtime) are scanned without a
// schema: every field charged as if unknown, length-delimited fields that
// read as messages scanned as such.
struct NoSchema {
  char object[48];
};

TEST(CodecTest, ProtobufWithoutDescriptorsGetsASchemalessEstimate) {
  auto check = [](const std::string& b) {
    return internal::pb::Check<NoSchema>(
        Bytes(b), "NoSchema", DecodeOptions().ProtobufMemoryLimit(b.size()), 16,
        64 << 10);
  };
  std::string items;
  for (size_t i = 0; i < kN; ++i) items.append("\x0a\x00", 2);
  EXPECT_EQ(check(items).code(), absl::StatusCode::kResourceExhausted);
  std::string nested;  // field 1 holding {field 1: 5} a million times
  for (size_t i = 0; i < kN; ++i) nested.append("\x0a\x02\x08\x05", 4);
  EXPECT_EQ(check(nested).code(), absl::StatusCode::kResourceExhausted);
  test::KvPut put;  // a few fields and a large value
  put.set_key("key");
  put.set_value(std::string(kN, 'v'));
  EXPECT_TRUE(check(put.SerializeAsString()).ok());
  EXPECT_EQ(check(std::string("\x0a\x05\x00", 3)).code(),
            absl::StatusCode::kInvalidArgument);
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
