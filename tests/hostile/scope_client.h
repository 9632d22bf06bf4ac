// Internal to scope_client: the attacker's half (scope_attacks.cc) and
// what it shares with the victim's (scope_client.cc).
#ifndef COVERBS_TESTS_HOSTILE_SCOPE_CLIENT_H_
#define COVERBS_TESTS_HOSTILE_SCOPE_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "cm/wire.h"
#include "tests/hostile/scope.h"

namespace coverbs::scope_test {

// A connection to the server (--server, --port).
Task<absl::StatusOr<std::unique_ptr<rpc::Client>>> Dial(cm::Worker& worker);

// Sends large requests on `client` until it holds landing grants from the
// server; returns them (oldest first).
Task<absl::StatusOr<std::vector<cm::internal::GrantPayload>>> AwaitGrants(
    cm::Worker& worker, rpc::Client& client);

struct AttackOptions {
  std::string victim_file;  // what the victim leaked
  int wire_guesses = 24;    // guessed keys tried on the wire
};

// Runs every attack; an error names the first that did not fail as it
// must (or what kept the attacks from running).
Task<absl::Status> Attack(cm::Worker& worker, const AttackOptions& o);

}  // namespace coverbs::scope_test

#endif  // COVERBS_TESTS_HOSTILE_SCOPE_CLIENT_H_
