#include "daemon/session.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tierd {
namespace {

TEST(SessionTest, TokensAreUniqueAndAuthenticate) {
  SessionRegistry registry;
  auto a = *registry.Open({1000, 1000, 11}, "a");
  auto b = *registry.Open({1000, 1000, 12}, "b");
  EXPECT_NE(a->id, b->id);
  EXPECT_NE(a->TokenHex(), b->TokenHex());
  EXPECT_EQ(a->TokenHex().size(), 2u * kSessionTokenBytes);
  auto found = registry.Authenticate(absl::StrCat(a->id, ":", a->TokenHex()));
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ((*found)->id, a->id);
}

TEST(SessionTest, AnotherSessionsTokenDoesNotAuthenticate) {
  SessionRegistry registry;
  auto a = *registry.Open({1000, 1000, 11}, "a");
  auto b = *registry.Open({1000, 1000, 12}, "b");
  EXPECT_TRUE(absl::IsPermissionDenied(
      registry.Authenticate(absl::StrCat(a->id, ":", b->TokenHex())).status()));
}

TEST(SessionTest, MalformedCredentialsAreDenied) {
  SessionRegistry registry;
  auto a = *registry.Open({1000, 1000, 11}, "a");
  std::string good = a->TokenHex();
  for (const std::string& bad :
       {std::string(""), std::string("1"), absl::StrCat(a->id), absl::StrCat(a->id, ":"),
        absl::StrCat("x:", good), absl::StrCat(a->id, ":", good.substr(1)),
        absl::StrCat(a->id, ":", std::string(good.size(), 'z')),
        absl::StrCat(a->id + 100, ":", good)}) {
    EXPECT_TRUE(absl::IsPermissionDenied(registry.Authenticate(bad).status())) << bad;
  }
}

TEST(SessionTest, ClosedSessionNoLongerAuthenticates) {
  SessionRegistry registry;
  auto a = *registry.Open({1000, 1000, 11}, "a");
  const std::string credential = absl::StrCat(a->id, ":", a->TokenHex());
  EXPECT_EQ(registry.Close(a->id), a);
  EXPECT_EQ(registry.Close(a->id), nullptr);
  absl::Status s = registry.Authenticate(credential).status();
  EXPECT_TRUE(absl::IsPermissionDenied(s));
  EXPECT_NE(s.message().find("not open"), std::string::npos) << s;
  EXPECT_EQ(registry.size(), 0u);
}

}  // namespace
}  // namespace tierd
