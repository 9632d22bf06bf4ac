// The valgrind shim keeps liburing's contract for coverbs' calls: linked in
// statically here, so its definitions replace liburing's in this binary.
#include <dlfcn.h>
#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace {

class Shim : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(io_uring_queue_init(8, &ring_, 0), 0);
    efd_ = eventfd(0, EFD_NONBLOCK);
    ASSERT_GE(efd_, 0);
  }
  void TearDown() override {
    io_uring_queue_exit(&ring_);
    close(efd_);
  }
  void PollEventfd() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    ASSERT_NE(sqe, nullptr);
    io_uring_prep_poll_add(sqe, efd_, POLLIN);
  }
  void WriteEventfdLater() {
    writer_ = std::thread([fd = efd_] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      uint64_t one = 1;
      (void)!write(fd, &one, sizeof(one));
    });
  }
  io_uring ring_;
  int efd_ = -1;
  std::thread writer_;
};

// The shim's definitions, not liburing.so's, are the ones this test calls.
TEST(ShimLinked, WaitsComeFromTheShim) {
  for (void* fn :
       {reinterpret_cast<void*>(&io_uring_submit_and_wait),
        reinterpret_cast<void*>(&io_uring_submit_and_wait_timeout)}) {
    Dl_info info;
    ASSERT_NE(dladdr(fn, &info), 0);
    EXPECT_EQ(std::string(info.dli_fname).find("liburing"), std::string::npos)
        << info.dli_fname;
  }
}

TEST_F(Shim, SubmitAndWaitReturnsWhenACompletionArrives) {
  PollEventfd();
  WriteEventfdLater();
  EXPECT_EQ(io_uring_submit_and_wait(&ring_, 1), 1);
  writer_.join();
  io_uring_cqe* cqe = nullptr;
  ASSERT_EQ(io_uring_peek_cqe(&ring_, &cqe), 0);
  EXPECT_TRUE(cqe->res & POLLIN);
}

TEST_F(Shim, SubmitAndWaitTimeoutGivesTheCompletion) {
  PollEventfd();
  WriteEventfdLater();
  __kernel_timespec ts = {10, 0};
  io_uring_cqe* cqe = nullptr;
  EXPECT_EQ(io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr), 1);
  writer_.join();
  ASSERT_NE(cqe, nullptr);
  EXPECT_TRUE(cqe->res & POLLIN);
}

TEST_F(Shim, SubmitAndWaitTimeoutExpires) {
  PollEventfd();  // never written
  __kernel_timespec ts = {0, 20 * 1000 * 1000};
  io_uring_cqe* cqe = nullptr;
  EXPECT_EQ(io_uring_submit_and_wait_timeout(&ring_, &cqe, 1, &ts, nullptr),
            -ETIME);
  EXPECT_EQ(io_uring_cq_ready(&ring_), 0u);
}

TEST_F(Shim, WaitForNothingOnlySubmits) {
  PollEventfd();
  EXPECT_EQ(io_uring_submit_and_wait(&ring_, 0), 1);
  EXPECT_EQ(io_uring_cq_ready(&ring_), 0u);
}

}  // namespace
