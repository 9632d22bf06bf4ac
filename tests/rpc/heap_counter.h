// The heap a test binary holds, counted at every operator new and delete
// (what std containers and libprotobuf allocate with): linking this
// library replaces the program's global operator new/delete. Each block
// counts what it takes from the allocator: its usable size
// (malloc_usable_size) and glibc's 8-byte chunk header. For tests that check what a
// decode really allocates against the bound it promised (codec_test,
// codec_fuzzer).
#ifndef COVERBS_TESTS_RPC_HEAP_COUNTER_H_
#define COVERBS_TESTS_RPC_HEAP_COUNTER_H_

#include <cstdint>
#include <functional>

namespace coverbs::rpc::testing {

// The bytes of heap held now.
int64_t HeapLive();

// The most the heap grew above where it was while `fn` ran (any thread's
// allocations count: run nothing else meanwhile).
int64_t PeakHeapDuring(const std::function<void()>& fn);

}  // namespace coverbs::rpc::testing

#endif  // COVERBS_TESTS_RPC_HEAP_COUNTER_H_
