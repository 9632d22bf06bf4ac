// rpc::Payload's owning forms through moves: the view must follow its
// bytes (a short string's live in the object itself) and a moved-from
// payload must be empty. (Held messages are covered end to end in
// rpc_test.)
#include "rpc/payload.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace coverbs::rpc {
namespace {

TEST(PayloadTest, EmptyByDefault) {
  Payload p;
  EXPECT_TRUE(p.empty());
  EXPECT_EQ(p.size(), 0u);
  EXPECT_FALSE(p.zero_copy());
  EXPECT_EQ(p.view(), "");
}

TEST(PayloadTest, ShortAndLongStringsSurviveMoves) {
  for (std::string s : {std::string("short"), std::string(1000, 'x')}) {
    Payload a(s);
    Payload b(std::move(a));
    EXPECT_EQ(b.view(), s);
    EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)
    Payload c;
    c = std::move(b);
    EXPECT_EQ(c.view(), s);
    EXPECT_EQ(c.ToString(), s);
    EXPECT_TRUE(b.empty());  // NOLINT(bugprone-use-after-move)
    EXPECT_FALSE(c.zero_copy());
  }
}

TEST(PayloadTest, BytesSurviveMoves) {
  std::vector<std::byte> v(100, std::byte{7});
  Payload a(v);
  Payload b = std::move(a);
  ASSERT_EQ(b.size(), 100u);
  EXPECT_EQ(b.data()[99], std::byte{7});
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)
}

TEST(PayloadTest, CopiesOwnTheirBytes) {
  std::string s = "copied";
  Payload a = Payload::Copy(std::string_view(s));
  Payload b = Payload::Copy(std::as_bytes(std::span(s)));
  s = "changed";
  EXPECT_EQ(a.view(), "copied");
  EXPECT_EQ(b.view(), "copied");
}

TEST(PayloadTest, AssignmentReplacesEveryForm) {
  Payload p(std::string("a string"));
  p = Payload(std::vector<std::byte>(3, std::byte{1}));
  EXPECT_EQ(p.size(), 3u);
  p = Payload(std::string("tiny"));
  EXPECT_EQ(p.view(), "tiny");
  p = Payload();
  EXPECT_TRUE(p.empty());
  Payload& self = p;
  p = std::move(self);
  EXPECT_TRUE(p.empty());
}

}  // namespace
}  // namespace coverbs::rpc
