// Lets valgrind run coverbs (callgrind_cost.sh): an LD_PRELOAD library that
// replaces liburing's two blocking calls, io_uring_submit_and_wait and
// io_uring_submit_and_wait_timeout, by a submit followed by ppoll() on the
// ring's fd.
//
// Why: valgrind runs one thread at a time and lets another run only while
// the current one is in a system call it knows may block. valgrind 3.19
// (Debian 12) does not count io_uring_enter among them, so a reactor or the
// soft provider's progress thread that sleeps in io_uring_enter keeps every
// other thread from running, including the one that would wake it: the
// process hangs (bench/RESULTS.md, "callgrind"). ppoll is known to block,
// and the ring's fd is readable when its completion queue holds entries.
//
// Same results as liburing for the way coverbs calls them (wait_nr 0 or 1,
// no signal mask): the submit count, or -ETIME when the timeout passed with
// no completion. Only the sleeping path differs; coverbs' own code runs the
// same instructions, and the shim's are counted apart (their own object).
#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <time.h>

#include <cstdint>

namespace {

int64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

// Waits until the completion queue holds an entry; false when `deadline_ns`
// (CLOCK_MONOTONIC, < 0: none) passed first.
bool WaitReady(io_uring* ring, int64_t deadline_ns) {
  while (io_uring_cq_ready(ring) == 0) {
    pollfd p = {ring->ring_fd, POLLIN, 0};
    timespec left;
    timespec* lp = nullptr;
    if (deadline_ns >= 0) {
      int64_t ns = deadline_ns - NowNs();
      if (ns <= 0) return io_uring_cq_ready(ring) > 0;
      left.tv_sec = ns / 1000000000;
      left.tv_nsec = ns % 1000000000;
      lp = &left;
    }
    // Completions delivered by task work are posted when this returns
    // (interrupted, or readable); the loop then sees them.
    int rc = ppoll(&p, 1, lp, nullptr);
    if (rc < 0 && errno != EINTR) return io_uring_cq_ready(ring) > 0;
  }
  return true;
}

}  // namespace

extern "C" {

int io_uring_submit_and_wait(io_uring* ring, unsigned wait_nr) {
  int submitted = io_uring_submit(ring);
  if (submitted < 0 || wait_nr == 0) return submitted;
  WaitReady(ring, -1);
  return submitted;
}

int io_uring_submit_and_wait_timeout(io_uring* ring, io_uring_cqe** cqe_ptr,
                                     unsigned wait_nr, __kernel_timespec* ts,
                                     sigset_t* /*sigmask*/) {
  const int64_t deadline =
      ts == nullptr ? -1 : NowNs() + ts->tv_sec * 1000000000LL + ts->tv_nsec;
  int submitted = io_uring_submit(ring);
  if (submitted < 0) return submitted;
  if (wait_nr > 0 && !WaitReady(ring, deadline)) return -ETIME;
  int rc = io_uring_peek_cqe(ring, cqe_ptr);
  return rc < 0 && wait_nr > 0 ? rc : submitted;
}

}  // extern "C"
