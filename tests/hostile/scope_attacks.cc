// scope_client --mode=attacker: the attacks of issue 27, point 4, by a
// process of its own, as a real client of scope_server would make them.
// Every attack that reaches the wire runs on a fresh connection (a refused
// RDMA operation ends its connection) and must fail there, with the
// operation's remote access error (PERMISSION_DENIED) or the loss of that
// connection (UNAVAILABLE), the message naming the operation: the rule of
// tests/cm/key_attacks.h (expose_scope_test in process), here across
// processes.
//   (a) the victim's token (leaked through --victim_file) used from the
//       attacker's connection: READ and WRITE; Revoke of it: NOT_FOUND;
//   (b) keys guessed from the ones the attacker sees (its own exposures
//       and landing grants): neighbours, the soft provider's former
//       schedule inverted, random keys. On soft none may name a victim's
//       key (all checked offline); on verbs a key has 8 random bits, so
//       some may, and each that does is tried on the wire; then
//       --wire_guesses of them against the victim's region and grant;
//   (c) the attacker's own token after its connection closed, and after
//       Revoke;
//   (d) an RDMA WRITE into the victim's landing grant, address and rkey
//       exactly.
// On a device without memory windows (siw) the server's Expose refuses:
// the attacks that need a token are skipped with that reason, and a
// landing grant is a per-message registration valid from every QP of the
// PD (cm/README.md, "Security model"): (d) is asserted to complete there,
// the documented limit, and the victim then checks its messages.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tests/cm/key_attacks.h"
#include "tests/hostile/scope_client.h"

namespace coverbs::scope_test {
namespace {

using cm::internal::GrantPayload;

// What the victim leaked: its token (or why it has none) and its grants.
struct Leak {
  std::optional<RemoteRegion> token;
  std::string refused;
  std::vector<GrantPayload> grants;
};

absl::StatusOr<Leak> ReadLeak(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError("cannot read the victim file " + path);
  Leak leak;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string what;
    s >> what;
    if (what == "token") {
      RemoteRegion t;
      s >> t.addr >> t.length >> t.rkey;
      leak.token = t;
    } else if (what == "refused") {
      std::getline(s >> std::ws, leak.refused);
    } else if (what == "grant") {
      GrantPayload g{};
      s >> g.addr >> g.size >> g.rkey;
      leak.grants.push_back(g);
    }
    if (s.fail()) return absl::DataLossError("victim file: bad line: " + line);
  }
  return leak;
}

using ::coverbs::testing::Mix;
using ::coverbs::testing::Refused;
using ::coverbs::testing::Unmix;

struct Guess {
  uint32_t key;
  const char* how;
};

// What a peer would try from the keys it saw, by kind, kinds interleaved
// so that a bounded number on the wire covers each.
std::vector<Guess> Guesses(const std::vector<uint32_t>& seen, std::mt19937_64& rng,
                           int random_keys) {
  std::vector<std::vector<Guess>> kinds(4);
  for (uint32_t k : seen) {
    for (uint32_t d = 1; d <= 64; ++d) {
      kinds[0].push_back({k + d, "neighbour +d"});
      kinds[0].push_back({k - d, "neighbour -d"});
      kinds[1].push_back({k + (d << 8), "next index, same key byte"});
      kinds[1].push_back({k - (d << 8), "previous index, same key byte"});
      if (d <= 8) {
        kinds[2].push_back({Mix(Unmix(k) + d), "former soft schedule, next"});
        kinds[2].push_back({Mix(Unmix(k) - d), "former soft schedule, previous"});
      }
    }
  }
  for (int i = 0; i < random_keys; ++i) {
    kinds[3].push_back({static_cast<uint32_t>(rng()), "random"});
  }
  std::set<uint32_t> seen_set(seen.begin(), seen.end()), taken;
  std::vector<Guess> out;
  for (size_t i = 0;; ++i) {
    bool any = false;
    for (auto& kind : kinds) {
      if (i >= kind.size()) continue;
      any = true;
      if (!seen_set.count(kind[i].key) && taken.insert(kind[i].key).second) {
        out.push_back(kind[i]);
      }
    }
    if (!any) break;
  }
  return out;
}

class Attacker {
 public:
  Attacker(cm::Worker& worker, const AttackOptions& o)
      : w_(worker), o_(o), rng_(std::random_device()()) {}

  Task<absl::Status> Run() {
    auto leak = ReadLeak(o_.victim_file);
    if (!leak.ok()) co_return leak.status();
    leak_ = *std::move(leak);
    windows_ = w_.device().caps().memory_windows;
    iwarp_ = w_.device().caps().transport == transport::TransportKind::kIWarp;
    std::printf("attacker: device %s, memory windows: %s; the victim leaked %s "
                "and %zu landing grant(s)\n",
                w_.device().name().c_str(), windows_ ? "yes" : "no",
                leak_.token ? absl::StrFormat("its token (rkey 0x%x)", leak_.token->rkey)
                                  .c_str()
                            : "no token",
                leak_.grants.size());
    CO_RETURN_IF_ERROR(co_await OwnKeys());
    CO_RETURN_IF_ERROR(co_await AfterClose());
    CO_RETURN_IF_ERROR(co_await AfterRevoke());
    CO_RETURN_IF_ERROR(co_await VictimToken());
    CO_RETURN_IF_ERROR(co_await GuessedKeys());
    CO_RETURN_IF_ERROR(co_await VictimGrant());
    std::printf("attacker: %d attack(s) on the wire over %d connection(s), %d "
                "refused, %d skipped, %d wrong\n",
                attacks_, connections_, refused_, skipped_, wrong_);
    if (wrong_ != 0) {
      co_return absl::InternalError(
          absl::StrCat(wrong_, " attack(s) did not fail as they must"));
    }
    co_return absl::OkStatus();
  }

 private:
  void Report(bool as_expected, const std::string& attack, const std::string& seen) {
    std::printf("attacker: %s %s: %s\n", as_expected ? "ok  " : "FAIL",
                attack.c_str(), seen.c_str());
    std::fflush(stdout);
    if (!as_expected) ++wrong_;
  }
  void Skip(const std::string& attack, const std::string& why) {
    std::printf("attacker: skip %s: %s\n", attack.c_str(), why.c_str());
    ++skipped_;
  }

  // A READ or WRITE of `aim` on `client`, which must be refused; a refused
  // READ must place nothing.
  Task<void> MustFail(rpc::Client& client, bool write, RemoteRegion aim,
                      const std::string& attack) {
    ++attacks_;
    aim.length = std::min<uint64_t>(aim.length, 4096);
    std::vector<std::byte> buf(aim.length, write ? std::byte{0x66} : std::byte{0});
    absl::Status s =
        write ? co_await client.connection().Write(std::span<const std::byte>(buf), aim)
              : co_await client.connection().Read(std::span(buf), aim);
    const char* op = write ? "RDMA WRITE on " : "RDMA READ on ";
    bool ok = Refused(s, op);
    if (iwarp_ && write && !ok) {
      // iWARP completes a WRITE once it is sent; the responder refuses it
      // with a TERMINATE that ends the connection, which either fails the
      // WRITE itself while parts of it are still to send (a local QP
      // operation error) or, after the completion, the next round trip.
      ok = s.code() == absl::StatusCode::kInternal &&
           s.message().find(op) != absl::string_view::npos &&
           s.message().find("IBV_WC_LOC_QP_OP_ERR") != absl::string_view::npos;
      if (s.ok()) {
        absl::StatusOr<int32_t> pong = co_await Ping(client);
        ok = !pong.ok();
        s = absl::Status(pong.status().code(),
                         absl::StrCat("the WRITE completed locally; the next call on its "
                                      "connection: ",
                                      pong.status().ToString()));
      }
    }
    refused_ += ok;
    if (ok && !write) {
      for (std::byte b : buf) ok = ok && b == std::byte{0};
      if (!ok) Report(false, attack, "a refused READ placed data");
    }
    Report(ok, attack, s.ToString());
  }
  // The same on a fresh connection of its own. (Callers pass named strings:
// gcc 12 destroys temporaries in a co_await expression twice.)
  Task<absl::Status> FreshMustFail(bool write, RemoteRegion aim,
                                   const std::string& attack) {
    CO_ASSIGN_OR_RETURN(auto client, co_await Served());
    co_await MustFail(*client, write, aim, attack);
    (void)co_await client->Close();  // its connection is down: any status
    co_return absl::OkStatus();
  }
  // A round trip on `client`, bounded.
  Task<absl::StatusOr<int32_t>> Ping(rpc::Client& client) {
    const rpc::CallOptions opts{.deadline = absl::Now() + absl::Seconds(20)};
    const int32_t seven = 7;
    co_return co_await client.Call(::scope::kPing, seven, opts);
  }
  // A connection of its own that the server has accepted and served once:
  // the attack comes from a client like any other.
  Task<absl::StatusOr<std::unique_ptr<rpc::Client>>> Served() {
    CO_ASSIGN_OR_RETURN(auto client, co_await Dial(w_));
    ++connections_;
    absl::StatusOr<int32_t> pong = co_await Ping(*client);
    if (!pong.ok()) co_return pong.status();
    co_return client;
  }
  // Its own token, which must work on its own connection (the control: a
  // refusal below is the scope's, not a broken READ).
  Task<absl::StatusOr<std::optional<RemoteRegion>>> OwnToken(rpc::Client& client,
                                                             const char* why) {
    absl::StatusOr<RemoteRegion> t = co_await client.Call(::scope::kToken, 0);
    if (!windows_) {
      const bool documented = t.status().code() == absl::StatusCode::kFailedPrecondition &&
                              t.status().message().find("kProtectionDomain") !=
                                  absl::string_view::npos;
      Report(documented, absl::StrCat("Expose without windows (", why, ")"),
             t.status().ToString());
      co_return std::nullopt;
    }
    if (!t.ok()) co_return t.status();
    std::vector<std::byte> mine(t->length);
    CO_RETURN_IF_ERROR(co_await client.connection().Read(std::span(mine), *t));
    co_return *t;
  }

  // Its own keys: exposures to it, and the landing grants it gets.
  Task<absl::Status> OwnKeys() {
    CO_ASSIGN_OR_RETURN(auto client, co_await Served());
    CO_ASSIGN_OR_RETURN(own_, co_await OwnToken(*client, "its own token"));
    if (own_) {
      seen_.push_back(own_->rkey);
      for (int i = 0; i < 16; ++i) {
        CO_ASSIGN_OR_RETURN(RemoteRegion t, co_await client->Call(::scope::kToken, 0));
        seen_.push_back(t.rkey);
      }
    }
    CO_ASSIGN_OR_RETURN(auto grants, co_await AwaitGrants(w_, *client));
    for (const auto& g : grants) seen_.push_back(g.rkey);
    std::printf("attacker: saw %zu key(s) of its own (exposures and grants)\n",
                seen_.size());
    co_return co_await client->Close();
  }

  // (c) its own token once its connection has closed.
  Task<absl::Status> AfterClose() {
    if (!own_) {
      Skip("(c) token after close", leak_.refused);
      co_return absl::OkStatus();
    }
    const std::string attack = "(c) WRITE with its token after its connection closed";
    co_return co_await FreshMustFail(true, *own_, attack);
  }

  // (c) its own token after Revoke, on the connection it was exposed to.
  Task<absl::Status> AfterRevoke() {
    if (!windows_) {
      Skip("(c) token after revoke", leak_.refused);
      co_return absl::OkStatus();
    }
    CO_ASSIGN_OR_RETURN(auto client, co_await Served());
    CO_ASSIGN_OR_RETURN(auto t, co_await OwnToken(*client, "revoke"));
    absl::StatusOr<int32_t> r = co_await client->Call(::scope::kRevoke, *t);
    Report(r.ok(), "Revoke of its own token", r.status().ToString());
    r = co_await client->Call(::scope::kRevoke, *t);
    Report(r.status().code() == absl::StatusCode::kNotFound,
           "Revoke of its own token again", r.status().ToString());
    const std::string attack = "(c) WRITE with its token after Revoke";
    co_await MustFail(*client, true, *t, attack);
    (void)co_await client->Close();
    co_return absl::OkStatus();
  }

  // (a) the victim's token, from the attacker's connections.
  Task<absl::Status> VictimToken() {
    if (!leak_.token) {
      Skip("(a) the victim's token", leak_.refused);
      co_return absl::OkStatus();
    }
    CO_ASSIGN_OR_RETURN(auto client, co_await Served());
    absl::StatusOr<int32_t> r = co_await client->Call(::scope::kRevoke, *leak_.token);
    Report(r.status().code() == absl::StatusCode::kNotFound,
           "(a) Revoke of the victim's token from its connection", r.status().ToString());
    const std::string read = "(a) READ with the victim's token";
    co_await MustFail(*client, false, *leak_.token, read);
    (void)co_await client->Close();
    const std::string write = "(a) WRITE with the victim's token";
    co_return co_await FreshMustFail(true, *leak_.token, write);
  }

  // (b) keys guessed from those it saw, at the victim's region and grant.
  Task<absl::Status> GuessedKeys() {
    std::vector<Guess> guesses = Guesses(seen_, rng_, 64);
    // Guesses that name a key of the victim, with what that key opens.
    std::vector<std::pair<Guess, RemoteRegion>> hits;
    for (const Guess& g : guesses) {
      if (leak_.token && g.key == leak_.token->rkey) hits.push_back({g, *leak_.token});
      for (const auto& gr : leak_.grants) {
        if (g.key == gr.rkey) hits.push_back({g, RemoteRegion{gr.addr, 4096, gr.rkey}});
      }
    }
    const std::string offline =
        absl::StrFormat("%zu guesses from %zu seen key(s): %zu name a key of the victim",
                        guesses.size(), seen_.size(), hits.size());
    if (w_.device().caps().transport == transport::TransportKind::kSoft ||
        w_.device().caps().transport == transport::TransportKind::kLoop) {
      // Soft's keys come from a keyed PRF under a per-process secret, loop's
      // from a seeded random generator: none follows from others
      // (cm/README.md, "Security model").
      Report(hits.empty(), "(b) offline", offline);
    } else {
      // A verbs key is the window's index (the device's choice, near the
      // others) and one random byte per bind: among 256 guesses per index
      // one is right. The window's binding to its QP is what refuses them
      // (each hit is tried on the wire below).
      Report(true, "(b) offline (verbs: 8 random bits per key)", offline);
    }
    // Each hit on the wire first (bounded), then guesses at the victim's
    // region (READ and WRITE) where it has a token and its first grant
    // (WRITE).
    for (size_t i = 0; i < hits.size() && i < 8; ++i) {
      const auto& [g, aim] = hits[i];
      const bool region = leak_.token && aim.rkey == leak_.token->rkey;
      const std::string attack = absl::StrFormat(
          "(b) WRITE at the victim's %s with a guessed key that is its key, 0x%x (%s)",
          region ? "region" : "landing grant", g.key, g.how);
      // (Not a conditional expression: gcc 12 ran both co_awaits of one.)
      if (DocumentedGrantWrite(true, aim)) {
        CO_RETURN_IF_ERROR(co_await GrantWriteCompletes(aim, attack));
      } else {
        CO_RETURN_IF_ERROR(co_await FreshMustFail(true, aim, attack));
      }
    }
    std::vector<std::pair<bool, RemoteRegion>> aims;
    if (leak_.token) {
      aims.push_back({false, *leak_.token});
      aims.push_back({true, *leak_.token});
    } else {
      Skip("(b) guesses at the victim's region", leak_.refused);
    }
    if (!leak_.grants.empty()) {
      const GrantPayload& g = leak_.grants.front();
      aims.push_back({true, RemoteRegion{g.addr, 4096, g.rkey}});
    }
    const size_t n = std::min<size_t>(guesses.size(), o_.wire_guesses);
    for (size_t i = 0; i < n && !aims.empty(); ++i) {
      auto [write, aim] = aims[i % aims.size()];
      aim.rkey = guesses[i].key;
      const bool grant = !leak_.token || i % aims.size() == 2;
      const std::string attack =
          absl::StrFormat("(b) %s at the victim's %s with guessed key 0x%x (%s)",
                          write ? "WRITE" : "READ", grant ? "landing grant" : "region",
                          aim.rkey, guesses[i].how);
      if (DocumentedGrantWrite(write, aim)) {
        CO_RETURN_IF_ERROR(co_await GrantWriteCompletes(aim, attack));
      } else {
        CO_RETURN_IF_ERROR(co_await FreshMustFail(write, aim, attack));
      }
    }
    co_return absl::OkStatus();
  }

  // (d) a WRITE into the victim's next landing grant, exactly.
  Task<absl::Status> VictimGrant() {
    if (leak_.grants.empty()) co_return absl::InternalError("the victim leaked no grant");
    const GrantPayload& g = leak_.grants.front();
    const RemoteRegion aim{g.addr, 4096, g.rkey};
    const std::string attack = "(d) WRITE into the victim's landing grant";
    if (windows_) co_return co_await FreshMustFail(true, aim, attack);
    co_return co_await GrantWriteCompletes(aim, attack);
  }

  // Whether a WRITE at `aim` reaches a victim's landing grant by its own
  // key on a device without windows: the documented limit, which
  // GrantWriteCompletes asserts instead of a refusal.
  bool DocumentedGrantWrite(bool write, const RemoteRegion& aim) const {
    if (windows_ || !write) return false;
    for (const auto& g : leak_.grants) {
      if (aim.rkey == g.rkey) return true;
    }
    return false;
  }

  // Without windows a grant is a registration with remote write, valid
  // from every QP of the PD until its message arrives (cm/README.md,
  // "Security model": the documented limit), so a WRITE with its key --
  // known (d), or guessed (b): siw's keys are an index and a fixed byte --
  // completes. The victim's next message overwrites what this put there;
  // the victim checks it.
  Task<absl::Status> GrantWriteCompletes(RemoteRegion aim, std::string attack) {
    CO_ASSIGN_OR_RETURN(auto client, co_await Served());
    std::vector<std::byte> junk(aim.length, std::byte{0x99});
    ++attacks_;
    absl::Status s =
        co_await client->connection().Write(std::span<const std::byte>(junk), aim);
    // Placed, not refused later (iWARP: the peer's check comes after the
    // completion): the connection still carries a call.
    if (s.ok()) s = (co_await Ping(*client)).status();
    Report(s.ok(), attack + " (no windows: completes, as documented)", s.ToString());
    (void)co_await client->Close();
    co_return absl::OkStatus();
  }

  cm::Worker& w_;
  const AttackOptions o_;
  std::mt19937_64 rng_;
  Leak leak_;
  bool windows_ = false;
  bool iwarp_ = false;  // a WRITE's completion precedes the peer's check
  std::optional<RemoteRegion> own_;
  std::vector<uint32_t> seen_;
  int attacks_ = 0, connections_ = 0, refused_ = 0, skipped_ = 0, wrong_ = 0;
};

}  // namespace

Task<absl::Status> Attack(cm::Worker& worker, const AttackOptions& o) {
  Attacker a(worker, o);
  co_return co_await a.Run();
}

}  // namespace coverbs::scope_test
