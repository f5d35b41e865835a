#include "daemon/chunks/session.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
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

TEST(SessionTest, AClientNameKeepsOnlyPrintableAscii) {
  SessionRegistry registry;
  // Not UTF-8 (a protobuf string field could not carry it), and a terminal escape.
  auto s = registry.Open({1000, 1000, 11}, "bad\xff\xfe \x1b[31mname\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->client_name, "bad?? ?[31mname?");
  EXPECT_EQ((*registry.Open({1000, 1000, 11}, "optimizer run-42.rank0of2"))->client_name,
            "optimizer run-42.rank0of2");
}

TEST(SessionTest, JobLabelsAreValidatedCountedAndBoundedInNumber) {
  SessionRegistry registry;
  auto a = registry.Open({1000, 1000, 11}, "rank0", "run-42/lr_3e-4:v1.2");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->job, "run-42/lr_3e-4:v1.2");
  EXPECT_NE((*a)->Describe().find("job run-42/lr_3e-4:v1.2"), std::string::npos);
  for (const std::string& bad : {std::string("two words"), std::string("x\n"),
                                 std::string("job{a=\"b\"}"), std::string(kMaxJobBytes + 1, 'j')}) {
    absl::Status s = registry.Open({1000, 1000, 12}, "bad", bad).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad << ": " << s;
  }
  EXPECT_TRUE(registry.Open({1000, 1000, 12}, "longest", std::string(kMaxJobBytes, 'j')).ok());
  auto b = *registry.Open({1000, 1000, 13}, "rank1", "run-42/lr_3e-4:v1.2");
  auto none = *registry.Open({1000, 1000, 14}, "tierctl");
  EXPECT_EQ(registry.CountByJob().at("run-42/lr_3e-4:v1.2"), 2u);
  EXPECT_EQ(registry.CountByJob().size(), 2u);  // sessions without a job are in none

  // At most kMaxLiveJobs distinct jobs at once; a live job still takes sessions.
  std::vector<std::shared_ptr<Session>> held;
  for (int i = 2; i < kMaxLiveJobs; ++i) {
    held.push_back(*registry.Open({1000, 1000, 20}, "", absl::StrCat("job-", i)));
  }
  absl::Status full = registry.Open({1000, 1000, 21}, "", "one-too-many").status();
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_TRUE(registry.Open({1000, 1000, 22}, "", "job-2").ok());
  registry.Close(held.back()->id);  // its job's only session: the job is gone
  EXPECT_TRUE(registry.Open({1000, 1000, 21}, "", "one-too-many").ok());
  registry.Close((*a)->id);
  EXPECT_EQ(registry.CountByJob().at("run-42/lr_3e-4:v1.2"), 1u);
  registry.Close(b->id);
  EXPECT_FALSE(registry.CountByJob().contains("run-42/lr_3e-4:v1.2"));
  (void)none;
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
}  // namespace tierd::daemon
