// The connection layer against a peer that is a real process doing the bad
// thing: killed in the middle of a rendezvous, or stopped (SIGSTOP) while
// connected -- the cm_peer helper (cm_peer.cc), started with posix_spawn.
// On the host on the soft provider over 127.0.0.1; tests/vm runs it on
// Soft-RoCE and SoftiWARP (COVERBS_PROVIDER=verbs).
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "cm/listener.h"
#include "core/reactor.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/cm/test_util.h"

extern char** environ;

namespace coverbs::cm {
namespace {

class PeerProcessTest : public CmTest {
 protected:
  void SetUp() override {
    if (GetParam() == "loop") {
      GTEST_SKIP() << "the loop provider connects ends within one process: "
                      "a peer process cannot reach it";
    }
    CmTest::SetUp();
  }
};

// The cm_peer helper: COVERBS_CM_PEER, else its runfiles path.
std::string PeerHelperPath() {
  const char* helper = std::getenv("COVERBS_CM_PEER");
  return helper ? helper : "tests/cm/cm_peer";
}

// Starts the cm_peer helper process against a listener (`mode`: "" or
// "idle", see cm_peer.cc); -1 (and a test failure) if it cannot start.
// posix_spawn, not fork: this process has threads (the soft provider's
// progress thread), and a forked child may only call exec.
pid_t SpawnPeer(std::string path, std::string provider, std::string addr,
                uint16_t port, std::string mode) {
  std::string port_s = std::to_string(port);
  std::vector<char*> argv = {path.data(), provider.data(), addr.data(),
                             port_s.data()};
  if (!mode.empty()) argv.push_back(mode.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, path.c_str(), nullptr, nullptr, argv.data(),
                  environ) != 0) {
    ADD_FAILURE() << "posix_spawn " << path;
    return -1;
  }
  return pid;
}

// The cm_peer helper in "idle" mode, connected to a listener with `lo`
// and accepted, its "ready" message read. The caller kills it.
struct IdlePeer {
  pid_t pid = -1;
  std::unique_ptr<Connection> conn;
};
Task<absl::StatusOr<IdlePeer>> AcceptIdlePeer(CmTest* t, std::string path,
                                              ListenerOptions lo) {
  auto ln = Listener::Create(*t->server_ctx_, t->addr_, 0, lo);
  if (!ln.ok()) co_return ln.status();
  IdlePeer peer;
  peer.pid = SpawnPeer(path, t->GetParam(), t->addr_, (*ln)->port(), "idle");
  if (peer.pid < 0) co_return absl::InternalError("posix_spawn " + path);
  auto c = co_await (*ln)->Accept();
  if (!c.ok()) {
    kill(peer.pid, SIGKILL);
    waitpid(peer.pid, nullptr, 0);
    co_return c.status();
  }
  peer.conn = *std::move(c);
  auto first = co_await peer.conn->Recv();  // its "ready"
  EXPECT_TRUE(first.ok()) << first.status();
  co_return std::move(peer);
}

TEST_P(PeerProcessTest, PeerProcessKilledMidRendezvous) {
  std::string path = PeerHelperPath();
  if (access(path.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "peer helper binary not found at " << path;
  }
  Run([](CmTest* t, std::string path) -> Task<void> {
    auto ln = Listener::Create(*t->server_ctx_, t->addr_, 0);
    CO_ASSERT_OK(ln);
    pid_t pid = SpawnPeer(path, t->GetParam(), t->addr_, (*ln)->port(), "");
    if (pid < 0) co_return;
    auto c = co_await (*ln)->Accept();
    CO_ASSERT_OK(c);
    // The child announced a 64 MiB message and gets killed while it writes.
    auto first = co_await (*c)->Recv();
    CO_ASSERT_OK(first);  // its "ready" message
    // Kill it once its 64 MiB rendezvous is under way (we granted a buffer).
    for (int i = 0; i < 500 && (*c)->stats().rendezvous_received == 0; ++i) {
      co_await t->reactor_->Sleep(absl::Milliseconds(10));
    }
    EXPECT_EQ((*c)->stats().rendezvous_received, 1u);
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    auto m = co_await (*c)->Recv();
    EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
    EXPECT_FALSE((*c)->status().ok());
    // A killed peer is gone, not a flush error.
    EXPECT_EQ((*c)->close_cause(), CloseCause::kPeerGone) << (*c)->status();
    EXPECT_EQ((*c)->status().message().rfind("peer gone: ", 0), 0u)
        << (*c)->status();
    co_await (*c)->Close();
    // The listener and the worker keep working.
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    auto msg = Pattern(100000, 5);
    CO_ASSERT_OK(co_await p->client->Send(msg));
    auto g = co_await p->server->Recv();
    CO_ASSERT_OK(g);
    EXPECT_TRUE(Same(g->data(), msg));
    co_await p->client->Close();
    co_await p->server->Close();
  }(this, path));
}

// SIGSTOP, then wait until the process is really stopped: signal delivery
// to a running thread takes a moment, in which it may still answer.
void StopProcess(pid_t pid) {
  kill(pid, SIGSTOP);
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  for (int i = 0; i < 1000; ++i) {
    std::ifstream f(path);
    std::string stat((std::istreambuf_iterator<char>(f)),
                     std::istreambuf_iterator<char>());
    size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() &&
        stat[paren + 2] == 'T') {
      return;
    }
    usleep(1000);
  }
}

TEST_P(PeerProcessTest, KeepaliveDetectsAFrozenPeer) {
  std::string path = PeerHelperPath();
  if (access(path.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "peer helper binary not found at " << path;
  }
  Run([](CmTest* t, std::string path) -> Task<void> {
    ListenerOptions lo;
    lo.connection.keepalive_interval = absl::Milliseconds(100);
    lo.connection.keepalive_probes = 3;
    auto peer = co_await AcceptIdlePeer(t, path, lo);
    CO_ASSERT_OK(peer);
    pid_t pid = peer->pid;
    // Idle but alive: it answers the probes, for many intervals.
    co_await t->reactor_->Sleep(absl::Milliseconds(800));
    EXPECT_TRUE(peer->conn->status().ok()) << peer->conn->status();
    EXPECT_GE(peer->conn->stats().credit_messages_sent, 3u);
    // Frozen: its kernel (rxe/siw: the RNIC) still acknowledges, the
    // process answers nothing. rxe/siw: the unanswered probes fail it
    // (DeadlineExceeded); soft: the first probe's send already fails at the
    // soft RC transport timer (Unavailable, naming the keepalive message).
    StopProcess(pid);
    absl::Time start = absl::Now();
    auto m = co_await peer->conn->Recv();
    absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(m.status().code() == absl::StatusCode::kDeadlineExceeded ||
                m.status().code() == absl::StatusCode::kUnavailable)
        << m.status();
    EXPECT_NE(m.status().message().find("keepalive"), std::string_view::npos)
        << m.status();
    // rxe/siw: the probes went unanswered; soft: the probe's send met the
    // transport timer first.
    const CloseCause cause = peer->conn->close_cause();
    EXPECT_TRUE(cause == CloseCause::kKeepalive ||
                (t->GetParam() == "soft" &&
                 cause == CloseCause::kPeerUnreachable))
        << peer->conn->status();
    EXPECT_EQ(peer->conn->status().message().rfind(CloseCauseName(cause), 0),
              0u)
        << peer->conn->status();
    // 3 probes 100 ms apart after 100 ms of silence, then the verdict;
    // generous for emulation.
    EXPECT_LT(took, absl::Seconds(10));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    co_await peer->conn->Close();
  }(this, path));
}

TEST_P(PeerProcessTest, SendToAFrozenSoftPeerFailsAtTheTransportTimer) {
  if (GetParam() != "soft") {
    GTEST_SKIP() << "on rxe/siw the kernel acknowledges for a stopped "
                    "process: the transport never times out (keepalive "
                    "covers it, KeepaliveDetectsAFrozenPeer)";
  }
  std::string path = PeerHelperPath();
  if (access(path.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "peer helper binary not found at " << path;
  }
  Run([](CmTest* t, std::string path) -> Task<void> {
    ListenerOptions lo;
    lo.connection.qp.timeout = 14;   // 67 ms per attempt
    lo.connection.qp.retry_cnt = 2;  // 3 attempts: ~200 ms
    auto peer = co_await AcceptIdlePeer(t, path, lo);
    CO_ASSERT_OK(peer);
    pid_t pid = peer->pid;
    StopProcess(pid);
    absl::Time start = absl::Now();
    // A small message completes at its post (inline); the one after it is
    // too big to go inline and waits for its acknowledgement.
    auto small = Pattern(100, 1), big = Pattern(1000, 2);
    CO_ASSERT_OK(co_await peer->conn->Send(small));
    absl::Status s = co_await peer->conn->Send(big);
    absl::Duration took = absl::Now() - start;
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("RETRY_EXC_ERR"), std::string_view::npos) << s;
    EXPECT_GE(took, absl::Milliseconds(150));
    EXPECT_LT(took, absl::Seconds(5));
    // The connection is down with the first failure as its reason.
    EXPECT_NE(peer->conn->status().message().find("RETRY_EXC_ERR"),
              std::string_view::npos)
        << peer->conn->status();
    EXPECT_EQ(peer->conn->close_cause(), CloseCause::kPeerUnreachable);
    EXPECT_EQ(peer->conn->status().message().rfind(
                  "peer unreachable (transport retries exhausted): ", 0),
              0u)
        << peer->conn->status();
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    co_await peer->conn->Close();
  }(this, path));
}

INSTANTIATE_TEST_SUITE_P(Providers, PeerProcessTest,
                         ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
