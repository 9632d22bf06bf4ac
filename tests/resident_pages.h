// ResidentPages: how many 4 KiB pages of a mapping are resident now
// (mincore), for tests that check what a write makes resident.
#ifndef COVERBS_TESTS_RESIDENT_PAGES_H_
#define COVERBS_TESTS_RESIDENT_PAGES_H_

#include <sys/mman.h>

#include <cstddef>
#include <vector>

namespace coverbs::testing {

// Pages of [mem, mem + len) resident now; `mem` page-aligned. ~0 when
// mincore fails (so that no expected count matches).
inline size_t ResidentPages(const void* mem, size_t len) {
  std::vector<unsigned char> v((len + 4095) / 4096);
  if (mincore(const_cast<void*>(mem), len, v.data()) != 0) return ~size_t{0};
  size_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return n;
}

}  // namespace coverbs::testing

#endif  // COVERBS_TESTS_RESIDENT_PAGES_H_
