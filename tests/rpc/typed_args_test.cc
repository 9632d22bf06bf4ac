// transport::RemoteRegion as a msgpack value: inside structs and vectors,
// and refused without a crash when it is not a 20-byte bin of a valid
// range.
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "rpc/codec.h"

namespace coverbs::rpc {
namespace {

using transport::RemoteRegion;

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

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span(s));
}

std::string Bin(const std::string& bytes) {
  return std::string("\xc4") + static_cast<char>(bytes.size()) + bytes;
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

}  // namespace
}  // namespace coverbs::rpc
