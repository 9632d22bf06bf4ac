// Shared by hostile_client's TCP (soft provider) and rdma_cm (verbs) modes.
#ifndef COVERBS_TESTS_HOSTILE_HOSTILE_H_
#define COVERBS_TESTS_HOSTILE_HOSTILE_H_

#include <chrono>
#include <cstdint>
#include <string>

namespace hostile {

struct Options {
  std::string mode;
  std::string address = "127.0.0.1";
  uint16_t port = 0;
  int count = 10;
  std::chrono::milliseconds hold{2000};
  uint64_t seed = 1;
};

inline constexpr char kUsage[] =
    "usage: hostile_client --mode=MODE --port=P [--address=127.0.0.1] "
    "[--count=10] [--hold_ms=2000] [--seed=1]\n";

// Returns "" or what is wrong. Every flag is --name=value; anything else
// (positional arguments, unknown flags, counts beyond 5000 or holds beyond
// 10 minutes) is refused.
std::string ParseOptions(int argc, char** argv, Options* o);

// A handshake (cm/handshake.h layout) any coverbs listener accepts, and one
// with absurd values.
std::string ValidHandshake();
std::string AbsurdHandshake();

int RunTcp(const Options& o);
// --mode=remote (hostile_remote.cc): `dial` opens a TCP connection to the
// server, `request` is the setup frame with a valid handshake.
int RunRemote(const Options& o, int (*dial)(const Options&),
              const std::string& request);
// --mode=rts_flood, rts_flood_touch (hostile_rts_flood.cc): rendezvous
// requests that are never finished, on one connection.
int RunRtsFlood(const Options& o, int (*dial)(const Options&),
                const std::string& request);
int RunRdmaCm(const Options& o);

}  // namespace hostile

#endif  // COVERBS_TESTS_HOSTILE_HOSTILE_H_
