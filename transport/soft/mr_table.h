// The soft provider's process-wide memory-region table and the progress
// thread's access window (an RCU-like epoch) that makes deregistration
// synchronous: once DeregisterMemory returns, the progress thread no longer
// touches the region's memory.
#ifndef COVERBS_TRANSPORT_SOFT_MR_TABLE_H_
#define COVERBS_TRANSPORT_SOFT_MR_TABLE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include <shared_mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace coverbs::transport::soft {

// One registered region. Immutable except `valid`.
struct MrEntry {
  char* addr = nullptr;
  size_t length = 0;
  int access = 0;
  uint64_t pd_id = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  // Cleared by deregistration; the progress thread checks it inside its
  // access window before each use of the memory.
  std::atomic<bool> valid{true};

  bool Covers(uint64_t a, uint64_t len) const {
    uint64_t base = reinterpret_cast<uintptr_t>(addr);
    return a >= base && len <= length && a - base <= length - len;
  }
};

class MrTable {
 public:
  static MrTable& Get();

  // Registers [addr, addr+length) for `pd_id` with IBV_ACCESS_* flags.
  absl::StatusOr<std::shared_ptr<MrEntry>> Register(uint64_t pd_id, void* addr,
                                                    size_t length, int access);
  // Removes the keys, invalidates the entry and waits until the progress
  // thread is outside any access window that may have seen it valid.
  void Deregister(const std::shared_ptr<MrEntry>& mr);

  // Lookups (nullptr when absent). Lock the table once for a batch.
  class Reader {
   public:
    explicit Reader(MrTable& t) : t_(t) { t_.mu_.lock_shared(); }
    ~Reader() { t_.mu_.unlock_shared(); }
    Reader(const Reader&) = delete;
    Reader& operator=(const Reader&) = delete;
    const std::shared_ptr<MrEntry>* FindLkey(uint32_t key) const;
    const std::shared_ptr<MrEntry>* FindRkey(uint32_t key) const;

   private:
    MrTable& t_;
  };

 private:
  MrTable();
  uint32_t NextKey();  // mu_ held exclusively

  // std (pthread) locks rather than absl::Mutex: the system's prebuilt absl is
  // not instrumented for ThreadSanitizer.
  std::shared_mutex mu_;
  absl::flat_hash_map<uint32_t, std::shared_ptr<MrEntry>> lkeys_;  // mu_
  absl::flat_hash_map<uint32_t, std::shared_ptr<MrEntry>> rkeys_;  // mu_
  uint32_t counter_;                                               // mu_
};

// The data-path access windows. The progress thread calls Enter() before it
// touches registered memory and Exit() before it sleeps; there is at most one
// progress thread. Any other thread that transmits from registered memory
// (a poster sending inline, qp_tx.cc) brackets that with EnterShared() /
// ExitShared(): such windows are short (one sendmsg) and may overlap.
// Synchronize() (any other thread) returns once every window of either kind
// that was open when it was called has closed.
class AccessEpoch {
 public:
  static void Enter();
  static void Exit();
  static void EnterShared();
  static void ExitShared();
  static void Synchronize();
};

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_MR_TABLE_H_
