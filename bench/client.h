// The bench client: --connections cm connections (and RPC clients) spread
// over the reactors of its Side; runs one batch of a test on all of them at
// once and collects what each measured.
#ifndef COVERBS_BENCH_CLIENT_H_
#define COVERBS_BENCH_CLIENT_H_

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "bench/driver.h"
#include "bench/protocol.h"
#include "bench/side.h"
#include "core/task.h"

namespace coverbs::bench {

// Runs `body` on reactor `i` of `side` and waits for it (from main).
template <typename T>
T RunOn(Side* side, size_t i, absl::AnyInvocable<Task<T>()> body) {
  std::promise<T> p;
  auto f = p.get_future();
  side->pool().Spawn(
      i, [](absl::AnyInvocable<Task<T>()> b, std::promise<T>* p) -> Task<void> {
        p->set_value(co_await b());
      }(std::move(body), &p));
  return f.get();
}

class Client {
 public:
  Client(Side* side, std::string address, uint16_t port, uint16_t rpc_port)
      : side_(side),
        address_(std::move(address)),
        port_(port),
        rpc_port_(rpc_port) {}
  ~Client();

  absl::Status Connect(int n);
  absl::Status ConnectRpc();

  // The server's reactor CPU (seconds) between the two calls.
  absl::Status ServerCpu(Op op, double* seconds);

  // One batch of spec.iters per connection; returns false if it had to be
  // abandoned (timeout). Appends to `runs`.
  bool RunBatch(RunSpec spec, std::vector<ConnRun>* runs, bool progress,
                const std::string& label);

  size_t size() const { return conns_.size(); }

 private:
  Side* side_;
  std::string address_;
  uint16_t port_, rpc_port_;
  std::vector<std::unique_ptr<ClientConn>> conns_;
};

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_CLIENT_H_
