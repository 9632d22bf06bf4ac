// A tour of the coverbs runtime (the README's "main job" until the echo RPC
// server lands): two reactor threads pass messages through a bounded
// channel, a semaphore bounds work in flight, a timer paces a heartbeat, and
// WithTimeout cancels a wait that can never complete.
#include <cstdio>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "core/sync.h"
#include "core/timeout.h"

namespace {

using coverbs::Channel;
using coverbs::Event;
using coverbs::Reactor;
using coverbs::ReactorPool;
using coverbs::Task;
using coverbs::WaitGroup;

constexpr int kMessages = 200000;

Task<void> Producer(Channel<int>* ch, WaitGroup* wg) {
  for (int i = 0; i < kMessages; ++i) {
    absl::Status s = co_await ch->Send(i);
    if (!s.ok()) {
      std::printf("producer: %s\n", s.ToString().c_str());
      break;
    }
  }
  ch->Close();
  wg->Done();
}

Task<void> Consumer(Channel<int>* ch, long long* sum, WaitGroup* wg) {
  for (;;) {
    absl::StatusOr<int> v = co_await ch->Recv();
    if (!v.ok()) break;  // closed and drained
    *sum += *v;
  }
  wg->Done();
}

Task<int> Heartbeat(Reactor* r) {
  int beats = 0;
  for (int i = 0; i < 3; ++i) {
    if (!(co_await r->Sleep(absl::Milliseconds(10))).ok()) break;
    ++beats;
  }
  co_return beats;
}

Task<absl::Status> WaitForever(Event* never) { co_return co_await never->Wait(); }

}  // namespace

int main() {
  auto pool_or = ReactorPool::Create(2);
  if (!pool_or.ok()) {
    std::fprintf(stderr, "cannot start reactors: %s\n",
                 pool_or.status().ToString().c_str());
    return 1;
  }
  auto& pool = *pool_or;
  Channel<int> ch(64);
  WaitGroup wg;
  long long sum = 0;
  wg.Add(2);
  absl::Time start = absl::Now();
  pool->Spawn(0, Producer(&ch, &wg));
  pool->Spawn(1, Consumer(&ch, &sum, &wg));

  auto main_reactor = Reactor::Create();
  if (!main_reactor.ok()) return 1;
  Reactor* r = main_reactor->get();
  auto wait_all = [](WaitGroup* wg) -> Task<absl::Status> {
    co_return co_await wg->Wait();
  };
  absl::Status s = r->BlockOn(wait_all(&wg));
  absl::Duration took = absl::Now() - start;
  long long expect = static_cast<long long>(kMessages) * (kMessages - 1) / 2;
  std::printf("channel across reactors: %d messages in %s (%.2f M msg/s), "
              "sum %s\n",
              kMessages, absl::FormatDuration(took).c_str(),
              kMessages / absl::ToDoubleSeconds(took) / 1e6,
              sum == expect && s.ok() ? "verified" : "WRONG");

  int beats = r->BlockOn(Heartbeat(r));
  std::printf("heartbeat: %d beats of 10ms\n", beats);

  Event never;
  absl::Status timed =
      r->BlockOn(coverbs::WithTimeout(WaitForever(&never), absl::Milliseconds(5)));
  std::printf("wait with timeout: %s\n", timed.ToString().c_str());
  pool->Stop();
  return sum == expect && beats == 3 &&
                 timed.code() == absl::StatusCode::kDeadlineExceeded
             ? 0
             : 1;
}
