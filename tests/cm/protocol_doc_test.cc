// cm/PROTOCOL.md against the code: every constant in its constants table,
// and every field of its layout tables (offset and size), must be what
// cm/wire.h, cm/handshake.h, transport/connector.h and rpc/wire.h say --
// checked on encoded bytes where the code encodes by hand. A row the test
// does not know, or a field or constant the document lacks, fails too.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cm/connection.h"
#include "cm/handshake.h"
#include "cm/wire.h"
#include "gtest/gtest.h"
#include "rpc/wire.h"
#include "transport/connector.h"

namespace coverbs::cm {
namespace {

using internal::CtsPayload;
using internal::GrantPayload;
using internal::WireHeader;

std::string ReadDoc() {
  std::ifstream in("cm/PROTOCOL.md");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Trim(std::string s) {
  return std::string(absl::StripAsciiWhitespace(s));
}

// The rows of the table right after the marker `<!-- name -->`: cells
// split on '|', the header and separator rows skipped.
std::vector<std::vector<std::string>> Table(const std::string& doc,
                                            const std::string& name) {
  std::vector<std::vector<std::string>> rows;
  const std::string marker = "<!-- " + name + " -->";
  size_t at = doc.find(marker);
  if (at == std::string::npos) return rows;
  std::istringstream lines(doc.substr(at + marker.size()));
  std::string line;
  int seen = 0;
  while (std::getline(lines, line)) {
    line = Trim(line);
    if (line.empty() && seen == 0) continue;
    if (line.empty() || line[0] != '|') break;
    if (++seen <= 2) continue;  // header, separator
    std::vector<std::string> cells = absl::StrSplit(line, '|');
    std::vector<std::string> out;
    for (size_t i = 1; i + 1 < cells.size(); ++i) out.push_back(Trim(cells[i]));
    rows.push_back(out);
  }
  return rows;
}

uint64_t Number(std::string s) {
  s = std::string(absl::StripPrefix(absl::StripSuffix(s, "`"), "`"));
  uint64_t v = 0;
  if (absl::StartsWith(s, "0x")) {
    EXPECT_TRUE(absl::SimpleHexAtoi(s.substr(2), &v)) << s;
  } else {
    EXPECT_TRUE(absl::SimpleAtoi(s, &v)) << s;
  }
  return v;
}

struct Field {
  size_t offset;
  size_t size;
};

// Checks the layout table `name` against `want` (field -> offset, size).
void CheckLayout(const std::string& doc, const std::string& name,
                 const std::map<std::string, Field>& want) {
  auto rows = Table(doc, "layout: " + name);
  ASSERT_FALSE(rows.empty()) << "no table marked layout: " << name;
  std::map<std::string, Field> got;
  for (const auto& r : rows) {
    ASSERT_GE(r.size(), 3u);
    const std::string field = r[2];
    if (!want.count(field)) {
      ADD_FAILURE() << name << ": the document has a field " << field
                    << " the code does not";
      continue;
    }
    // A size that is another field's name (a variable-length tail).
    const size_t size = want.count(r[1]) ? 0 : Number(r[1]);
    got[field] = {Number(r[0]), size};
  }
  for (const auto& [field, f] : want) {
    auto it = got.find(field);
    if (it == got.end()) {
      ADD_FAILURE() << name << ": the document lacks field " << field;
      continue;
    }
    EXPECT_EQ(it->second.offset, f.offset) << name << "." << field;
    EXPECT_EQ(it->second.size, f.size) << name << "." << field;
  }
}

template <typename T>
T Load(const std::string& bytes, size_t off) {
  T v{};
  std::memcpy(&v, bytes.data() + off, sizeof(T));
  return v;
}

TEST(ProtocolDocTest, Constants) {
  const std::string doc = ReadDoc();
  ASSERT_FALSE(doc.empty()) << "cm/PROTOCOL.md not found";
  const std::map<std::string, uint64_t> want = {
      {"kProtocolVersion", kProtocolVersion},
      {"kHandshakeMagic", kHandshakeMagic},
      {"kHandshakeSize", kHandshakeSize},
      {"kMaxAppData", kMaxAppData},
      {"kCapWriteWithImm", kCapWriteWithImm},
      {"kCapAtomics", kCapAtomics},
      {"kRejectMagic", transport::kRejectMagic},
      {"kMaxRejectReason", transport::kMaxRejectReason},
      {"kHeaderSize", internal::kHeaderSize},
      {"kData", internal::kData},
      {"kCredit", internal::kCredit},
      {"kRts", internal::kRts},
      {"kCts", internal::kCts},
      {"kDone", internal::kDone},
      {"kHello", internal::kHello},
      {"kGoodbye", internal::kGoodbye},
      {"kLanded", internal::kLanded},
      {"kFlagRefused", internal::kFlagRefused},
      {"kFlagAborted", internal::kFlagAborted},
      {"kFlagCreditLow", internal::kFlagCreditLow},
      {"kFlagPing", internal::kFlagPing},
      {"kCtsSize", internal::kCtsSize},
      {"kGrantSize", internal::kGrantSize},
      {"kGrantInvalidate", internal::kGrantInvalidate},
      {"kMaxGrantsPerMessage", internal::kMaxGrantsPerMessage},
      {"kMaxGrantsHeld", internal::kMaxGrantsHeld},
      {"kCreditReserve", internal::kCreditReserve},
      {"kCtsReserve", internal::kCtsReserve},
      // What ConnectionImpl posts: 16 + threshold, rounded up to 64.
      {"defaultRecvBufferSize",
       (internal::kHeaderSize + ConnectionOptions{}.rendezvous_threshold + 63) &
           ~size_t{63}},
      {"rpc kFrameMagic", rpc::kFrameMagic},
      {"rpc kWireVersion", rpc::kWireVersion},
      {"rpc kHeaderSize", rpc::kHeaderSize},
      {"rpc kMaxErrorMessage", rpc::kMaxErrorMessage},
      {"rpc MethodId(\"Echo\")", rpc::MethodId("Echo")},
  };
  std::map<std::string, uint64_t> got;
  for (const auto& r : Table(doc, "constants")) {
    ASSERT_GE(r.size(), 2u);
    std::string name(absl::StripPrefix(absl::StripSuffix(r[0], "`"), "`"));
    got[name] = Number(r[1]);
  }
  for (const auto& [name, v] : got) {
    auto it = want.find(name);
    if (it == want.end()) {
      ADD_FAILURE() << "the document's constant " << name
                    << " is not checked against the code";
      continue;
    }
    EXPECT_EQ(v, it->second) << name;
  }
  for (const auto& [name, v] : want) {
    EXPECT_TRUE(got.count(name)) << "the document lacks constant " << name;
  }
  // The title names the version.
  EXPECT_NE(doc.find("(version " + std::to_string(kProtocolVersion) + ")"),
            std::string::npos);
}

TEST(ProtocolDocTest, CmLayouts) {
  const std::string doc = ReadDoc();
  CheckLayout(doc, "header",
              {{"type", {offsetof(WireHeader, type), 1}},
               {"flags", {offsetof(WireHeader, flags), 1}},
               {"credits", {offsetof(WireHeader, credits), 2}},
               {"length", {offsetof(WireHeader, length), 4}},
               {"credit_acks", {offsetof(WireHeader, credit_acks), 4}},
               {"cookie", {offsetof(WireHeader, cookie), 4}}});
  CheckLayout(doc, "cts",
              {{"addr", {offsetof(CtsPayload, addr), 8}},
               {"rkey", {offsetof(CtsPayload, rkey), 4}},
               {"reserved", {offsetof(CtsPayload, reserved), 4}}});
  CheckLayout(doc, "grant",
              {{"addr", {offsetof(GrantPayload, addr), 8}},
               {"rkey", {offsetof(GrantPayload, rkey), 4}},
               {"size", {offsetof(GrantPayload, size), 4}}});
}

// The handshake is encoded by hand: check the bytes at the document's
// offsets.
TEST(ProtocolDocTest, HandshakeBytes) {
  const std::string doc = ReadDoc();
  CheckLayout(doc, "handshake",
              {{"magic", {0, 4}},
               {"version", {4, 2}},
               {"app_data_len", {6, 2}},
               {"caps", {8, 4}},
               {"credits", {12, 4}},
               {"recv_buffer_size", {16, 4}},
               {"max_credits", {20, 4}},
               {"max_message_size", {24, 8}}});
  Handshake h;
  h.caps = 0x01020304;
  h.credits = 0x11;
  h.max_credits = 0x22;
  h.recv_buffer_size = 0x3344;
  h.max_message_size = 0x5566778899ull;
  h.app_data = "abc";
  auto b = EncodeHandshake(h);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->size(), kHandshakeSize + 3);
  EXPECT_EQ(Load<uint32_t>(*b, 0), kHandshakeMagic);
  EXPECT_EQ(Load<uint16_t>(*b, 4), kProtocolVersion);
  EXPECT_EQ(Load<uint16_t>(*b, 6), 3);
  EXPECT_EQ(Load<uint32_t>(*b, 8), h.caps);
  EXPECT_EQ(Load<uint32_t>(*b, 12), h.credits);
  EXPECT_EQ(Load<uint32_t>(*b, 16), h.recv_buffer_size);
  EXPECT_EQ(Load<uint32_t>(*b, 20), h.max_credits);
  EXPECT_EQ(Load<uint64_t>(*b, 24), h.max_message_size);
  EXPECT_EQ(b->substr(32), "abc");
}

TEST(ProtocolDocTest, RejectBytes) {
  const std::string doc = ReadDoc();
  CheckLayout(doc, "reject",
              {{"magic", {0, 4}}, {"length", {4, 2}}, {"reason", {6, 0}}});
  std::string r = transport::EncodeReject("no room");
  EXPECT_EQ(Load<uint32_t>(r, 0), transport::kRejectMagic);
  EXPECT_EQ(Load<uint16_t>(r, 4), 7);
  EXPECT_EQ(r.substr(6), "no room");
}

TEST(ProtocolDocTest, RpcHeaderBytes) {
  const std::string doc = ReadDoc();
  CheckLayout(doc, "rpc_header",
              {{"magic", {0, 4}},
               {"version", {4, 1}},
               {"type", {5, 1}},
               {"flags", {6, 2}},
               {"call_id", {8, 8}},
               {"method_id", {16, 4}},
               {"status", {20, 4}},
               {"payload_len", {24, 4}},
               {"reserved", {28, 4}}});
  rpc::HeaderBytes hb =
      rpc::RequestHeader(0x0102030405060708ull, rpc::MethodId("Echo"), 64);
  std::string b(reinterpret_cast<const char*>(hb.data()), hb.size());
  EXPECT_EQ(Load<uint32_t>(b, 0), rpc::kFrameMagic);
  EXPECT_EQ(static_cast<uint8_t>(b[4]), rpc::kWireVersion);
  EXPECT_EQ(static_cast<uint8_t>(b[5]), 1);  // request
  EXPECT_EQ(Load<uint16_t>(b, 6), 0);
  EXPECT_EQ(Load<uint64_t>(b, 8), 0x0102030405060708ull);
  EXPECT_EQ(Load<uint32_t>(b, 16), rpc::MethodId("Echo"));
  EXPECT_EQ(Load<uint32_t>(b, 20), 0u);
  EXPECT_EQ(Load<uint32_t>(b, 24), 64u);
  EXPECT_EQ(Load<uint32_t>(b, 28), 0u);
}

}  // namespace
}  // namespace coverbs::cm
