// The listener under hostile peers, on the soft provider (raw TCP sockets
// play the attacker): silent and half-sent handshakes delay nobody, the
// pending-handshake cap evicts the oldest, the cap stays below the
// descriptor limit, a peer that completes the setup and then says nothing
// is dropped at the accept deadline, and running out of file descriptors
// never ends the listener (the oldest pending handshake gives its up).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cm/connect.h"
#include "cm/handshake.h"
#include "cm/listener.h"
#include "core/reactor.h"
#include "gtest/gtest.h"
#include "transport/device.h"

namespace coverbs::cm {
namespace {

// A raw client socket: blocking connect to 127.0.0.1:port.
int RawConnect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The soft provider's setup frame (transport/tcp_connector.cc): u32 magic
// "CVBS", u8 kind (1 = request), pad, u16 body length, body.
std::string RequestFrame(const std::string& body) {
  std::string f(8, '\0');
  uint32_t magic = 0x53425643;
  std::memcpy(f.data(), &magic, 4);
  f[4] = 1;
  uint16_t len = static_cast<uint16_t>(body.size());
  std::memcpy(f.data() + 6, &len, 2);
  return f + body;
}

std::string ValidHandshake() {
  Handshake h;
  h.credits = 8;
  h.recv_buffer_size = 16 + 8192;
  h.max_message_size = 1 << 20;
  auto e = EncodeHandshake(h);
  return e.ok() ? *e : std::string();
}

// True once `fd` reads EOF (or an error) within `ms`: the server dropped it.
bool ClosedByPeer(int fd, int ms) {
  absl::Time end = absl::Now() + absl::Milliseconds(ms);
  char buf[512];
  while (absl::Now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 20) <= 0) continue;
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      return true;
    }
  }
  return false;
}

size_t OpenFds() {
  size_t n = 0;
  for (auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)e;
    ++n;
  }
  return n;
}

class ListenerTest : public ::testing::Test {
 public:
  void SetUp() override {
    // Each test holds hundreds of sockets on both ends.
    rlimit rl{};
    getrlimit(RLIMIT_NOFILE, &rl);
    saved_rl_ = rl;
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, 8192);
    setrlimit(RLIMIT_NOFILE, &rl);
    auto r = Reactor::Create();
    ASSERT_TRUE(r.ok()) << r.status();
    reactor_ = *std::move(r);
    transport::ProviderOptions o;
    o.kind = transport::ProviderKind::kSoft;
    auto d = transport::Device::Open(o);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    auto a = Worker::Create(*reactor_, *device_);
    ASSERT_TRUE(a.ok()) << a.status();
    server_ctx_ = *std::move(a);
    auto b = Worker::Create(*reactor_, *device_);
    ASSERT_TRUE(b.ok()) << b.status();
    client_ctx_ = *std::move(b);
  }
  void TearDown() override {
    for (int fd : raw_) close(fd);
    raw_.clear();
    if (reactor_) reactor_->BlockOn(Settle(reactor_.get()));
    client_ctx_.reset();
    server_ctx_.reset();
    if (reactor_) reactor_->BlockOn(Settle(reactor_.get()));
    device_.reset();
    reactor_.reset();
    setrlimit(RLIMIT_NOFILE, &saved_rl_);
  }
  static Task<void> Settle(Reactor* r) {
    for (int i = 0; i < 20; ++i) {
      auto s = r->Sleep(absl::Milliseconds(10));
      co_await s;
    }
  }

  // Accepts connections on `ln` and keeps them until the test ends.
  static Task<void> Serve(Listener* ln,
                          std::vector<std::unique_ptr<Connection>>* keep) {
    for (;;) {
      auto a = ln->Accept();
      auto c = co_await std::move(a);
      if (!c.ok()) co_return;
      keep->push_back(*std::move(c));
    }
  }

  // One good client: connects, sends, and the time it took to connect.
  Task<absl::StatusOr<absl::Duration>> GoodClient(uint16_t port) {
    ConnectOptions o;
    o.connect_timeout = absl::Seconds(3);
    absl::Time start = absl::Now();
    auto c = co_await Connect(*client_ctx_, "127.0.0.1", port, o);
    if (!c.ok()) co_return c.status();
    absl::Duration took = absl::Now() - start;
    std::string hi = "hello";
    auto s = co_await (*c)->Send(std::as_bytes(std::span(hi)));
    if (!s.ok()) co_return s;
    // A small Send completes at its post: Close delivers it.
    s = co_await (*c)->Close();
    if (!s.ok()) co_return s;
    co_return took;
  }

  Task<void> Sleep(absl::Duration d) {
    auto s = reactor_->Sleep(d);
    co_await s;
  }

  rlimit saved_rl_{};
  std::unique_ptr<Reactor> reactor_;
  std::unique_ptr<transport::Device> device_;
  std::unique_ptr<Worker> server_ctx_, client_ctx_;
  std::vector<int> raw_;
};

TEST_F(ListenerTest, SilentAndHalfSentPeersDelayNobody) {
  reactor_->BlockOn([&]() -> Task<void> {
    ListenerOptions lo;
    lo.accept_timeout = absl::Seconds(30);  // the attackers stay pending
    auto ln = Listener::Create(*server_ctx_, "127.0.0.1", 0, lo);
    if (!ln.ok()) {
      ADD_FAILURE() << ln.status();
      co_return;
    }
    std::vector<std::unique_ptr<Connection>> served;
    std::stop_source stop;
    reactor_->Spawn(Serve(ln->get(), &served), stop.get_token());
    const uint16_t port = (*ln)->port();
    std::string half = RequestFrame(ValidHandshake()).substr(0, 5);
    for (int i = 0; i < 400; ++i) {
      int fd = RawConnect(port);
      if (fd < 0) {
        ADD_FAILURE() << "raw connect " << i << ": " << strerror(errno);
        co_return;
      }
      raw_.push_back(fd);
      // Every other one sends half of a setup frame, then nothing.
      if (i % 2 == 1) send(fd, half.data(), half.size(), MSG_NOSIGNAL);
    }
    co_await Sleep(absl::Milliseconds(200));
    for (int round = 0; round < 3; ++round) {
      auto took = co_await GoodClient(port);
      if (!took.ok()) {
        ADD_FAILURE() << "round " << round << ": " << took.status();
        continue;
      }
      EXPECT_LT(*took, absl::Seconds(1)) << "round " << round;
    }
    Listener::Stats st = (*ln)->stats();
    EXPECT_EQ(st.accepted, 3u);
    EXPECT_EQ(st.pending, 400u);
    EXPECT_EQ(st.evicted, 0u);
    stop.request_stop();
    (*ln)->Close();
    co_await Sleep(absl::Milliseconds(50));
  }());
}

TEST_F(ListenerTest, PendingHandshakesAboveTheCapEvictTheOldest) {
  reactor_->BlockOn([&]() -> Task<void> {
    ListenerOptions lo;
    lo.accept_timeout = absl::Seconds(30);
    lo.max_pending_handshakes = 8;
    auto ln = Listener::Create(*server_ctx_, "127.0.0.1", 0, lo);
    if (!ln.ok()) {
      ADD_FAILURE() << ln.status();
      co_return;
    }
    std::vector<std::unique_ptr<Connection>> served;
    std::stop_source stop;
    reactor_->Spawn(Serve(ln->get(), &served), stop.get_token());
    const uint16_t port = (*ln)->port();
    for (int i = 0; i < 20; ++i) {
      int fd = RawConnect(port);
      if (fd < 0) {
        ADD_FAILURE() << "raw connect: " << strerror(errno);
        co_return;
      }
      raw_.push_back(fd);
      // One at a time, so that "oldest" is well defined.
      for (int w = 0; w < 100 && (*ln)->stats().pending +
                                         (*ln)->stats().evicted <
                                     static_cast<size_t>(i + 1);
           ++w) {
        co_await Sleep(absl::Milliseconds(5));
      }
    }
    Listener::Stats st = (*ln)->stats();
    EXPECT_EQ(st.pending, 8u);
    EXPECT_EQ(st.evicted, 12u);
    // The 12 oldest were closed by the server, the newest 8 were not.
    co_await Sleep(absl::Milliseconds(50));
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(ClosedByPeer(raw_[i], i < 12 ? 1000 : 30), i < 12)
          << "socket " << i;
    }
    EXPECT_NE(st.last_reject_reason.find("max_pending_handshakes"),
              std::string::npos)
        << st.last_reject_reason;
    // A good client evicts one more and gets in.
    auto took = co_await GoodClient(port);
    EXPECT_TRUE(took.ok()) << took.status();
    EXPECT_EQ((*ln)->stats().accepted, 1u);
    stop.request_stop();
    (*ln)->Close();
    co_await Sleep(absl::Milliseconds(50));
  }());
}

TEST_F(ListenerTest, AcceptedThenSilentPeerIsDroppedAtTheDeadline) {
  reactor_->BlockOn([&]() -> Task<void> {
    ListenerOptions lo;
    lo.accept_timeout = absl::Milliseconds(300);
    auto ln = Listener::Create(*server_ctx_, "127.0.0.1", 0, lo);
    if (!ln.ok()) {
      ADD_FAILURE() << ln.status();
      co_return;
    }
    const uint16_t port = (*ln)->port();
    // A complete, valid setup frame; then nothing on the QP protocol.
    int fd = RawConnect(port);
    if (fd < 0) {
      ADD_FAILURE() << "raw connect: " << strerror(errno);
      co_return;
    }
    raw_.push_back(fd);
    std::string f = RequestFrame(ValidHandshake());
    EXPECT_EQ(send(fd, f.data(), f.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(f.size()));
    auto next = (*ln)->Next();
    auto req = co_await std::move(next);
    if (!req.ok()) {
      ADD_FAILURE() << req.status();
      co_return;
    }
    absl::Time start = absl::Now();
    auto accept = (*req)->Accept(*server_ctx_);
    auto conn = co_await std::move(accept);
    absl::Duration took = absl::Now() - start;
    EXPECT_EQ(conn.status().code(), absl::StatusCode::kDeadlineExceeded)
        << conn.status();
    EXPECT_NE(conn.status().message().find("sent nothing"),
              std::string_view::npos)
        << conn.status();
    EXPECT_GE(took, absl::Milliseconds(250));
    EXPECT_LT(took, absl::Seconds(2));
    EXPECT_EQ((*ln)->stats().rejected, 1u);
    // The server let go of the socket.
    EXPECT_TRUE(ClosedByPeer(fd, 2000));
    // And a real client is served as before.
    std::vector<std::unique_ptr<Connection>> served;
    std::stop_source stop;
    reactor_->Spawn(Serve(ln->get(), &served), stop.get_token());
    auto good = co_await GoodClient(port);
    EXPECT_TRUE(good.ok()) << good.status();
    stop.request_stop();
    (*ln)->Close();
    co_await Sleep(absl::Milliseconds(50));
  }());
}

TEST_F(ListenerTest, RunningOutOfFileDescriptorsNeverEndsTheListener) {
  reactor_->BlockOn([&]() -> Task<void> {
    auto ln = Listener::Create(*server_ctx_, "127.0.0.1", 0);
    if (!ln.ok()) {
      ADD_FAILURE() << ln.status();
      co_return;
    }
    std::vector<std::unique_ptr<Connection>> served;
    std::stop_source stop;
    reactor_->Spawn(Serve(ln->get(), &served), stop.get_token());
    const uint16_t port = (*ln)->port();
    // Leave the process 4 descriptors, then take them with raw clients:
    // the server's accept4 fails with EMFILE.
    rlimit rl{};
    getrlimit(RLIMIT_NOFILE, &rl);
    rlimit low = rl;
    low.rlim_cur = OpenFds() + 4;
    if (setrlimit(RLIMIT_NOFILE, &low) != 0) {
      ADD_FAILURE() << "setrlimit: " << strerror(errno);
      co_return;
    }
    std::vector<int> extra;
    for (int i = 0; i < 8; ++i) {
      int fd = RawConnect(port);
      if (fd >= 0) extra.push_back(fd);
      co_await Sleep(absl::Milliseconds(20));
    }
    for (int w = 0; w < 100 && (*ln)->stats().accept_errors == 0; ++w) {
      co_await Sleep(absl::Milliseconds(10));
    }
    Listener::Stats st = (*ln)->stats();
    EXPECT_GE(st.accept_errors, 1u);
    EXPECT_NE(st.last_accept_error.find("Too many open files"),
              std::string::npos)
        << st.last_accept_error;
    // Descriptors come back: the listener accepts again.
    for (int fd : extra) close(fd);
    EXPECT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
    auto took = co_await GoodClient(port);
    EXPECT_TRUE(took.ok()) << took.status();
    if (took.ok()) {
      EXPECT_LT(*took, absl::Seconds(2));
    }
    stop.request_stop();
    (*ln)->Close();
    co_await Sleep(absl::Milliseconds(50));
  }());
}

// The cap on pending handshakes keeps fd_reserve descriptors (at most half
// the limit) free under RLIMIT_NOFILE as it was at Create (issue #36: at
// ulimit -n 1024 the default cap of 1,024 let silent peers take every
// descriptor).
TEST_F(ListenerTest, PendingCapStaysBelowTheDescriptorLimit) {
  reactor_->BlockOn([&]() -> Task<void> {
    rlimit rl{};
    getrlimit(RLIMIT_NOFILE, &rl);
    rlimit low = rl;
    low.rlim_cur = 200;
    if (setrlimit(RLIMIT_NOFILE, &low) != 0) {
      ADD_FAILURE() << "setrlimit: " << strerror(errno);
      co_return;
    }
    ListenerOptions lo;
    lo.accept_timeout = absl::Seconds(30);  // the attackers stay pending
    auto ln = Listener::Create(*server_ctx_, "127.0.0.1", 0, lo);
    ListenerOptions small_reserve = lo;
    small_reserve.fd_reserve = 50;
    auto ln2 = Listener::Create(*server_ctx_, "127.0.0.1", 0, small_reserve);
    ListenerOptions small_cap = lo;
    small_cap.max_pending_handshakes = 8;
    auto ln3 = Listener::Create(*server_ctx_, "127.0.0.1", 0, small_cap);
    EXPECT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
    if (!ln.ok() || !ln2.ok() || !ln3.ok()) {
      ADD_FAILURE() << ln.status() << ln2.status() << ln3.status();
      co_return;
    }
    // 200 - min(256, 200 / 2); 200 - 50; the configured 8.
    EXPECT_EQ((*ln)->max_pending_handshakes(), 100u);
    EXPECT_EQ((*ln2)->max_pending_handshakes(), 150u);
    EXPECT_EQ((*ln3)->max_pending_handshakes(), 8u);
    (*ln2)->Close();
    (*ln3)->Close();
    // The cap holds (the limit is back up, the cap stays as computed).
    const uint16_t port = (*ln)->port();
    for (int i = 0; i < 120; ++i) {
      int fd = RawConnect(port);
      if (fd < 0) {
        ADD_FAILURE() << "raw connect " << i << ": " << strerror(errno);
        co_return;
      }
      raw_.push_back(fd);
    }
    for (int w = 0; w < 200 && (*ln)->stats().pending + (*ln)->stats().evicted <
                                    120;
         ++w) {
      co_await Sleep(absl::Milliseconds(10));
    }
    Listener::Stats st = (*ln)->stats();
    // At the cap of 100, six (100 / 16) go at once: the 101st, 107th, 113th
    // and 119th connections each evicted six, leaving 96 pending.
    EXPECT_EQ(st.pending, 96u);
    EXPECT_EQ(st.evicted, 24u);
    EXPECT_EQ(st.evicted_for_fds, 0u);
    (*ln)->Close();
    co_await Sleep(absl::Milliseconds(50));
  }());
}

// Out of descriptors with handshakes pending: accept's EMFILE drops the
// oldest pending one, which gives its descriptor back, and the next
// connection is taken with it.
TEST_F(ListenerTest, OutOfDescriptorsTheOldestPendingHandshakeGivesItsUp) {
  reactor_->BlockOn([&]() -> Task<void> {
    ListenerOptions lo;
    lo.accept_timeout = absl::Seconds(30);  // the attackers stay pending
    auto ln = Listener::Create(*server_ctx_, "127.0.0.1", 0, lo);
    if (!ln.ok()) {
      ADD_FAILURE() << ln.status();
      co_return;
    }
    std::vector<std::unique_ptr<Connection>> served;
    std::stop_source stop;
    reactor_->Spawn(Serve(ln->get(), &served), stop.get_token());
    const uint16_t port = (*ln)->port();
    for (int i = 0; i < 6; ++i) {
      int fd = RawConnect(port);
      if (fd < 0) {
        ADD_FAILURE() << "raw connect " << i << ": " << strerror(errno);
        co_return;
      }
      raw_.push_back(fd);
    }
    for (int w = 0; w < 100 && (*ln)->stats().pending < 6; ++w) {
      co_await Sleep(absl::Milliseconds(10));
    }
    EXPECT_EQ((*ln)->stats().pending, 6u);
    // Two client sockets made now (connected later: connecting takes no
    // descriptor), then every descriptor of the process taken.
    int shed = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int next = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (shed < 0 || next < 0) {
      ADD_FAILURE() << "socket: " << strerror(errno);
      co_return;
    }
    raw_.push_back(shed);
    raw_.push_back(next);
    std::vector<int> taken;
    for (int fd; (fd = dup(0)) >= 0;) taken.push_back(fd);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    auto* addr = reinterpret_cast<sockaddr*>(&sa);
    // The listener's accept fails with EMFILE: the connector closes the
    // waiting connection (its spare descriptor), the listener drops the
    // oldest pending handshake.
    EXPECT_EQ(connect(shed, addr, sizeof(sa)), 0) << strerror(errno);
    for (int w = 0; w < 200 && (*ln)->stats().evicted_for_fds == 0; ++w) {
      co_await Sleep(absl::Milliseconds(10));
    }
    Listener::Stats st = (*ln)->stats();
    EXPECT_GE(st.accept_errors, 1u);
    EXPECT_EQ(st.evicted_for_fds, 1u);
    EXPECT_EQ(st.evicted, 1u);
    EXPECT_EQ(st.pending, 5u);
    EXPECT_NE(st.last_reject_reason.find("free a descriptor"),
              std::string::npos)
        << st.last_reject_reason;
    EXPECT_TRUE(ClosedByPeer(raw_[0], 2000));  // the oldest
    EXPECT_FALSE(ClosedByPeer(raw_[1], 30));
    EXPECT_TRUE(ClosedByPeer(shed, 2000));
    // The descriptor it gave up takes the next connection, whose handshake
    // is read and answered.
    EXPECT_EQ(connect(next, addr, sizeof(sa)), 0) << strerror(errno);
    std::string f = RequestFrame(ValidHandshake());
    EXPECT_EQ(send(next, f.data(), f.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(f.size()));
    pollfd p{next, POLLIN, 0};
    for (int w = 0; w < 200 && poll(&p, 1, 0) == 0; ++w) {
      co_await Sleep(absl::Milliseconds(10));
    }
    char answer[8] = {};
    EXPECT_EQ(recv(next, answer, sizeof(answer), MSG_DONTWAIT), 8);
    EXPECT_EQ(answer[4], 2) << "not an accept frame";  // kind 2: accept
    // That took the free descriptor; the listener's next accept fails with
    // EMFILE although nothing waits (Linux takes the descriptor before it
    // looks for a connection), and the next oldest gives its up, so that
    // one is in hand for the next connection.
    for (int w = 0; w < 200 && (*ln)->stats().evicted_for_fds < 2; ++w) {
      co_await Sleep(absl::Milliseconds(10));
    }
    st = (*ln)->stats();
    EXPECT_EQ(st.evicted_for_fds, 2u);
    EXPECT_EQ(st.pending, 4u);
    EXPECT_TRUE(ClosedByPeer(raw_[1], 2000));
    EXPECT_FALSE(ClosedByPeer(raw_[2], 30));
    for (int fd : taken) close(fd);
    stop.request_stop();
    (*ln)->Close();
    co_await Sleep(absl::Milliseconds(50));
  }());
}

// A Listener destroyed while Accept() and Next() wait for requests, and with
// one Accept() created but not started yet: each completes with Cancelled
// and none touches the destroyed Listener (the ASan run checks that; they
// used to resume into it).
TEST_F(ListenerTest, DestroyedWhileAcceptWaitsCompletesCancelled) {
  reactor_->BlockOn([&]() -> Task<void> {
    auto ln = Listener::Create(*server_ctx_, "127.0.0.1", 0);
    if (!ln.ok()) {
      ADD_FAILURE() << ln.status();
      co_return;
    }
    absl::Status results[3] = {absl::UnknownError("not run"),
                               absl::UnknownError("not run"),
                               absl::UnknownError("not run")};
    int done = 0;
    auto take = [](auto task, absl::Status* out, int* done) -> Task<void> {
      auto r = co_await std::move(task);
      *out = r.status();
      ++*done;
    };
    reactor_->Spawn(take((*ln)->Accept(), &results[0], &done));
    reactor_->Spawn(take((*ln)->Next(), &results[1], &done));
    co_await reactor_->Sleep(absl::Milliseconds(20));  // both wait now
    EXPECT_EQ(done, 0);
    auto late = (*ln)->Accept();
    ln->reset();
    reactor_->Spawn(take(std::move(late), &results[2], &done));
    for (int i = 0; i < 500 && done < 3; ++i) {
      co_await reactor_->Sleep(absl::Milliseconds(10));
    }
    EXPECT_EQ(done, 3);
    for (const absl::Status& s : results) {
      EXPECT_TRUE(absl::IsCancelled(s)) << s;
    }
  }());
}

}  // namespace
}  // namespace coverbs::cm
