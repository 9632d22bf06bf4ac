#include "core/stall_watchdog.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace coverbs::internal {
namespace {

// How often a reactor is looked at: a quarter of its threshold, so a stall
// is flagged about 25% after the threshold and its reported duration is
// short by about that much (the watchdog knows when it first saw the task
// running, not when it started), more when this thread is woken late on a
// loaded machine. Never below 1 ms.
constexpr int64_t kMinTickNs = 1'000'000;

struct Watchdog {
  std::mutex life_mu;  // serializes starting and joining the thread
  std::mutex mu;
  std::condition_variable cv;
  std::vector<StallState*> states;  // mu
  bool stop = false;                // mu
  std::thread thread;               // life_mu

  void Loop() {
    pthread_setname_np(pthread_self(), "coverbs-stall");
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      int64_t now = StallClockNs();
      int64_t tick = INT64_MAX;
      for (StallState* s : states) {
        tick = std::min(tick, std::max(kMinTickNs, s->threshold_ns / 4));
        uint64_t seq = s->seq.load(std::memory_order_relaxed);
        if (seq != s->last_seq) {
          s->last_seq = seq;
          s->first_seen_ns = now;
          continue;
        }
        if ((seq & 1) == 0) continue;  // between tasks (or asleep)
        if (now - s->first_seen_ns >= s->threshold_ns &&
            s->flagged.load(std::memory_order_relaxed) != seq) {
          s->since_ns.store(s->first_seen_ns, std::memory_order_relaxed);
          s->flagged.store(seq, std::memory_order_release);
        }
      }
      cv.wait_for(lock, std::chrono::nanoseconds(tick));
    }
  }
};

Watchdog& W() {
  static Watchdog* w = new Watchdog();
  return *w;
}

}  // namespace

int64_t StallClockNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void AddStallWatch(StallState* s) {
  Watchdog& w = W();
  std::lock_guard<std::mutex> life(w.life_mu);
  s->last_seq = s->seq.load(std::memory_order_relaxed);
  s->first_seen_ns = StallClockNs();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.states.push_back(s);
    w.stop = false;
  }
  if (!w.thread.joinable()) {
    w.thread = std::thread([&w] { w.Loop(); });
  } else {
    w.cv.notify_one();  // a shorter threshold may need a shorter tick
  }
}

void RemoveStallWatch(StallState* s) {
  Watchdog& w = W();
  std::lock_guard<std::mutex> life(w.life_mu);
  bool last;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.states.erase(std::remove(w.states.begin(), w.states.end(), s),
                   w.states.end());
    last = w.states.empty();
    if (last) w.stop = true;
  }
  // The last one stops the thread: no thread is left behind by a process
  // whose reactors are gone (nor ticks while there is nothing to watch).
  if (last && w.thread.joinable()) {
    w.cv.notify_one();
    w.thread.join();
  }
}

}  // namespace coverbs::internal
