#include "transport/soft/key_prf.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace coverbs::transport::soft {
namespace {

inline uint64_t Rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

inline void SipRound(uint64_t& v0, uint64_t& v1, uint64_t& v2, uint64_t& v3) {
  v0 += v1;
  v1 = Rotl(v1, 13);
  v1 ^= v0;
  v0 = Rotl(v0, 32);
  v2 += v3;
  v3 = Rotl(v3, 16);
  v3 ^= v2;
  v0 += v3;
  v3 = Rotl(v3, 21);
  v3 ^= v0;
  v2 += v1;
  v1 = Rotl(v1, 17);
  v1 ^= v2;
  v2 = Rotl(v2, 32);
}

// 16 bytes from the kernel's random source. Why no weaker fallback: keys
// derived from a guessable secret are the defect this exists to remove;
// a process that cannot read the random source must not hand out keys.
void FillSecret(void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(p + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      break;
    }
  }
  if (got == n) return;
  // getrandom(2) missing (ENOSYS under an old seccomp policy): the same
  // source through its device file.
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    got = 0;
    while (got < n) {
      ssize_t r = read(fd, p + got, n - got);
      if (r > 0) {
        got += static_cast<size_t>(r);
      } else if (r == 0 || errno != EINTR) {
        break;
      }
    }
    close(fd);
  }
  if (got != n) std::abort();
}

}  // namespace

uint64_t SipHash24(uint64_t k0, uint64_t k1, uint64_t m) {
  uint64_t v0 = 0x736f6d6570736575ULL ^ k0;
  uint64_t v1 = 0x646f72616e646f6dULL ^ k1;
  uint64_t v2 = 0x6c7967656e657261ULL ^ k0;
  uint64_t v3 = 0x7465646279746573ULL ^ k1;
  v3 ^= m;
  SipRound(v0, v1, v2, v3);
  SipRound(v0, v1, v2, v3);
  v0 ^= m;
  const uint64_t b = uint64_t{8} << 56;  // message length 8, no tail bytes
  v3 ^= b;
  SipRound(v0, v1, v2, v3);
  SipRound(v0, v1, v2, v3);
  v0 ^= b;
  v2 ^= 0xff;
  SipRound(v0, v1, v2, v3);
  SipRound(v0, v1, v2, v3);
  SipRound(v0, v1, v2, v3);
  SipRound(v0, v1, v2, v3);
  return v0 ^ v1 ^ v2 ^ v3;
}

KeyStream::KeyStream() {
  uint64_t secret[3];
  FillSecret(secret, sizeof(secret));
  k0_ = secret[0];
  k1_ = secret[1];
  // A secret starting point as well: the counter's value says nothing
  // either (how many keys the process handed out).
  counter_ = secret[2];
}

void KeyStream::Refill() {
  buf_ = SipHash24(k0_, k1_, counter_++);
  have_ = 2;
}

}  // namespace coverbs::transport::soft
