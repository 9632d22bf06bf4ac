#include "cm/handshake.h"

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "transport/connector.h"

namespace coverbs::cm {
namespace {

std::span<const std::byte> B(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

Handshake Valid() {
  Handshake h;
  h.caps = kCapWriteWithImm;
  h.credits = 64;
  h.recv_buffer_size = 8256;
  h.max_message_size = 64ull << 20;
  h.app_data = "tenant-7";
  return h;
}

TEST(Handshake, RoundTrips) {
  auto enc = EncodeHandshake(Valid());
  ASSERT_TRUE(enc.ok());
  EXPECT_LE(enc->size(), 56u);  // fits IB's connect private data
  auto d = DecodeHandshake(B(*enc));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->credits, 64u);
  EXPECT_EQ(d->max_credits, 64u);  // unset: the initial grant
  EXPECT_EQ(d->recv_buffer_size, 8256u);
  EXPECT_EQ(d->max_message_size, 64ull << 20);
  EXPECT_EQ(d->caps, kCapWriteWithImm);
  EXPECT_EQ(d->app_data, "tenant-7");
  // Transports may pad private data.
  std::string padded = *enc + std::string(20, '\0');
  EXPECT_TRUE(DecodeHandshake(B(padded)).ok());
}

TEST(Handshake, CarriesAWindowAboveTheInitialGrant) {
  Handshake h = Valid();
  h.credits = 4;
  h.max_credits = 64;
  auto d = DecodeHandshake(B(*EncodeHandshake(h)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->credits, 4u);
  EXPECT_EQ(d->max_credits, 64u);
}

TEST(Handshake, RejectsTooMuchAppData) {
  Handshake h = Valid();
  h.app_data = std::string(kMaxAppData + 1, 'x');
  EXPECT_EQ(EncodeHandshake(h).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Handshake, VersionMismatchNamesBothVersions) {
  Handshake h = Valid();
  h.version = kProtocolVersion + 1;
  auto enc = EncodeHandshake(h);
  ASSERT_TRUE(enc.ok());
  auto d = DecodeHandshake(B(*enc));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(d.status().message())
                .find(absl::StrCat("peer speaks ", kProtocolVersion + 1,
                                   ", local ", kProtocolVersion)),
            std::string::npos)
      << d.status();
}

TEST(Handshake, RejectsBadFields) {
  auto enc = *EncodeHandshake(Valid());
  EXPECT_FALSE(DecodeHandshake(B(enc.substr(0, 20))).ok());  // truncated
  EXPECT_FALSE(DecodeHandshake(B(enc.substr(0, 3))).ok());
  std::string bad_magic = enc;
  bad_magic[0] ^= 1;
  EXPECT_NE(std::string(DecodeHandshake(B(bad_magic)).status().message())
                .find("bad magic"),
            std::string::npos);
  Handshake z = Valid();
  z.credits = 0;
  EXPECT_FALSE(DecodeHandshake(B(*EncodeHandshake(z))).ok());
  z = Valid();
  z.max_credits = 63;  // below the initial grant
  auto below = DecodeHandshake(B(*EncodeHandshake(z)));
  EXPECT_EQ(below.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(below.status().message())
                .find("at most 63 credits, but 64 granted"),
            std::string::npos)
      << below.status();
  z = Valid();
  z.recv_buffer_size = 8;
  EXPECT_FALSE(DecodeHandshake(B(*EncodeHandshake(z))).ok());
  z = Valid();
  z.max_message_size = 0;
  EXPECT_FALSE(DecodeHandshake(B(*EncodeHandshake(z))).ok());
  std::string long_app = enc;
  long_app[6] = 100;  // app data length beyond the data
  EXPECT_FALSE(DecodeHandshake(B(long_app)).ok());
}

// The status of decoding `h`, which must be a refusal whose message
// contains `what`.
void ExpectRefused(const Handshake& h, const std::string& what) {
  auto d = DecodeHandshake(B(*EncodeHandshake(h)));
  ASSERT_FALSE(d.ok()) << "accepted, expected a refusal naming " << what;
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(d.status().message()).find(what), std::string::npos)
      << d.status();
}

TEST(Handshake, CreditsAboveTheBoundAreRefusedNamingIt) {
  Handshake h = Valid();
  h.credits = 0xffffffff;
  ExpectRefused(h, "4294967295 receive credits, outside [1, 16384]");
  h.credits = kMaxHandshakeCredits + 1;
  ExpectRefused(h, "16385 receive credits, outside [1, 16384]");
  h.credits = kMaxHandshakeCredits;
  auto at_bound = DecodeHandshake(B(*EncodeHandshake(h)));
  ASSERT_TRUE(at_bound.ok()) << at_bound.status();
  EXPECT_EQ(at_bound->credits, kMaxHandshakeCredits);
  h = Valid();
  h.max_credits = kMaxHandshakeCredits + 1;
  ExpectRefused(h, "max_credits must be in [credits, 16384]");
}

TEST(Handshake, AHugeReceiveBufferIsClampedToWhatIsEverUsed) {
  Handshake h = Valid();
  h.recv_buffer_size = 0xffffffff;
  auto d = DecodeHandshake(B(*EncodeHandshake(h)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->recv_buffer_size, kMaxUsedRecvBufferSize);
  h.recv_buffer_size = 16;  // the header alone
  ExpectRefused(h, "do not hold the 16-byte message header");
}

TEST(Handshake, MessageSizeAboveTheWireLimitIsRefusedNamingIt) {
  Handshake h = Valid();
  h.max_message_size = ~0ull;
  ExpectRefused(h,
                "max message size 18446744073709551615, outside [1, "
                "4294967295]");
  h.max_message_size = 0;
  ExpectRefused(h, "max message size 0, outside [1, 4294967295]");
  h.max_message_size = kMaxHandshakeMessageSize;
  EXPECT_TRUE(DecodeHandshake(B(*EncodeHandshake(h))).ok());
}

TEST(Handshake, UnknownCapabilityBitsAreRefused) {
  Handshake h = Valid();
  h.caps = 0xffffffff;
  ExpectRefused(h, "unknown capability bits 0xfffffffc (known: 0x3)");
  h.caps = 1u << 31;
  ExpectRefused(h, "unknown capability bits 0x80000000");
  h.caps = kKnownCaps;
  auto d = DecodeHandshake(B(*EncodeHandshake(h)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->caps, kKnownCaps);
}

TEST(Handshake, RandomAndTruncatedInputNeverCrash) {
  std::mt19937 rng(12345);
  auto enc = *EncodeHandshake(Valid());
  int ok = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    if (i % 2 == 0) {
      s = enc.substr(0, rng() % (enc.size() + 1));
      if (!s.empty() && i % 4 == 0) s[rng() % s.size()] ^= 1 << (rng() % 8);
    } else {
      s.resize(rng() % 80);
      for (char& c : s) c = static_cast<char>(rng());
    }
    if (DecodeHandshake(B(s)).ok()) ++ok;
    transport::DecodeReject(B(s));
  }
  EXPECT_LT(ok, 20000);
}

// The reject payload both connectors send (transport/connector.h).
TEST(Reject, RoundTripsAndTruncates) {
  using transport::DecodeReject;
  using transport::EncodeReject;
  EXPECT_EQ(DecodeReject(B(EncodeReject("server is full"))), "server is full");
  std::string long_reason(500, 'r');
  EXPECT_EQ(DecodeReject(B(EncodeReject(long_reason))).size(),
            transport::kMaxRejectReason);
  EXPECT_EQ(DecodeReject(B(std::string("garbage"))), "");
}

}  // namespace
}  // namespace coverbs::cm
