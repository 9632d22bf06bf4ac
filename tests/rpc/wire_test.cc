// Unit tests of the rpc wire format (rpc/wire.h): encoding, every validation
// rule of the decoder, and a fuzz-style sweep of random and truncated frames.
#include "rpc/wire.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace coverbs::rpc {
namespace {

std::vector<std::byte> Frame(const HeaderBytes& h, size_t payload_len,
                             std::byte fill = std::byte{0x42}) {
  std::vector<std::byte> v(kHeaderSize + payload_len, fill);
  std::memcpy(v.data(), h.data(), kHeaderSize);
  return v;
}

std::vector<std::byte> Bytes(const std::string& s) {
  std::vector<std::byte> v(s.size());
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

void Put32(std::vector<std::byte>& v, size_t off, uint32_t x) {
  for (int i = 0; i < 4; ++i) v[off + i] = static_cast<std::byte>(x >> (8 * i));
}

TEST(WireTest, HeaderLayoutIsLittleEndianAtDocumentedOffsets) {
  HeaderBytes h = EncodeHeader({FrameType::kError, 0, 0x0102030405060708ull,
                                0xa1b2c3d4, 5, 0x11223344});
  EXPECT_EQ(h[0], std::byte{'C'});
  EXPECT_EQ(h[1], std::byte{'V'});
  EXPECT_EQ(h[2], std::byte{'R'});
  EXPECT_EQ(h[3], std::byte{'P'});
  EXPECT_EQ(h[4], std::byte{kWireVersion});
  EXPECT_EQ(h[5], std::byte{3});
  EXPECT_EQ(h[8], std::byte{0x08});
  EXPECT_EQ(h[15], std::byte{0x01});
  EXPECT_EQ(h[16], std::byte{0xd4});
  EXPECT_EQ(h[20], std::byte{5});
  EXPECT_EQ(h[24], std::byte{0x44});
  EXPECT_EQ(h[27], std::byte{0x11});
  for (int i = 28; i < 32; ++i) EXPECT_EQ(h[i], std::byte{0});
}

TEST(WireTest, RequestRoundTripsWithZeroCopyPayload) {
  auto v = Frame(RequestHeader(77, MethodId("Echo"), 5), 5);
  auto f = DecodeFrame(v, Side::kServer);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->header.type, FrameType::kRequest);
  EXPECT_EQ(f->header.call_id, 77u);
  EXPECT_EQ(f->header.method_id, MethodId("Echo"));
  EXPECT_EQ(f->payload.size(), 5u);
  EXPECT_EQ(f->payload.data(), v.data() + kHeaderSize);  // a view, no copy
}

TEST(WireTest, EmptyPayloadAndCancel) {
  auto req = Frame(RequestHeader(1, MethodId("A"), 0), 0);
  ASSERT_TRUE(DecodeFrame(req, Side::kServer).ok());
  auto c = Frame(CancelHeader(1, MethodId("A")), 0);
  auto f = DecodeFrame(c, Side::kServer);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->header.type, FrameType::kCancel);
}

TEST(WireTest, ResponseAndErrorDecodeOnTheClient) {
  auto r = Frame(ResponseHeader(9, 3, 2), 2);
  ASSERT_TRUE(DecodeFrame(r, Side::kClient).ok());
  auto e = Bytes(EncodeError(9, 3, absl::NotFoundError("no method Foo")));
  auto f = DecodeFrame(e, Side::kClient);
  ASSERT_TRUE(f.ok()) << f.status();
  absl::Status s = StatusFromErrorFrame(*f);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no method Foo");
}

TEST(WireTest, ConnectionLevelErrorHasCallIdZero) {
  auto e = Bytes(EncodeError(0, 0, absl::InvalidArgumentError("bad frame")));
  auto f = DecodeFrame(e, Side::kClient);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->header.call_id, 0u);
  // ... but it must not name a method.
  auto bad = Bytes(EncodeError(0, 5, absl::InvalidArgumentError("x")));
  EXPECT_EQ(DecodeFrame(bad, Side::kClient).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, OkStatusIsNeverEncodedAsSuccess) {
  auto e = Bytes(EncodeError(1, 1, absl::OkStatus()));
  auto f = DecodeFrame(e, Side::kClient);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(StatusFromErrorFrame(*f).code(), absl::StatusCode::kUnknown);
}

TEST(WireTest, LongErrorMessagesAreTruncated) {
  std::string m(kMaxErrorMessage + 100, 'x');
  auto e = Bytes(EncodeError(1, 1, absl::InternalError(m)));
  EXPECT_EQ(e.size(), kHeaderSize + kMaxErrorMessage);
  EXPECT_TRUE(DecodeFrame(e, Side::kClient).ok());
}

TEST(WireTest, MethodIdIsStableAndNeverZero) {
  EXPECT_EQ(MethodId("Echo"), MethodId(std::string("Echo")));
  EXPECT_NE(MethodId("Echo"), MethodId("echo"));
  EXPECT_EQ(MethodId(""), 2166136261u);  // FNV-1a offset basis
  EXPECT_NE(MethodId(""), 0u);
}

void ExpectInvalid(const std::vector<std::byte>& v, Side side,
                   const std::string& needle,
                   absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  auto f = DecodeFrame(v, side, DecodeLimits{1024});
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), code) << f.status();
  EXPECT_NE(f.status().message().find(needle), std::string::npos)
      << f.status();
}

TEST(WireTest, RejectsEveryMalformedField) {
  auto good = Frame(RequestHeader(5, 9, 4), 4);
  ASSERT_TRUE(DecodeFrame(good, Side::kServer).ok());

  ExpectInvalid({}, Side::kServer, "truncated");
  ExpectInvalid(std::vector<std::byte>(good.begin(), good.begin() + 31),
                Side::kServer, "truncated");
  auto v = good;
  v[0] = std::byte{'X'};
  ExpectInvalid(v, Side::kServer, "magic");
  v = good;
  v[4] = std::byte{2};
  ExpectInvalid(v, Side::kServer, "version 2");
  v = good;
  v[5] = std::byte{0};
  ExpectInvalid(v, Side::kServer, "type 0");
  v[5] = std::byte{5};
  ExpectInvalid(v, Side::kServer, "type 5");
  v = good;
  v[6] = std::byte{1};
  ExpectInvalid(v, Side::kServer, "flags");
  v = good;
  v[30] = std::byte{1};
  ExpectInvalid(v, Side::kServer, "reserved");
  // Payload shorter and longer than payload_len.
  v = good;
  v.pop_back();
  ExpectInvalid(v, Side::kServer, "payload_len 4");
  v = good;
  v.push_back(std::byte{0});
  ExpectInvalid(v, Side::kServer, "payload_len 4");
  // Oversized: above the limit, whatever the message size.
  v = Frame(RequestHeader(5, 9, 2000), 2000);
  ExpectInvalid(v, Side::kServer, "limit is 1024",
                absl::StatusCode::kResourceExhausted);
  v = Frame(RequestHeader(5, 9, 0xffffffff), 0);
  ExpectInvalid(v, Side::kServer, "4294967295 bytes",
                absl::StatusCode::kResourceExhausted);
  // Reserved ids.
  ExpectInvalid(Frame(RequestHeader(0, 9, 0), 0), Side::kServer, "call id 0");
  ExpectInvalid(Frame(RequestHeader(1, 0, 0), 0), Side::kServer, "method id 0");
  ExpectInvalid(Frame(CancelHeader(1, 0), 0), Side::kServer, "method id 0");
  ExpectInvalid(Frame(ResponseHeader(0, 9, 0), 0), Side::kClient, "call id 0");
  // Status only in errors, and a valid code there.
  v = good;
  Put32(v, 20, 3);
  ExpectInvalid(v, Side::kServer, "status code 3");
  auto e = Bytes(EncodeError(1, 1, absl::InternalError("x")));
  Put32(e, 20, 0);
  ExpectInvalid(e, Side::kClient, "status code 0");
  Put32(e, 20, 17);
  ExpectInvalid(e, Side::kClient, "status code 17");
  // A cancel has no payload.
  v = Frame(CancelHeader(1, 9), 0);
  Put32(v, 24, 3);
  v.resize(kHeaderSize + 3);
  ExpectInvalid(v, Side::kServer, "cancel");
  // Error message too long (valid otherwise).
  auto longerr = Frame(EncodeHeader({FrameType::kError, 0, 1, 1, 2,
                                     kMaxErrorMessage + 1}),
                       kMaxErrorMessage + 1);
  auto f = DecodeFrame(longerr, Side::kClient, DecodeLimits{1 << 20});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, EachSideAcceptsOnlyItsFrameTypes) {
  ExpectInvalid(Frame(ResponseHeader(1, 1, 0), 0), Side::kServer,
                "server does not accept rpc response");
  ExpectInvalid(Bytes(EncodeError(1, 1, absl::InternalError("x"))),
                Side::kServer, "server does not accept rpc error");
  ExpectInvalid(Frame(RequestHeader(1, 1, 0), 0), Side::kClient,
                "client does not accept rpc request");
  ExpectInvalid(Frame(CancelHeader(1, 1), 0), Side::kClient,
                "client does not accept rpc cancel");
}

TEST(WireTest, PeekHeaderRecoversTheCallIdOfAnInvalidFrame) {
  auto v = Frame(RequestHeader(1234, 9, 4), 4);
  v[6] = std::byte{1};  // bad flags
  EXPECT_FALSE(DecodeFrame(v, Side::kServer).ok());
  auto h = PeekHeader(v);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->call_id, 1234u);
}

// Fuzz-style: random bytes, random truncations and random field values of
// valid frames. The decoder must never crash (ASan config checks memory
// safety), and everything it accepts must be self-consistent.
TEST(WireTest, RandomAndTruncatedFramesNeverCrashTheServerDecoder) {
  std::mt19937_64 rng(42);
  std::vector<std::vector<std::byte>> seeds = {
      Frame(RequestHeader(1, MethodId("Echo"), 0), 0),
      Frame(RequestHeader(2, MethodId("Echo"), 100), 100),
      Frame(CancelHeader(3, MethodId("Echo")), 0),
  };
  size_t accepted = 0, rejected = 0;
  for (int i = 0; i < 200000; ++i) {
    std::vector<std::byte> v;
    switch (rng() % 4) {
      case 0: {  // random bytes
        v.resize(rng() % 80);
        for (auto& b : v) b = static_cast<std::byte>(rng());
        break;
      }
      case 1: {  // truncated valid frame
        v = seeds[rng() % seeds.size()];
        v.resize(rng() % (v.size() + 1));
        break;
      }
      default: {  // valid frame with random field bytes
        v = seeds[rng() % seeds.size()];
        int n = 1 + rng() % 3;
        for (int k = 0; k < n; ++k) {
          v[rng() % kHeaderSize] = static_cast<std::byte>(rng());
        }
        break;
      }
    }
    auto f = DecodeFrame(v, Side::kServer, DecodeLimits{64});
    if (!f.ok()) {
      ++rejected;
      ASSERT_FALSE(f.status().message().empty());
      continue;
    }
    ++accepted;
    ASSERT_GE(v.size(), kHeaderSize);
    ASSERT_EQ(f->payload.size(), v.size() - kHeaderSize);
    ASSERT_LE(f->payload.size(), 64u);
    ASSERT_NE(f->header.call_id, 0u);
    ASSERT_NE(f->header.method_id, 0u);
    ASSERT_TRUE(f->header.type == FrameType::kRequest ||
                f->header.type == FrameType::kCancel);
    HeaderBytes again = EncodeHeader(f->header);
    ASSERT_EQ(std::memcmp(again.data(), v.data(), kHeaderSize), 0);
  }
  // Both paths were exercised (the mutations keep many frames valid).
  EXPECT_GT(accepted, 1000u);
  EXPECT_GT(rejected, 1000u);
}

}  // namespace
}  // namespace coverbs::rpc
