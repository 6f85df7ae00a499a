#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "auth/crypto.h"
#include "auth/keys_file.h"
#include "auth/principal.h"
#include "auth/tenants.h"
#include "storage/keys.h"

namespace ctxcache::auth {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("ctxcache-auth-" + std::to_string(getpid()) + "-" + name))
      .string();
}

TEST(Crypto, HmacSha256MatchesRfc4231Case2) {
  Sha256::Digest d = HmacSha256("Jefe", "what do ya want for nothing?");
  EXPECT_EQ(HexEncode(std::string(reinterpret_cast<const char*>(d.data()), d.size())),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(Crypto, ConstantTimeEqualAndHex) {
  EXPECT_TRUE(ConstantTimeEqual("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEqual("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEqual("abc", "abcd"));
  EXPECT_EQ(*HexDecode("00ff10", "x"), std::string("\x00\xff\x10", 3));
  EXPECT_FALSE(HexDecode("0g", "x").ok());
  EXPECT_FALSE(HexDecode("abc", "x").ok());
  auto r1 = RandomBytes(32), r2 = RandomBytes(32);
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_NE(*r1, *r2);
}

TEST(Roles, Table) {
  // The operator: everything, every tenant. An admin: everything but the
  // ClusterService, within its tenant (IsServerWide false).
  for (Action a : {Action::kRead, Action::kBuild, Action::kShare, Action::kStats,
                   Action::kCluster}) {
    EXPECT_TRUE(RoleAllows(Role::kOperator, a)) << ActionName(a);
    EXPECT_EQ(RoleAllows(Role::kAdmin, a), a != Action::kCluster) << ActionName(a);
  }
  EXPECT_TRUE(IsServerWide(Role::kOperator));
  for (Role r : {Role::kAdmin, Role::kBuilder, Role::kReader}) EXPECT_FALSE(IsServerWide(r));
  EXPECT_TRUE(RoleAllows(Role::kBuilder, Action::kBuild));
  EXPECT_FALSE(RoleAllows(Role::kBuilder, Action::kRead));
  EXPECT_FALSE(RoleAllows(Role::kBuilder, Action::kShare));
  EXPECT_FALSE(RoleAllows(Role::kBuilder, Action::kCluster));
  EXPECT_TRUE(RoleAllows(Role::kReader, Action::kRead));
  EXPECT_FALSE(RoleAllows(Role::kReader, Action::kBuild));
  EXPECT_FALSE(RoleAllows(Role::kReader, Action::kCluster));
  for (Role r : {Role::kOperator, Role::kAdmin, Role::kBuilder, Role::kReader}) {
    EXPECT_TRUE(RoleAllows(r, Action::kStats));
    EXPECT_EQ(*ParseRole(RoleName(r)), r);
  }
  EXPECT_EQ(RoleName(Role::kOperator), "operator");
  // The anonymous caller (no keys file) is the operator of the default namespace.
  EXPECT_EQ(Principal{}.role, Role::kOperator);
  EXPECT_EQ(Principal{}.tenant, "");
  auto bad = ParseRole("root");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "role: expected reader, builder, admin or operator, got 'root'");
  EXPECT_TRUE(ValidateTenantName("acme-1.eu_west", "t").ok());
  EXPECT_FALSE(ValidateTenantName("", "t").ok());
  EXPECT_FALSE(ValidateTenantName("a/b", "t").ok());
  EXPECT_FALSE(ValidateTenantName(std::string(65, 'a'), "t").ok());
}

TEST(KeysFile, GeneratedKeysAuthenticateAndNothingElseDoes) {
  auto admin = GenerateKey("", Role::kOperator);
  auto reader = GenerateKey("acme", Role::kReader);
  ASSERT_TRUE(admin.ok() && reader.ok());
  // Only operators go without a tenant.
  EXPECT_FALSE(GenerateKey("", Role::kReader).ok());
  EXPECT_FALSE(GenerateKey("", Role::kAdmin).ok());
  KeysFile f;
  f.keys = {admin->entry, reader->entry};
  f.subjects.push_back({"worker-a", "acme", Role::kBuilder});
  const std::string path = TempPath("keys");
  ASSERT_TRUE(f.Write(path).ok());
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  // The file never holds a key's secret.
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text.find(reader->key.substr(16)), std::string::npos);
  auto parsed = KeysFile::Parse(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->Serialize(), text);

  auto store = KeyStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto p = (*store)->AuthenticateBearer("Bearer " + reader->key);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->tenant, "acme");
  EXPECT_EQ(p->role, Role::kReader);
  EXPECT_EQ(p->id, reader->entry.id);
  auto a = (*store)->AuthenticateBearer("Bearer " + admin->key);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->tenant, "");
  EXPECT_EQ(a->role, Role::kOperator);
  std::string wrong = reader->key;
  wrong.back() = wrong.back() == 'a' ? 'b' : 'a';
  for (const std::string& bad :
       {"Bearer " + wrong, reader->key, std::string("Bearer "),
        "Bearer ck_000000000000_" + std::string(64, '0'), "Basic " + reader->key}) {
    auto r = (*store)->AuthenticateBearer(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated) << bad;
  }
  auto c = (*store)->AuthenticateSubject("worker-a");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->role, Role::kBuilder);
  EXPECT_EQ(c->id, "cert:worker-a");
  EXPECT_FALSE((*store)->AuthenticateSubject("stranger").ok());

  // Revocation: the rewritten file takes effect on ReloadIfChanged.
  f.keys = {admin->entry};
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(f.Write(path).ok());
  auto changed = (*store)->ReloadIfChanged(0);
  ASSERT_TRUE(changed.ok());
  EXPECT_TRUE(*changed);
  EXPECT_FALSE((*store)->AuthenticateBearer("Bearer " + reader->key).ok());
  EXPECT_TRUE((*store)->AuthenticateBearer("Bearer " + admin->key).ok());
  // A malformed rewrite keeps the previous keys.
  {
    std::ofstream out(path);
    out << "key zz tenant=acme role=reader\n";
  }
  EXPECT_FALSE((*store)->ReloadIfChanged(0).ok());
  EXPECT_TRUE((*store)->AuthenticateBearer("Bearer " + admin->key).ok());
  std::filesystem::remove(path);
}

TEST(KeysFile, MalformedLinesNameTheLine) {
  const std::string salt(32, 'a'), sha(64, 'b');
  for (const std::string& bad :
       {std::string("key 0123456789ab tenant=a role=reader salt=") + salt,  // no sha256
        "key 0123 tenant=a role=reader salt=" + salt + " sha256=" + sha,    // short id
        "key 0123456789ab tenant=a role=god salt=" + salt + " sha256=" + sha,
        "key 0123456789ab tenant=- role=reader salt=" + salt + " sha256=" + sha,
        std::string("cert tenant=a role=reader"), std::string("user x")}) {
    auto r = KeysFile::Parse("# header\n" + bad + "\n");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("line 2"), std::string::npos) << r.status().ToString();
  }
  const std::string dup = "key 0123456789ab tenant=a role=reader salt=" + salt + " sha256=" + sha;
  EXPECT_FALSE(KeysFile::Parse(dup + "\n" + dup + "\n").ok());
}

// The keys file's roles: operator (server-wide, the only role allowed the
// default namespace "-"), admin (scoped to its tenant), builder, reader. A
// file written before operators existed keeps working where its admins have
// a tenant; its server-wide admins ("tenant=- role=admin") are refused with
// the migration, not quietly narrowed.
TEST(KeysFile, OperatorRoleParsesAndRoundTrips) {
  const std::string salt(32, 'a'), sha(64, 'b');
  const std::string hashes = " salt=" + salt + " sha256=" + sha + "\n";
  const std::string text = "key 0123456789ab tenant=- role=operator" + hashes +
                           "key 0123456789ac tenant=ops role=operator" + hashes +
                           "key 0123456789ad tenant=acme role=admin" + hashes +
                           "cert cn=ops-console tenant=- role=operator\n" +
                           "cert cn=acme-console tenant=acme role=admin\n";
  auto f = KeysFile::Parse(text);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->keys.size(), 3u);
  EXPECT_EQ(f->keys[0].role, Role::kOperator);
  EXPECT_EQ(f->keys[0].tenant, "");
  EXPECT_EQ(f->keys[1].role, Role::kOperator);
  EXPECT_EQ(f->keys[1].tenant, "ops");
  EXPECT_EQ(f->keys[2].role, Role::kAdmin);  // an old tenant admin: same line, scoped meaning
  EXPECT_EQ(f->keys[2].tenant, "acme");
  ASSERT_EQ(f->subjects.size(), 2u);
  EXPECT_EQ(f->subjects[0].role, Role::kOperator);
  EXPECT_EQ(f->subjects[0].tenant, "");
  EXPECT_EQ(f->subjects[1].role, Role::kAdmin);
  auto again = KeysFile::Parse(f->Serialize());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->Serialize(), f->Serialize());
  EXPECT_NE(f->Serialize().find("tenant=- role=operator"), std::string::npos);
}

TEST(KeysFile, ABadRoleNamesTheLineTheFieldAndTheExpectedValues) {
  const std::string salt(32, 'a'), sha(64, 'b');
  for (const std::string& line :
       {"key 0123456789ab tenant=acme role=superuser salt=" + salt + " sha256=" + sha,
        std::string("cert cn=x tenant=acme role=superuser")}) {
    auto r = KeysFile::Parse("# header\n" + line + "\n");
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(),
              "keys file line 2: role: expected reader, builder, admin or operator, got "
              "'superuser'")
        << r.status().ToString();
  }
}

TEST(KeysFile, AServerWideAdminOfAnOldFileIsRefusedWithTheMigration) {
  const std::string salt(32, 'a'), sha(64, 'b');
  for (const std::string& line :
       {"key 0123456789ab tenant=- role=admin salt=" + salt + " sha256=" + sha,
        std::string("cert cn=ops tenant=- role=admin")}) {
    auto r = KeysFile::Parse(line + "\n");
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string m(r.status().message());
    EXPECT_NE(m.find("keys file line 1: tenant '-'"), std::string::npos) << m;
    EXPECT_NE(m.find("role admin is scoped to one tenant"), std::string::npos) << m;
    EXPECT_NE(m.find("role operator"), std::string::npos) << m;
    EXPECT_NE(m.find("Migrating admin keys"), std::string::npos) << m;
  }
  // Builders and readers still need a tenant, and are told who may go without.
  auto r = KeysFile::Parse("cert cn=x tenant=- role=builder\n");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("only operator entries"), std::string::npos)
      << r.status().ToString();
  // The same rule for new keys and mappings (the CLI's --tenant).
  Status s = ValidateEntryTenant("", Role::kAdmin, "--tenant");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().rfind("--tenant: role admin", 0), 0u) << s.ToString();
  EXPECT_TRUE(ValidateEntryTenant("", Role::kOperator, "--tenant").ok());
  EXPECT_TRUE(ValidateEntryTenant("acme", Role::kAdmin, "--tenant").ok());
  EXPECT_FALSE(ValidateEntryTenant("a/b", Role::kOperator, "--tenant").ok());
}

TEST(KeysFile, AnOperatorKeyAuthenticatesAsTheOperator) {
  auto op = GenerateKey("", Role::kOperator);
  auto admin = GenerateKey("acme", Role::kAdmin);
  ASSERT_TRUE(op.ok() && admin.ok());
  KeysFile f;
  f.keys = {op->entry, admin->entry};
  const std::string path = TempPath("operator-keys");
  ASSERT_TRUE(f.Write(path).ok());
  auto store = KeyStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto p = (*store)->AuthenticateBearer("Bearer " + op->key);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->role, Role::kOperator);
  EXPECT_EQ(p->tenant, "");
  auto a = (*store)->AuthenticateBearer("Bearer " + admin->key);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->role, Role::kAdmin);
  EXPECT_EQ(a->tenant, "acme");
  std::filesystem::remove(path);
}

TEST(Tenants, ParsesQuotasWithSuffixesAndRejectsUnknownKeys) {
  auto t = TenantsConfig::Parse(
      "[default]\nmax_stored_bytes = 10G\n# comment\n[tenant.acme]\nmax_contexts = 5\n"
      "max_sessions=2\nmax_builds = 1\nbuild_tokens_per_minute = 4K\nmax_streams = 8\n"
      "max_messages_per_second = 100\n");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->QuotaFor("other").max_stored_bytes, 10ull << 30);
  EXPECT_EQ(t->QuotaFor("acme").max_contexts, 5u);
  EXPECT_EQ(t->QuotaFor("acme").max_sessions, 2u);
  EXPECT_EQ(t->QuotaFor("acme").build_tokens_per_minute, 4096u);
  EXPECT_EQ(t->QuotaFor("acme").max_streams, 8u);
  EXPECT_EQ(t->QuotaFor("acme").max_messages_per_second, 100u);
  EXPECT_EQ(t->QuotaFor("acme").max_stored_bytes, 0u);  // a section is the whole quota
  for (const char* bad :
       {"max_contexts = 1\n", "[tenant.a]\nmax_cakes = 1\n", "[tenant.a]\nmax_contexts = -1\n",
        "[tenant.a]\nmax_contexts = 1X\n", "[tenant.a/b]\n", "[other]\n",
        "[tenant.a]\nmax_contexts = 99999999999999999999999\n"}) {
    EXPECT_FALSE(TenantsConfig::Parse(bad).ok()) << bad;
  }
}

TEST(Tenants, IdNamespacesSeparateTenantsAndProvenance) {
  const std::string secret(32, 's');
  EXPECT_EQ(IdNamespace(secret, "", false), "");  // format-1 ids for the default tenant
  const std::string a = IdNamespace(secret, "a", false);
  const std::string b = IdNamespace(secret, "b", false);
  const std::string ai = IdNamespace(secret, "a", true);
  const std::string di = IdNamespace(secret, "", true);
  EXPECT_EQ(a.size(), 33u);
  EXPECT_NE(a, b);
  EXPECT_NE(a, ai);
  EXPECT_NE(di, "");
  EXPECT_NE(IdNamespace(std::string(32, 't'), "a", false), a);  // the secret matters
  const std::vector<uint32_t> tokens = {1, 2, 3};
  std::set<std::string> ids;
  for (const std::string& ns : {std::string(), a, b, ai, di}) {
    ids.insert(storage::ContextId::Compute(ns, "fp", tokens).ToHex());
  }
  EXPECT_EQ(ids.size(), 5u);
  EXPECT_EQ(storage::ContextId::Compute("", "fp", tokens),
            storage::ContextId::Compute("fp", tokens));

  const std::string path = TempPath("secret");
  std::filesystem::remove(path);
  auto s1 = LoadOrCreateIdSecret(path);
  auto s2 = LoadOrCreateIdSecret(path);
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_EQ(*s1, *s2);
  EXPECT_EQ(s1->size(), 32u);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace ctxcache::auth
