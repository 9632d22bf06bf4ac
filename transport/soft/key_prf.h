// Keys a peer cannot predict: the soft provider's lkeys and rkeys are the
// output of a keyed pseudo-random function (SipHash-2-4) of a counter,
// under a 128-bit secret drawn once per process from getrandom(2). Seeing
// any number of keys tells a peer nothing about the others (it would have
// to recover the secret); MrTable keeps them unique among the keys in use.
#ifndef COVERBS_TRANSPORT_SOFT_KEY_PRF_H_
#define COVERBS_TRANSPORT_SOFT_KEY_PRF_H_

#include <cstdint>

namespace coverbs::transport::soft {

// SipHash-2-4 (Aumasson and Bernstein) of the 8-byte little-endian message
// `m` under the key (k0, k1): the reference construction, so that it can be
// checked against the published test vectors.
uint64_t SipHash24(uint64_t k0, uint64_t k1, uint64_t m);

// A stream of 32-bit values, each SipHash-2-4 of a counter under a secret
// from the OS's random source (two values per hash). Not thread-safe.
class KeyStream {
 public:
  KeyStream();
  uint32_t Next() {
    if (have_ == 0) Refill();
    return static_cast<uint32_t>(buf_ >> (32 * --have_));
  }

 private:
  void Refill();
  uint64_t k0_, k1_;
  uint64_t counter_ = 0;
  uint64_t buf_ = 0;
  int have_ = 0;
};

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_KEY_PRF_H_
