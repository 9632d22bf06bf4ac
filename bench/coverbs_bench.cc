// coverbs_bench: throughput, message rate and latency of coverbs connections
// and RPC, in perftest's spirit. See bench/README.md.
//
//   coverbs_bench --loopback --test=all --sizes=2..1M
//   coverbs_bench --server [--address=A] [--port=P]
//   coverbs_bench --client=A [--port=P] --test=send_bw --sizes=64,64K
//
// Layout: the server listens for cm connections on --port (send_bw,
// write_bw, read_bw, send_lat) and serves the "Echo" RPC on --port + 1
// (rpc_rate, rpc_lat). The client opens --connections connections spread
// over --threads reactors and, for every test and size, tells the server
// what comes with a small parameter message on each connection, runs
// --iters operations per connection with --depth in flight, and collects
// the server's verdict (and, on connection 0, the server's CPU time).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/report.h"
#include "cm/connection.h"
#include "cm/context.h"
#include "cm/listener.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "core/sync.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "transport/device.h"

ABSL_FLAG(bool, server, false, "Run the server side and wait for clients (until SIGINT/SIGTERM).");
ABSL_FLAG(std::string, client, "",
          "Run the client side against the coverbs_bench --server at this address.");
ABSL_FLAG(bool, loopback, false,
          "Run server and client in this process (separate devices, reactors and threads) "
          "over --address.");
ABSL_FLAG(std::string, address, "",
          "Server: address to listen on; loopback: address both sides use. Default: "
          "$COVERBS_TEST_ADDR, else $COVERBS_VM_ADDR_A, else 127.0.0.1 (verbs needs an "
          "address of the RDMA device's netdev).");
ABSL_FLAG(uint16_t, port, 18515,
          "cm port (send/write/read tests); the RPC server uses port + 1. Loopback picks "
          "free ports.");
ABSL_FLAG(int, rpc_port, -1,
          "RPC server port (rpc_rate, rpc_lat); -1 = --port + 1, 0 = any free port.");
ABSL_FLAG(std::string, test, "send_bw",
          "Tests to run, comma-separated: send_bw, write_bw, read_bw, send_lat, rpc_rate, "
          "rpc_lat, or all.");
ABSL_FLAG(std::string, sizes, "65536",
          "Message sizes: a list (64,4K,1M; K/M/G binary) and/or power-of-two ranges "
          "(2..8M).");
ABSL_FLAG(int64_t, iters, 1000, "Operations per connection for each test and size.");
ABSL_FLAG(int64_t, warmup, 100,
          "Untimed operations per connection before each test and size (first-touch "
          "page faults, lazy binding and cold caches stay out of the figures).");
ABSL_FLAG(absl::Duration, duration, absl::ZeroDuration(),
          "If set, repeat --iters batches for each test and size until this much time "
          "has passed (perftest -D).");
ABSL_FLAG(int, depth, 16,
          "Operations in flight per connection (bandwidth and rpc_rate tests; latency "
          "tests use 1).");
ABSL_FLAG(int, connections, 1, "Connections (each test runs on all at once).");
ABSL_FLAG(int, threads, 1, "Reactor threads per side; connections are spread over them.");
ABSL_FLAG(std::string, poll, "event",
          "How reactors wait for completions: event, busy or adaptive.");
ABSL_FLAG(std::string, provider, "auto", "verbs, soft, or auto (verbs if a device exists).");
ABSL_FLAG(std::string, device, "", "verbs device (e.g. rxe0); empty = first active.");
ABSL_FLAG(bool, verify, false,
          "Check data integrity and order: every message, written slot and read is "
          "checked against the pattern it must hold (costs throughput).");
ABSL_FLAG(std::string, json, "", "Write the results as JSON to this file.");
ABSL_FLAG(std::string, csv, "", "Write the results as CSV to this file.");
ABSL_FLAG(std::string, plot, "",
          "Write an SVG chart of throughput and message rate against size to this file.");
ABSL_FLAG(std::string, progress, "auto",
          "Progress line on stderr for runs longer than 2 s: on, off, or auto (on when "
          "stderr is a terminal).");
ABSL_FLAG(absl::Duration, run_timeout, absl::Minutes(5),
          "Limit for one test at one size; beyond it the run is cancelled and reported "
          "as failed.");
#ifdef COVERBS_BENCH_FAULT_INJECTION
ABSL_FLAG(int64_t, corrupt_message, -1,
          "Test builds only: send_bw flips one byte of this message (per connection) "
          "after filling it, so that --verify must catch it.");
#endif

namespace coverbs::bench {
namespace {

using transport::LocalBuffer;
using transport::MemoryRegion;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x4e425643;  // "CVBN"
enum Op : uint16_t { kOpRun = 1, kOpCpuBegin = 2, kOpCpuEnd = 3 };

// Client -> server, one message before each run on each connection.
struct Params {
  uint32_t magic = kMagic;
  uint16_t op = kOpRun;
  uint16_t test = 0;
  uint64_t size = 0;
  uint64_t iters = 0;
  uint32_t slots = 0;  // write_bw / read_bw: slots of `size` in the region
  uint32_t verify = 0;
};

// Server -> client at the end of each run.
struct Reply {
  uint32_t magic = kMagic;
  uint32_t ok = 1;
  uint64_t mismatches = 0;
  uint64_t errors = 0;
  double cpu_seconds = 0;
  char error[96] = {};
};

std::span<const std::byte> AsBytes(const auto& v) {
  return {reinterpret_cast<const std::byte*>(&v), sizeof(v)};
}

// The byte at `index` of payload number `tag`; cheap enough for --verify.
inline std::byte PatternByte(uint64_t tag, size_t index) {
  return static_cast<std::byte>((tag * 0x9E3779B1u + index * 7 + (index >> 8)) & 0xff);
}
void FillPattern(std::span<std::byte> out, uint64_t tag) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = PatternByte(tag, i);
}
int64_t FirstMismatch(std::span<const std::byte> in, uint64_t tag) {
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != PatternByte(tag, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

double ThreadCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// CPU of every reactor thread of `pool`, from a thread outside it.
double PoolCpuBlocking(ReactorPool& pool) {
  double sum = 0;
  for (size_t i = 0; i < pool.size(); ++i) {
    std::promise<double> p;
    auto f = p.get_future();
    pool.Post(i, [&p]() { p.set_value(ThreadCpuSeconds()); });
    sum += f.get();
  }
  return sum;
}

// The same from a coroutine on one of the pool's reactors.
Task<double> PoolCpuAsync(ReactorPool* pool) {
  double sum = 0;
  for (size_t i = 0; i < pool->size(); ++i) {
    if (&pool->reactor(i) == Reactor::Current()) {
      sum += ThreadCpuSeconds();
      continue;
    }
    auto ev = std::make_shared<Event>();
    auto v = std::make_shared<double>(0);
    pool->Post(i, [ev, v]() {
      *v = ThreadCpuSeconds();
      ev->Set();
    });
    (void)co_await ev->Wait();
    sum += *v;
  }
  co_return sum;
}

// One cm::Context per reactor of a pool, created and destroyed on its thread.
struct Side {
  std::unique_ptr<transport::Device> device;
  std::unique_ptr<ReactorPool> pool;
  std::vector<std::unique_ptr<cm::Context>> contexts;

  static absl::StatusOr<std::unique_ptr<Side>> Create(int threads, PollMode poll) {
    auto side = std::make_unique<Side>();
    transport::ProviderOptions po;
    po.kind = absl::GetFlag(FLAGS_provider);
    po.device = absl::GetFlag(FLAGS_device);
    auto d = transport::Device::Open(po);
    if (!d.ok()) return d.status();
    side->device = *std::move(d);
    ReactorOptions ro;
    ro.poll_mode = poll;
    auto pool = ReactorPool::Create(threads, ro);
    if (!pool.ok()) return pool.status();
    side->pool = *std::move(pool);
    for (size_t i = 0; i < side->pool->size(); ++i) {
      std::promise<absl::StatusOr<std::unique_ptr<cm::Context>>> p;
      auto f = p.get_future();
      Side* s = side.get();
      s->pool->Post(i, [&p, s, i]() {
        cm::ContextOptions co;
        // Room for many connections with deep queues on one CQ.
        co.cq_entries = 8192;
        p.set_value(cm::Context::Create(s->pool->reactor(i), *s->device, co));
      });
      auto ctx = f.get();
      if (!ctx.ok()) return ctx.status();
      side->contexts.push_back(*std::move(ctx));
    }
    return side;
  }
  ~Side() {
    for (size_t i = 0; i < contexts.size(); ++i) {
      std::promise<void> p;
      auto f = p.get_future();
      pool->Post(i, [this, &p, i]() {
        contexts[i].reset();
        p.set_value();
      });
      f.get();
    }
    if (pool) pool->Stop();
  }
  std::vector<cm::Context*> context_ptrs() const {
    std::vector<cm::Context*> v;
    for (const auto& c : contexts) v.push_back(c.get());
    return v;
  }
};

cm::ConnectionOptions BenchConnectionOptions() {
  cm::ConnectionOptions o;
  // Deep enough for --depth in flight plus the control messages.
  int depth = std::max(absl::GetFlag(FLAGS_depth), 1);
  o.recv_credits = std::clamp<uint32_t>(depth * 2, 64, 512);
  o.send_depth = std::clamp<uint32_t>(depth * 2, 64, 512);
  return o;
}

// ---------------------------------------------------------------- server

class Server {
 public:
  explicit Server(Side* side) : side_(side) {}

  absl::Status Start(const std::string& address, uint16_t port, uint16_t rpc_port) {
    cm::ListenerOptions lo;
    lo.connection = BenchConnectionOptions();
    std::promise<absl::StatusOr<std::unique_ptr<cm::Listener>>> p;
    auto f = p.get_future();
    side_->pool->Post(0, [&]() {
      p.set_value(cm::Listener::Create(*side_->contexts[0], address, port, lo));
    });
    auto ln = f.get();
    if (!ln.ok()) return ln.status();
    port_ = (*ln)->port();
    side_->pool->Spawn(0, AcceptLoop(*std::move(ln)), stop_.get_token());

    rpc::ServerOptions ro;
    ro.listener.connection = BenchConnectionOptions();
    ro.max_concurrent_calls = 512;
    rpc_ = std::make_unique<rpc::Server>(ro);
    absl::Status s = rpc_->Register(
        "Echo", [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
          co_return std::move(r.payload);
        });
    if (!s.ok()) return s;
    return rpc_->Start(side_->context_ptrs(), address, rpc_port);
  }
  uint16_t port() const { return port_; }
  uint16_t rpc_port() const { return rpc_->port(); }

  // Stops accepting and waits until every bench connection ended.
  void Shutdown() {
    rpc_->Shutdown();
    stop_.request_stop();
    for (int i = 0; i < 5000 && live_.load() > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  Task<void> AcceptLoop(std::unique_ptr<cm::Listener> ln) {
    ++live_;
    size_t next = 0;
    while (true) {
      auto req = co_await ln->Next();
      if (!req.ok()) break;  // cancelled by Shutdown
      size_t i = next++ % side_->contexts.size();
      side_->pool->Spawn(i, AcceptAndServe(*std::move(req), side_->contexts[i].get()),
                         stop_.get_token());
    }
    ln->Close();
    --live_;
  }

  Task<void> AcceptAndServe(std::unique_ptr<cm::ConnectRequest> req, cm::Context* ctx) {
    ++live_;
    auto conn = co_await req->Accept(*ctx);
    if (conn.ok()) {
      co_await Serve(conn->get());
      (void)co_await (*conn)->Close();
    } else {
      std::fprintf(stderr, "coverbs_bench: accept: %s\n", conn.status().ToString().c_str());
    }
    --live_;
  }

  Task<void> Serve(cm::Connection* conn) {
    while (true) {
      Params p;
      {
        auto m = co_await conn->Recv();
        if (!m.ok()) co_return;  // the client is done (or gone)
        if (m->size() != sizeof(Params)) {
          std::fprintf(stderr, "coverbs_bench: %s: expected parameters, got %zu bytes\n",
                       conn->name().c_str(), m->size());
          co_return;
        }
        std::memcpy(&p, m->data().data(), sizeof(p));
      }
      if (p.magic != kMagic) {
        std::fprintf(stderr, "coverbs_bench: %s: bad parameter magic\n", conn->name().c_str());
        co_return;
      }
      Reply rep;
      if (p.op == kOpCpuBegin) {
        cpu_begin_ = co_await PoolCpuAsync(side_->pool.get());
      } else if (p.op == kOpCpuEnd) {
        rep.cpu_seconds = co_await PoolCpuAsync(side_->pool.get()) - cpu_begin_;
      } else {
        absl::Status s = co_await Run(conn, p, &rep);
        if (!s.ok()) {
          rep.ok = 0;
          absl::SNPrintF(rep.error, sizeof(rep.error), "%s", s.ToString());
        }
      }
      if (!(co_await conn->Send(AsBytes(rep))).ok()) co_return;
    }
  }

  static void Mismatch(Reply* rep, const std::string& what) {
    if (rep->mismatches++ == 0) absl::SNPrintF(rep->error, sizeof(rep->error), "%s", what);
  }

  Task<absl::Status> Run(cm::Connection* conn, const Params& p, Reply* rep) {
    const Test test = static_cast<Test>(p.test);
    if (test == Test::kSendBw) {
      for (uint64_t i = 0; i < p.iters; ++i) {
        auto m = co_await conn->Recv();
        if (!m.ok()) co_return m.status();
        if (!p.verify) continue;
        if (m->size() != p.size) {
          Mismatch(rep, absl::StrFormat("message %d: %d bytes, expected %d", i, m->size(),
                                        p.size));
        } else if (int64_t at = FirstMismatch(m->data(), i); at >= 0) {
          Mismatch(rep, absl::StrFormat("message %d: byte %d differs", i, at));
        }
      }
      co_return absl::OkStatus();
    }
    if (test == Test::kSendLat) {
      std::vector<std::byte> mem(std::max<uint64_t>(p.size, 1));
      auto mr = conn->context().pd().Register(mem.data(), mem.size(), IBV_ACCESS_LOCAL_WRITE);
      if (!mr.ok()) co_return mr.status();
      LocalBuffer lb = mr->Local();
      lb.length = p.size;
      for (uint64_t i = 0; i < p.iters; ++i) {
        auto m = co_await conn->Recv();
        if (!m.ok()) co_return m.status();
        if (p.verify && (m->size() != p.size || FirstMismatch(m->data(), i) >= 0)) {
          Mismatch(rep, absl::StrFormat("ping %d differs", i));
        }
        if (size_t n = std::min<size_t>(m->size(), p.size); n > 0) {
          std::memcpy(mem.data(), m->data().data(), n);
        }
        m = absl::CancelledError("");  // give the receive buffer back first
        absl::Status s = co_await conn->Send(lb);
        if (!s.ok()) co_return s;
      }
      co_return absl::OkStatus();
    }
    if (test == Test::kWriteBw || test == Test::kReadBw) {
      const bool write = test == Test::kWriteBw;
      const size_t bytes = std::max<uint64_t>(p.size * p.slots, 1);
      std::vector<std::byte> mem(bytes);
      if (!write) {
        for (uint32_t k = 0; k < p.slots; ++k) {
          FillPattern(std::span(mem).subspan(k * p.size, p.size), k);
        }
      }
      const int access = IBV_ACCESS_LOCAL_WRITE |
                         (write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ);
      auto mr = conn->context().pd().Register(mem.data(), mem.size(), access);
      if (!mr.ok()) co_return mr.status();
      auto token = conn->Expose(*mr, write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ);
      if (!token.ok()) co_return token.status();
      std::string enc = token->Encode();
      absl::Status s = co_await conn->Send(
          std::span(reinterpret_cast<const std::byte*>(enc.data()), enc.size()));
      if (!s.ok()) co_return s;
      // The client's "done": for write_bw the tag last written to each slot.
      auto done = co_await conn->Recv();
      if (!done.ok()) co_return done.status();
      // Revoke before checking: no write can land while we look.
      mr->Deregister();
      if (write && p.verify) {
        if (done->size() != p.slots * sizeof(uint64_t)) {
          co_return absl::InvalidArgumentError("bad write_bw done message");
        }
        for (uint32_t k = 0; k < p.slots; ++k) {
          uint64_t tag;
          std::memcpy(&tag, done->data().data() + k * 8, 8);
          if (tag == ~uint64_t{0}) continue;  // never written
          if (int64_t at = FirstMismatch(std::span(mem).subspan(k * p.size, p.size), tag);
              at >= 0) {
            Mismatch(rep, absl::StrFormat("slot %d (write %d): byte %d differs", k, tag, at));
          }
        }
      }
      co_return absl::OkStatus();
    }
    co_return absl::InvalidArgumentError(absl::StrCat("unknown test ", p.test));
  }

  Side* side_;
  uint16_t port_ = 0;
  std::unique_ptr<rpc::Server> rpc_;
  std::stop_source stop_;
  std::atomic<int> live_{0};
  double cpu_begin_ = 0;  // connection 0's reactor only
};

// ---------------------------------------------------------------- client

// What one connection's driver measured in one run.
struct ConnRun {
  Clock::time_point start, end;
  std::vector<int64_t> lat_ns;
  uint64_t ops = 0, errors = 0, mismatches = 0;
  std::string first_error;
  void Error(const absl::Status& s) {
    if (errors++ == 0) first_error = s.ToString();
  }
  void Mismatch(std::string what) {
    if (mismatches++ == 0) first_error = std::move(what);
  }
};

struct ClientConn {
  cm::Context* ctx = nullptr;
  size_t reactor = 0;
  std::unique_ptr<cm::Connection> conn;
  std::unique_ptr<rpc::Client> rpc;
  // Registered local memory, kept across runs (grown on demand).
  std::vector<std::byte> mem;
  MemoryRegion mr;
};

std::atomic<uint64_t> g_progress_ops{0};

// A window of `depth` operations in flight over `slots` local buffers.
struct Window {
  explicit Window(int depth) : free_slots(depth), sem(depth) {
    for (int i = 0; i < depth; ++i) free_slots[i] = depth - 1 - i;
  }
  std::vector<int> free_slots;
  Semaphore sem;
  WaitGroup wg;
};

Task<absl::Status> EnsureMemory(ClientConn* c, size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  if (c->mem.size() >= bytes && c->mr.valid()) co_return absl::OkStatus();
  c->mr.Deregister();
  c->mem.assign(bytes, std::byte{0});
  auto mr = c->ctx->pd().Register(c->mem.data(), c->mem.size(), IBV_ACCESS_LOCAL_WRITE);
  if (!mr.ok()) co_return mr.status();
  c->mr = std::move(*mr);
  co_return absl::OkStatus();
}

LocalBuffer Slot(ClientConn* c, int slot, size_t size) {
  LocalBuffer lb = c->mr.Local();
  lb.addr = c->mem.data() + slot * size;
  lb.length = size;
  return lb;
}

Task<void> SendOne(ClientConn* c, Window* w, int slot, LocalBuffer lb, ConnRun* out) {
  auto t0 = Clock::now();
  absl::Status s = co_await c->conn->Send(lb);
  out->lat_ns.push_back((Clock::now() - t0).count());
  if (!s.ok()) out->Error(s);
  ++out->ops;
  g_progress_ops.fetch_add(1, std::memory_order_relaxed);
  w->free_slots.push_back(slot);
  w->sem.Release();
  w->wg.Done();
}

Task<void> OneSided(ClientConn* c, Window* w, int slot, LocalBuffer lb,
                    transport::RemoteRegion remote, bool write, uint64_t check_tag,
                    bool verify, ConnRun* out) {
  auto t0 = Clock::now();
  absl::Status s;
  if (write) {
    s = co_await c->conn->Write(lb, remote);
  } else {
    s = co_await c->conn->Read(lb, remote);
  }
  out->lat_ns.push_back((Clock::now() - t0).count());
  if (!s.ok()) {
    out->Error(s);
  } else if (verify && !write) {
    std::span<const std::byte> got(static_cast<const std::byte*>(lb.addr), lb.length);
    if (int64_t at = FirstMismatch(got, check_tag); at >= 0) {
      out->Mismatch(absl::StrFormat("read of slot %d: byte %d differs", check_tag, at));
    }
  }
  ++out->ops;
  g_progress_ops.fetch_add(1, std::memory_order_relaxed);
  w->free_slots.push_back(slot);
  w->sem.Release();
  w->wg.Done();
}

Task<void> CallOne(ClientConn* c, Window* w, int slot, std::span<const std::byte> req,
                   bool verify, ConnRun* out) {
  auto t0 = Clock::now();
  auto r = co_await c->rpc->Call("Echo", req);
  out->lat_ns.push_back((Clock::now() - t0).count());
  if (!r.ok()) {
    out->Error(r.status());
  } else if (verify && (r->size() != req.size() ||
                        (!req.empty() && std::memcmp(r->data().data(), req.data(),
                                                     req.size()) != 0))) {
    out->Mismatch("echoed payload differs from the request");
  }
  ++out->ops;
  g_progress_ops.fetch_add(1, std::memory_order_relaxed);
  w->free_slots.push_back(slot);
  w->sem.Release();
  w->wg.Done();
}

// Sends the parameters and, at the end, reads the server's verdict.
Task<absl::Status> SendParams(ClientConn* c, const Params& p) {
  co_return co_await c->conn->Send(AsBytes(p));
}

Task<absl::Status> ReadReply(ClientConn* c, ConnRun* out, Reply* rep_out = nullptr) {
  auto m = co_await c->conn->Recv();
  if (!m.ok()) co_return m.status();
  Reply rep;
  if (m->size() != sizeof(rep)) co_return absl::DataLossError("bad reply from the server");
  std::memcpy(&rep, m->data().data(), sizeof(rep));
  if (rep.magic != kMagic) co_return absl::DataLossError("bad reply magic");
  rep.error[sizeof(rep.error) - 1] = '\0';
  if (!rep.ok) {
    co_return absl::InternalError(absl::StrCat("server: ", rep.error));
  }
  if (rep.mismatches > 0) {
    out->mismatches += rep.mismatches;
    if (out->first_error.empty()) out->first_error = absl::StrCat("server: ", rep.error);
  }
  if (rep_out != nullptr) *rep_out = rep;
  co_return absl::OkStatus();
}

struct RunSpec {
  Test test;
  uint64_t size;
  uint64_t iters;
  int depth;
  bool verify;
  int64_t corrupt_message = -1;
  std::stop_token stop;  // the run's limit (--run_timeout)
};

// Waits for every operation of the window, even when the run is being
// cancelled: they reference the window and the registered memory.
Task<void> WaitChildren(Window* w) { (void)co_await w->wg.Wait(); }
Task<void> Drain(Window* w) {
  Task<void> t = WaitChildren(w);
  t.SetStopToken({});
  co_await std::move(t);
}

// Takes a free slot, waiting while `depth` operations are in flight.
Task<absl::StatusOr<int>> TakeSlot(Window* w) {
  absl::Status s = co_await w->sem.Acquire();
  if (!s.ok()) co_return s;
  int slot = w->free_slots.back();
  w->free_slots.pop_back();
  w->wg.Add(1);
  co_return slot;
}

Task<absl::Status> DriveInner(ClientConn* c, const RunSpec& spec, ConnRun* out) {
  const size_t size = spec.size;
  const int depth = IsLatencyTest(spec.test) ? 1 : spec.depth;
  Reactor* r = Reactor::Current();
  out->lat_ns.reserve(spec.iters);

  if (spec.test == Test::kRpcRate || spec.test == Test::kRpcLat) {
    absl::Status s = co_await EnsureMemory(c, size * depth);
    if (!s.ok()) co_return s;
    Window w(depth);
    out->start = Clock::now();
    for (uint64_t i = 0; i < spec.iters; ++i) {
      auto slot = co_await TakeSlot(&w);
      if (!slot.ok()) break;
      std::span<std::byte> req(c->mem.data() + *slot * size, size);
      if (spec.verify) FillPattern(req, i);
      r->Spawn(CallOne(c, &w, *slot, req, spec.verify, out), spec.stop);
    }
    co_await Drain(&w);
    out->end = Clock::now();
    co_return absl::OkStatus();
  }

  Params p;
  p.test = static_cast<uint16_t>(spec.test);
  p.size = size;
  p.iters = spec.iters;
  p.slots = depth;
  p.verify = spec.verify;
  absl::Status s = co_await SendParams(c, p);
  if (!s.ok()) co_return s;
  s = co_await EnsureMemory(c, size * depth);
  if (!s.ok()) co_return s;

  if (spec.test == Test::kSendBw) {
    Window w(depth);
    if (!spec.verify) std::memset(c->mem.data(), 0x5a, c->mem.size());
    out->start = Clock::now();
    for (uint64_t i = 0; i < spec.iters; ++i) {
      auto slot = co_await TakeSlot(&w);
      if (!slot.ok()) break;
      LocalBuffer lb = Slot(c, *slot, size);
      if (spec.verify) {
        std::span<std::byte> b(static_cast<std::byte*>(lb.addr), size);
        FillPattern(b, i);
        if (static_cast<int64_t>(i) == spec.corrupt_message && size > 0) {
          b[size / 2] ^= std::byte{0x01};  // the fault --verify must catch
        }
      }
      r->Spawn(SendOne(c, &w, *slot, lb, out), spec.stop);
    }
    co_await Drain(&w);
    // The bandwidth counts until the server has received every message.
    s = co_await ReadReply(c, out);
    out->end = Clock::now();
    co_return s;
  }

  if (spec.test == Test::kSendLat) {
    LocalBuffer lb = Slot(c, 0, size);
    std::span<std::byte> b(static_cast<std::byte*>(lb.addr), size);
    out->start = Clock::now();
    for (uint64_t i = 0; i < spec.iters; ++i) {
      if (spec.verify) FillPattern(b, i);
      auto t0 = Clock::now();
      s = co_await c->conn->Send(lb);
      if (!s.ok()) co_return s;
      auto m = co_await c->conn->Recv();
      if (!m.ok()) co_return m.status();
      out->lat_ns.push_back((Clock::now() - t0).count() / 2);
      ++out->ops;
      g_progress_ops.fetch_add(1, std::memory_order_relaxed);
      if (spec.verify && (m->size() != size || FirstMismatch(m->data(), i) >= 0)) {
        out->Mismatch(absl::StrFormat("pong %d differs", i));
      }
    }
    out->end = Clock::now();
    co_return co_await ReadReply(c, out);
  }

  // write_bw / read_bw: the server's region token first.
  const bool write = spec.test == Test::kWriteBw;
  transport::RemoteRegion remote;
  {
    auto m = co_await c->conn->Recv();
    if (!m.ok()) co_return m.status();
    auto token = cm::RegionToken::Decode(m->data());
    if (!token.ok()) co_return token.status();
    remote = token->region;
  }
  std::vector<uint64_t> last_tag(depth, ~uint64_t{0});
  Window w(depth);
  out->start = Clock::now();
  for (uint64_t i = 0; i < spec.iters; ++i) {
    auto slot = co_await TakeSlot(&w);
    if (!slot.ok()) break;
    LocalBuffer lb = Slot(c, *slot, size);
    // Writes go to the remote slot of the local one, so no two writes in
    // flight target the same bytes; reads cycle over the server's slots.
    const uint32_t rslot = write ? *slot : static_cast<uint32_t>(i % depth);
    if (spec.verify) {
      std::span<std::byte> b(static_cast<std::byte*>(lb.addr), size);
      if (write) {
        FillPattern(b, i);
        last_tag[*slot] = i;
      } else {
        std::memset(b.data(), 0, size);
      }
    }
    r->Spawn(OneSided(c, &w, *slot, lb, remote.Slice(rslot * size, size), write, rslot,
                      spec.verify, out),
             spec.stop);
  }
  co_await Drain(&w);
  out->end = Clock::now();
  std::vector<std::byte> done(write ? depth * sizeof(uint64_t) : 0);
  if (write) std::memcpy(done.data(), last_tag.data(), done.size());
  s = co_await c->conn->Send(done);
  if (!s.ok()) co_return s;
  co_return co_await ReadReply(c, out);
}

Task<void> Drive(ClientConn* c, RunSpec spec, ConnRun* out, std::promise<void>* done) {
  absl::Status s = co_await DriveInner(c, spec, out);
  if (!s.ok()) out->Error(s);
  if (out->start == Clock::time_point{}) out->start = Clock::now();
  if (out->end == Clock::time_point{}) out->end = Clock::now();
  done->set_value();
}

// Runs `body` on reactor `i` of `side` and waits for it (from main).
template <typename T>
T RunOn(Side* side, size_t i, absl::AnyInvocable<Task<T>()> body) {
  std::promise<T> p;
  auto f = p.get_future();
  side->pool->Spawn(i, [](absl::AnyInvocable<Task<T>()> b, std::promise<T>* p) -> Task<void> {
    p->set_value(co_await b());
  }(std::move(body), &p));
  return f.get();
}

class Client {
 public:
  Client(Side* side, std::string address, uint16_t port, uint16_t rpc_port)
      : side_(side), address_(std::move(address)), port_(port), rpc_port_(rpc_port) {}

  ~Client() {
    for (auto& c : conns_) {
      RunOn<bool>(side_, c->reactor, [c = c.get()]() -> Task<bool> {
        if (c->rpc) (void)co_await c->rpc->Close();
        if (c->conn) (void)co_await c->conn->Close();
        c->rpc.reset();
        c->conn.reset();
        c->mr.Deregister();
        co_return true;
      });
    }
  }

  absl::Status Connect(int n) {
    for (int k = 0; k < n; ++k) {
      auto c = std::make_unique<ClientConn>();
      c->reactor = k % side_->contexts.size();
      c->ctx = side_->contexts[c->reactor].get();
      ClientConn* cp = c.get();
      absl::Status s = RunOn<absl::Status>(side_, c->reactor, [this, cp]() -> Task<absl::Status> {
        cm::ConnectOptions o;
        o.connection = BenchConnectionOptions();
        auto conn = co_await cm::Connect(*cp->ctx, address_, port_, o);
        if (!conn.ok()) co_return conn.status();
        cp->conn = *std::move(conn);
        co_return absl::OkStatus();
      });
      if (!s.ok()) {
        return absl::UnavailableError(absl::StrCat("connecting to ", address_, ":", port_,
                                                   ": ", s.ToString()));
      }
      conns_.push_back(std::move(c));
    }
    return absl::OkStatus();
  }

  absl::Status ConnectRpc() {
    for (auto& c : conns_) {
      if (c->rpc) continue;
      ClientConn* cp = c.get();
      absl::Status s = RunOn<absl::Status>(side_, c->reactor, [this, cp]() -> Task<absl::Status> {
        rpc::ClientOptions o;
        o.connect.connection = BenchConnectionOptions();
        auto cl = co_await rpc::Client::Connect(*cp->ctx, address_, rpc_port_, o);
        if (!cl.ok()) co_return cl.status();
        cp->rpc = *std::move(cl);
        co_return absl::OkStatus();
      });
      if (!s.ok()) {
        return absl::UnavailableError(absl::StrCat("connecting the RPC client to ", address_,
                                                   ":", rpc_port_, ": ", s.ToString()));
      }
    }
    return absl::OkStatus();
  }

  // The server's reactor CPU (seconds) between the two calls.
  absl::Status ServerCpu(Op op, double* seconds) {
    ClientConn* c = conns_[0].get();
    return RunOn<absl::Status>(side_, c->reactor, [c, op, seconds]() -> Task<absl::Status> {
      Params p;
      p.op = op;
      absl::Status s = co_await SendParams(c, p);
      if (!s.ok()) co_return s;
      ConnRun ignored;
      Reply rep;
      s = co_await ReadReply(c, &ignored, &rep);
      *seconds = rep.cpu_seconds;
      co_return s;
    });
  }

  // One batch of spec.iters per connection; returns false if it had to be
  // abandoned (timeout). Appends to `runs`.
  bool RunBatch(RunSpec spec, std::vector<ConnRun>* runs, bool progress,
                const std::string& label) {
    std::stop_source stop;
    spec.stop = stop.get_token();
    std::vector<ConnRun> batch(conns_.size());
    std::vector<std::promise<void>> done(conns_.size());
    std::vector<std::future<void>> futures;
    for (size_t k = 0; k < conns_.size(); ++k) {
      futures.push_back(done[k].get_future());
      side_->pool->Spawn(conns_[k]->reactor, Drive(conns_[k].get(), spec, &batch[k], &done[k]),
                         spec.stop);
    }
    const auto t0 = Clock::now();
    const auto limit = t0 + absl::ToChronoNanoseconds(absl::GetFlag(FLAGS_run_timeout));
    const uint64_t total = spec.iters * conns_.size();
    const uint64_t base = g_progress_ops.load();
    bool shown = false, ok = true;
    for (auto& f : futures) {
      while (f.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready) {
        auto now = Clock::now();
        if (progress && now - t0 > std::chrono::seconds(2)) {
          std::fprintf(stderr, "\r%s: %llu/%llu ops, %.0f s   ", label.c_str(),
                       static_cast<unsigned long long>(g_progress_ops.load() - base),
                       static_cast<unsigned long long>(total),
                       std::chrono::duration<double>(now - t0).count());
          shown = true;
        }
        if (ok && now > limit) {
          std::fprintf(stderr, "\ncoverbs_bench: %s exceeded --run_timeout, cancelling\n",
                       label.c_str());
          stop.request_stop();
          ok = false;
        }
        if (!ok && now > limit + std::chrono::seconds(30)) {
          std::fprintf(stderr, "coverbs_bench: %s did not unwind 30 s after cancellation; "
                               "exiting\n", label.c_str());
          std::_Exit(3);
        }
      }
    }
    if (shown) std::fprintf(stderr, "\r%*s\r", 60, "");
    for (auto& b : batch) runs->push_back(std::move(b));
    return ok;
  }

  size_t size() const { return conns_.size(); }

 private:
  Side* side_;
  std::string address_;
  uint16_t port_, rpc_port_;
  std::vector<std::unique_ptr<ClientConn>> conns_;
};

std::string DefaultAddress() {
  if (const char* a = std::getenv("COVERBS_TEST_ADDR"); a && *a) return a;
  if (const char* a = std::getenv("COVERBS_VM_ADDR_A"); a && *a) return a;
  return "127.0.0.1";
}

std::string Describe(const transport::Device& d) {
  if (d.caps().provider == "soft") return "soft";
  return absl::StrCat(d.caps().provider, " (", d.name(), ")");
}

Result Aggregate(Test test, uint64_t size, int conns, int depth, bool verify,
                 std::vector<ConnRun>& runs, double wall_seconds) {
  Result r;
  r.test = test;
  r.size = size;
  r.connections = conns;
  r.depth = IsLatencyTest(test) ? 1 : depth;
  r.verified = verify;
  r.seconds = wall_seconds;
  std::vector<int64_t> lat;
  for (ConnRun& c : runs) {
    r.iterations += c.ops;
    r.errors += c.errors;
    r.mismatches += c.mismatches;
    lat.insert(lat.end(), c.lat_ns.begin(), c.lat_ns.end());
  }
  std::sort(lat.begin(), lat.end());
  auto q = [&](double p) -> double {
    if (lat.empty()) return 0;
    size_t idx = std::min(lat.size() - 1, static_cast<size_t>(p * (lat.size() - 1) + 0.5));
    return lat[idx] / 1e3;
  };
  r.lat_min = q(0);
  r.lat_p50 = q(0.5);
  r.lat_p99 = q(0.99);
  r.lat_p999 = q(0.999);
  r.lat_max = q(1);
  return r;
}

int RunClient(Side* side, const std::string& address, uint16_t port, uint16_t rpc_port,
              const std::string& mode) {
  auto tests = ParseTests(absl::GetFlag(FLAGS_test));
  auto sizes = ParseSizes(absl::GetFlag(FLAGS_sizes));
  if (!tests.ok() || !sizes.ok()) {
    std::fprintf(stderr, "coverbs_bench: %s\n",
                 (!tests.ok() ? tests.status() : sizes.status()).ToString().c_str());
    return 2;
  }
  const int depth = absl::GetFlag(FLAGS_depth);
  const int conns = absl::GetFlag(FLAGS_connections);
  const int64_t iters = absl::GetFlag(FLAGS_iters);
  if (depth < 1 || depth > 4096 || conns < 1 || iters < 1) {
    std::fprintf(stderr, "coverbs_bench: need 1 <= --depth <= 4096, --connections >= 1, "
                         "--iters >= 1\n");
    return 2;
  }
  for (uint64_t s : *sizes) {
    if (s > (64ull << 20) - 64) {
      std::fprintf(stderr, "coverbs_bench: size %llu exceeds the 64 MiB message limit\n",
                   static_cast<unsigned long long>(s));
      return 2;
    }
  }
  std::string prog = absl::GetFlag(FLAGS_progress);
  const bool progress = prog == "on" || (prog == "auto" && isatty(2));

  Client client(side, address, port, rpc_port);
  if (absl::Status s = client.Connect(conns); !s.ok()) {
    std::fprintf(stderr, "coverbs_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  RunInfo info;
  info.provider = Describe(*side->device);
  info.mode = mode;
  info.poll = absl::GetFlag(FLAGS_poll);
  info.threads = static_cast<int>(side->pool->size());
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  info.host = host;
  info.time = absl::FormatTime(absl::Now(), absl::UTCTimeZone());
  std::printf("coverbs_bench: %s, provider %s, server %s:%u, %d connection(s), depth %d, "
              "%d thread(s), poll %s%s\n",
              mode.c_str(), info.provider.c_str(), address.c_str(), port, conns, depth,
              info.threads, info.poll.c_str(),
              absl::GetFlag(FLAGS_verify) ? ", verify on" : "");
  std::vector<Result> results;
  bool header = false;
  int64_t corrupt = -1;
#ifdef COVERBS_BENCH_FAULT_INJECTION
  corrupt = absl::GetFlag(FLAGS_corrupt_message);
#endif
  for (Test test : *tests) {
    if (test == Test::kRpcRate || test == Test::kRpcLat) {
      if (absl::Status s = client.ConnectRpc(); !s.ok()) {
        std::fprintf(stderr, "coverbs_bench: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    for (uint64_t size : *sizes) {
      if ((test == Test::kWriteBw || test == Test::kReadBw) && size == 0) continue;
      if ((test == Test::kRpcRate || test == Test::kRpcLat) && size > (64ull << 20) - 64) {
        continue;
      }
      RunSpec spec{test, size, static_cast<uint64_t>(iters), depth,
                   absl::GetFlag(FLAGS_verify), corrupt, {}};
      const std::string label = absl::StrCat(TestName(test), " ", size);
      if (const int64_t warm = absl::GetFlag(FLAGS_warmup); warm > 0) {
        RunSpec w = spec;
        w.iters = warm;
        w.corrupt_message = -1;
        std::vector<ConnRun> discard;
        if (!client.RunBatch(w, &discard, false, label + " (warm-up)")) {
          std::fprintf(stderr, "coverbs_bench: %s: warm-up did not finish\n", label.c_str());
          return 1;
        }
        for (const ConnRun& c : discard) {
          if (c.errors + c.mismatches > 0) {
            std::fprintf(stderr, "coverbs_bench: %s: warm-up failed: %s\n", label.c_str(),
                         c.first_error.c_str());
            return 1;
          }
        }
      }
      double srv0 = 0, srv1 = 0;
      absl::Status cs = client.ServerCpu(kOpCpuBegin, &srv0);
      const double cli0 = PoolCpuBlocking(*side->pool);
      std::vector<ConnRun> runs;
      double wall = 0;
      const auto deadline = Clock::now() + absl::ToChronoNanoseconds(absl::GetFlag(FLAGS_duration));
      bool ok = true;
      do {
        size_t first = runs.size();
        ok = client.RunBatch(spec, &runs, progress, label);
        Clock::time_point s0 = runs[first].start, e0 = runs[first].end;
        for (size_t k = first; k < runs.size(); ++k) {
          s0 = std::min(s0, runs[k].start);
          e0 = std::max(e0, runs[k].end);
        }
        wall += std::chrono::duration<double>(e0 - s0).count();
      } while (ok && Clock::now() < deadline);
      const double cli1 = PoolCpuBlocking(*side->pool);
      if (cs.ok() && ok) cs = client.ServerCpu(kOpCpuEnd, &srv1);
      Result r = Aggregate(test, size, conns, depth, spec.verify, runs, wall);
      if (r.iterations > 0) {
        r.cpu_us_client = (cli1 - cli0) * 1e6 / r.iterations;
        if (cs.ok()) r.cpu_us_server = srv1 * 1e6 / r.iterations;
      }
      if (!ok) ++r.errors;
      for (const ConnRun& c : runs) {
        if (!c.first_error.empty()) {
          std::fprintf(stderr, "coverbs_bench: %s: %s\n", label.c_str(), c.first_error.c_str());
          break;
        }
      }
      std::string table = FormatTable({r});
      if (!header) {
        std::fputs(table.c_str(), stdout);
        header = true;
      } else {
        std::fputs(table.substr(table.find('\n') + 1).c_str(), stdout);
      }
      std::fflush(stdout);
      results.push_back(r);
      if (!ok) break;  // a connection may be unusable now
    }
  }
  int rc = 0;
  for (const Result& r : results) {
    if (r.errors + r.mismatches > 0) rc = 1;
  }
  auto write = [&](const std::string& flag, const std::string& contents) {
    if (flag.empty()) return;
    absl::Status s = WriteFile(flag, contents);
    if (!s.ok()) {
      std::fprintf(stderr, "coverbs_bench: %s\n", s.ToString().c_str());
      rc = 1;
    }
  };
  write(absl::GetFlag(FLAGS_json), FormatJson(info, results));
  write(absl::GetFlag(FLAGS_csv), FormatCsv(results));
  write(absl::GetFlag(FLAGS_plot), FormatSvg(info, results));
  if (rc != 0) std::fprintf(stderr, "coverbs_bench: FAILED (errors or mismatches above)\n");
  return rc;
}

int Main() {
  const bool server = absl::GetFlag(FLAGS_server);
  const bool loopback = absl::GetFlag(FLAGS_loopback);
  const std::string client = absl::GetFlag(FLAGS_client);
  if (static_cast<int>(server) + static_cast<int>(loopback) + static_cast<int>(!client.empty()) != 1) {
    std::fprintf(stderr, "coverbs_bench: give exactly one of --server, --client=ADDR, --loopback\n");
    return 2;
  }
  auto poll = ParsePollMode(absl::GetFlag(FLAGS_poll));
  if (!poll.ok()) {
    std::fprintf(stderr, "coverbs_bench: --poll: %s\n", poll.status().ToString().c_str());
    return 2;
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  if (threads < 1 || threads > 64) {
    std::fprintf(stderr, "coverbs_bench: --threads must be 1..64\n");
    return 2;
  }
  std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) address = DefaultAddress();
  const uint16_t port = absl::GetFlag(FLAGS_port);
  const int rpc_flag = absl::GetFlag(FLAGS_rpc_port);
  const uint16_t rpc_port = rpc_flag < 0 ? port + 1 : static_cast<uint16_t>(rpc_flag);

  if (!client.empty()) {
    auto side = Side::Create(threads, *poll);
    if (!side.ok()) {
      std::fprintf(stderr, "coverbs_bench: %s\n", side.status().ToString().c_str());
      return 1;
    }
    return RunClient(side->get(), client, port, rpc_port, "client");
  }

  auto server_side = Side::Create(threads, *poll);
  if (!server_side.ok()) {
    std::fprintf(stderr, "coverbs_bench: server: %s\n",
                 server_side.status().ToString().c_str());
    return 1;
  }
  int rc = 0;
  {
    Server srv(server_side->get());
    absl::Status s = loopback ? srv.Start(address, 0, 0) : srv.Start(address, port, rpc_port);
    if (!s.ok()) {
      std::fprintf(stderr, "coverbs_bench: server: %s\n", s.ToString().c_str());
      srv.Shutdown();
      return 1;
    }
    if (server) {
      std::printf("coverbs_bench: server on %s, cm port %u, rpc port %u, provider %s\n",
                  address.c_str(), srv.port(), srv.rpc_port(),
                  Describe(*(*server_side)->device).c_str());
      std::fflush(stdout);
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, SIGINT);
      sigaddset(&set, SIGTERM);
      int sig = 0;
      sigwait(&set, &sig);
    } else {
      auto client_side = Side::Create(threads, *poll);
      if (!client_side.ok()) {
        std::fprintf(stderr, "coverbs_bench: client: %s\n",
                     client_side.status().ToString().c_str());
        rc = 1;
      } else {
        rc = RunClient(client_side->get(), address, srv.port(), srv.rpc_port(), "loopback");
      }
    }
    srv.Shutdown();
  }
  return rc;
}

}  // namespace
}  // namespace coverbs::bench

int main(int argc, char** argv) {
  // Before any thread: the server waits for these with sigwait.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  absl::SetProgramUsageMessage(
      "coverbs throughput, message rate and latency, in perftest's spirit.\n"
      "  coverbs_bench --loopback --test=all --sizes=2..1M\n"
      "  coverbs_bench --server [--address=A]   /   coverbs_bench --client=A --test=send_bw");
  absl::ParseCommandLine(argc, argv);
  return coverbs::bench::Main();
}
