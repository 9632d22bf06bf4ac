// scope_client: the victim, the attacker and the final check of
// scope_test.sh (issue 27, point 4), each a process of its own on its own
// connections to scope_server, as real clients would be.
//
//   --mode=victim: gets its token, sends large requests until it holds
//     landing grants, writes token and grants to --victim_file (what a leak
//     would give an attacker), then keeps its connection up until
//     --go_file exists and verifies its bytes (READ through its token),
//     writes them back, lands large requests in the grants the attacker
//     aimed at (the server counts their mismatches) and exits 0 when all
//     is intact.
//   --mode=attacker: every attack on a fresh connection of its own (a
//     refused one ends its connection); exits 1 if an attack succeeds or a
//     wrong error comes back (tests/hostile/scope_attacks.cc).
//   --mode=check: the server's count of changed bytes over every region;
//     exits 1 unless 0.
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "cm/connection_test_peer.h"
#include "examples/common.h"
#include "tests/hostile/scope_client.h"

ABSL_FLAG(std::string, mode, "", "victim, attacker or check");
ABSL_FLAG(std::string, provider, "soft", "verbs or soft");
ABSL_FLAG(std::string, device, "", "verbs: the device; empty: the first");
ABSL_FLAG(std::string, server, "127.0.0.1", "the server's address");
ABSL_FLAG(uint16_t, port, 0, "the server's port");
ABSL_FLAG(std::string, victim_file, "", "victim: written; attacker: read");
ABSL_FLAG(std::string, go_file, "", "victim: verifies once this exists");
ABSL_FLAG(absl::Duration, wait, absl::Seconds(120),
          "victim: how long to wait for --go_file");
ABSL_FLAG(int, wire_guesses, 24,
          "attacker: guessed keys tried on the wire (a connection each)");

namespace coverbs::scope_test {

Task<absl::StatusOr<std::unique_ptr<rpc::Client>>> Dial(cm::Worker& worker) {
  return rpc::Client::Connect(worker, absl::GetFlag(FLAGS_server),
                              absl::GetFlag(FLAGS_port));
}

Task<absl::StatusOr<std::vector<cm::internal::GrantPayload>>> AwaitGrants(
    cm::Worker& worker, rpc::Client& client) {
  // The server grants landing buffers once it has seen one rendezvous of
  // a medium size: the first request goes by rendezvous, the grants follow
  // in a CREDIT message.
  std::vector<std::byte> req(::scope::kLargeBytes);
  for (uint64_t i = 0; i < 2; ++i) {
    ::scope::FillLarge(req, 1000 + i);
    absl::StatusOr<uint64_t> bad = co_await client.Call(
        ::scope::kLarge, std::span<const std::byte>(req));
    if (!bad.ok()) co_return bad.status();
    if (*bad != 0) co_return absl::DataLossError("a large request arrived changed");
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::vector<cm::internal::GrantPayload> grants;
  while ((grants = cm::internal::ConnectionTestPeer::Grants(client.connection()))
             .empty() &&
         absl::Now() < deadline) {
    co_await worker.reactor().Sleep(absl::Milliseconds(5));
  }
  if (grants.empty()) co_return absl::DeadlineExceededError("no landing grants came");
  co_return grants;
}

namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// The tag the server filled `bytes` with (its connection serial).
std::optional<uint64_t> TagOf(std::span<const std::byte> bytes) {
  for (uint64_t tag = 1; tag < (1u << 16); ++tag) {
    if (::scope::Mismatches(bytes, tag) == 0) return tag;
  }
  return std::nullopt;
}

Task<absl::Status> Victim(cm::Worker& worker) {
  const std::string file = absl::GetFlag(FLAGS_victim_file);
  const std::string go = absl::GetFlag(FLAGS_go_file);
  if (file.empty() || go.empty()) {
    co_return absl::InvalidArgumentError("victim: --victim_file and --go_file");
  }
  CO_ASSIGN_OR_RETURN(auto client, co_await Dial(worker));
  cm::Connection& conn = client->connection();
  absl::StatusOr<RemoteRegion> token = co_await client->Call(::scope::kToken, 0);
  std::vector<std::byte> snapshot(::scope::kRegionBytes);
  std::optional<uint64_t> tag;
  if (token.ok()) {
    CO_RETURN_IF_ERROR(co_await conn.Read(std::span(snapshot), *token));
    tag = TagOf(snapshot);
    if (!tag) co_return absl::DataLossError("victim: its region holds no pattern");
  } else if (token.status().code() == absl::StatusCode::kFailedPrecondition &&
             !worker.device().caps().memory_windows) {
    std::printf("victim: Expose refused on %s (no memory windows), as "
                "documented: %s\n",
                worker.device().name().c_str(), token.status().ToString().c_str());
  } else {
    co_return token.status();
  }
  CO_ASSIGN_OR_RETURN(auto grants, co_await AwaitGrants(worker, *client));
  {
    std::ofstream out(file + ".tmp");
    if (token.ok()) {
      out << absl::StrFormat("token %d %d %d\n", token->addr, token->length,
                             token->rkey);
    } else {
      out << "refused " << token.status().message() << "\n";
    }
    for (const auto& g : grants) {
      out << absl::StrFormat("grant %d %d %d\n", g.addr,
                             cm::internal::GrantBytes(g), g.rkey);
    }
    out.close();
    if (out.fail() || std::rename((file + ".tmp").c_str(), file.c_str()) != 0) {
      co_return absl::InternalError("victim: cannot write " + file);
    }
  }
  std::printf("victim: %s, %zu landing grant(s) written to the victim file\n",
              token.ok() ? absl::StrFormat("token rkey 0x%x, region %d", token->rkey,
                                           *tag).c_str()
                         : "no token",
              grants.size());
  std::fflush(stdout);
  // The attacks happen now, from other processes.
  const absl::Time deadline = absl::Now() + absl::GetFlag(FLAGS_wait);
  while (!Exists(go)) {
    if (absl::Now() > deadline) co_return absl::DeadlineExceededError("no --go_file");
    co_await worker.reactor().Sleep(absl::Milliseconds(20));
  }
  CO_RETURN_IF_ERROR(client->status());
  if (token.ok()) {
    // Its bytes as they were, read and written through its own token.
    std::vector<std::byte> now(snapshot.size());
    CO_RETURN_IF_ERROR(co_await conn.Read(std::span(now), *token));
    if (now != snapshot) {
      co_return absl::DataLossError(absl::StrFormat(
          "victim: %d byte(s) of its region changed",
          ::scope::Mismatches(now, *tag)));
    }
    CO_RETURN_IF_ERROR(
        co_await conn.Write(std::span<const std::byte>(now), *token));
  }
  // Large requests land in the grants the attacker aimed at; the server
  // counts the bytes that differ.
  std::vector<std::byte> req(::scope::kLargeBytes);
  for (uint64_t i = 0; i < 4; ++i) {
    ::scope::FillLarge(req, 2000 + i);
    absl::StatusOr<uint64_t> bad = co_await client->Call(
        ::scope::kLarge, std::span<const std::byte>(req));
    if (!bad.ok()) co_return bad.status();
    if (*bad != 0) {
      co_return absl::DataLossError(absl::StrFormat(
          "victim: large request %d landed with %d byte(s) changed", i, *bad));
    }
  }
  std::printf("victim: intact: %s; 4 large requests landed unchanged; its "
              "connection works\n",
              token.ok() ? "region read back unchanged and written" : "no region");
  co_return co_await client->Close();
}

Task<absl::Status> Check(cm::Worker& worker) {
  CO_ASSIGN_OR_RETURN(auto client, co_await Dial(worker));
  CO_ASSIGN_OR_RETURN(uint64_t bad, co_await client->Call(::scope::kCheck, 0));
  std::printf("check: %llu byte(s) of the server's regions changed\n",
              static_cast<unsigned long long>(bad));
  CO_RETURN_IF_ERROR(co_await client->Close());
  if (bad != 0) co_return absl::DataLossError("regions changed");
  co_return absl::OkStatus();
}

}  // namespace
}  // namespace coverbs::scope_test

int main(int argc, char** argv) {
  using namespace coverbs;
  absl::SetProgramUsageMessage(
      "tests/hostile/scope_test.sh's clients: --mode=victim|attacker|check");
  examples::ParseFlagsOrExit(argc, argv);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (!examples::CheckProviderFlag("scope_client", absl::GetFlag(FLAGS_provider))) {
    return 2;
  }
  auto device = examples::OpenDevice(absl::GetFlag(FLAGS_provider),
                                     absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "scope_client: %s\n", device.status().ToString().c_str());
    return 1;
  }
  RunOptions options;
  options.device = device->get();
  absl::Status result;
  auto main_fn = [&](cm::Worker& w) -> Task<absl::Status> {
    if (mode == "victim") {
      result = co_await scope_test::Victim(w);
    } else if (mode == "attacker") {
      // Named, not a temporary in the co_await: gcc 12 destroys such
      // temporaries twice (rpc/client.h).
      const scope_test::AttackOptions o{
          .victim_file = absl::GetFlag(FLAGS_victim_file),
          .wire_guesses = absl::GetFlag(FLAGS_wire_guesses)};
      result = co_await scope_test::Attack(w, o);
    } else if (mode == "check") {
      result = co_await scope_test::Check(w);
    } else {
      result = absl::InvalidArgumentError("--mode=victim|attacker|check");
    }
    co_return absl::OkStatus();
  };
  if (RunMain(main_fn, options) != 0) return 1;
  if (!result.ok()) {
    std::printf("%s: FAILED: %s\n", mode.c_str(), result.ToString().c_str());
    return 1;
  }
  return 0;
}
