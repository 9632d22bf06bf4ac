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
#include <vector>

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
  // access window before each use of the memory (Usable()).
  std::atomic<bool> valid{true};
  // The last progress-thread access window (AccessEpoch) that found the
  // region valid, 0 for none: deregistration waits for that window only,
  // not for whatever window happens to be open when it runs.
  mutable std::atomic<uint64_t> seen_in{0};
  // Progress-thread uses held across frames or windows (MrPin).
  std::atomic<uint32_t> pins{0};

  // What a thread inside an access window calls before touching the
  // memory: stamps the progress thread's window, then reads `valid`.
  inline bool Usable() const;

  bool Covers(uint64_t a, uint64_t len) const {
    uint64_t base = reinterpret_cast<uintptr_t>(addr);
    return a >= base && len <= length && a - base <= length - len;
  }
};

// A progress-thread hold on a region for a use that lasts beyond one check
// (a WRITE target, from its header to its last byte), checked with
// valid.load() alone while held. Why not stamps: the window that placed a
// landing grant's WRITE is usually still open when the application
// deregisters the grant (its message's completion came out of the same
// window); a pin is gone as soon as the WRITE is placed, so that
// deregistration does not wait.
class MrPin {
 public:
  MrPin() = default;
  ~MrPin() { Reset(); }
  MrPin(const MrPin&) = delete;
  MrPin& operator=(const MrPin&) = delete;

  // Pins, then reads `valid` (both seq-cst, against Deregister's store
  // then load); false, and nothing held, when it is no longer valid.
  bool Pin(const std::shared_ptr<MrEntry>& e) {
    Reset();
    e->pins.fetch_add(1);
    if (!e->valid.load()) {
      e->pins.fetch_sub(1);
      return false;
    }
    e_ = e;
    return true;
  }
  // After the last access to the memory.
  void Reset() {
    if (e_ != nullptr) {
      e_->pins.fetch_sub(1);
      e_.reset();
    }
  }
  const MrEntry* get() const { return e_.get(); }

 private:
  std::shared_ptr<MrEntry> e_;
};

// Key -> region, open addressing with linear probing (keys are already
// scattered, so their low bits index it) and backward-shift erase (no
// tombstones). Why not absl::flat_hash_map: a medium message registers and
// deregisters one landing buffer (two inserts, two erases and four lookups
// of fresh keys), which cost ~600 instructions through flat_hash_map here
// and a few dozen this way. Not thread-safe (MrTable locks it).
class MrKeyTable {
 public:
  // nullptr when absent; key 0 (the empty-slot marker) is always absent.
  const std::shared_ptr<MrEntry>* Find(uint32_t key) const;
  // `key` != 0, not present.
  void Insert(uint32_t key, std::shared_ptr<MrEntry> e);
  void Erase(uint32_t key);
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint32_t key = 0;  // 0: empty
    std::shared_ptr<MrEntry> e;
  };
  size_t Mask() const { return slots_.size() - 1; }

  std::vector<Slot> slots_;  // a power of two, at most half full
  size_t size_ = 0;
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
  MrKeyTable lkeys_;        // mu_
  MrKeyTable rkeys_;        // mu_
  uint32_t counter_;        // mu_
  uint32_t first_counter_;  // counter_ at start
  bool wrapped_ = false;    // mu_; counter_ came round to first_counter_
};

// The data-path access windows. The progress thread calls Enter() before it
// touches registered memory and Exit() before it sleeps; there is at most one
// progress thread. Any other thread that transmits from registered memory
// (a poster sending inline, qp_tx.cc) brackets that with EnterShared() /
// ExitShared(): such windows are short (one sendmsg) and may overlap.
// SynchronizeWith() (any other thread) returns once no window that may have
// used a region is open.
class AccessEpoch {
 public:
  static void Enter();
  static void Exit();
  static void EnterShared();
  static void ExitShared();
  // The exclusive window the calling thread is in (odd), 0 outside one.
  static uint64_t CurrentWindow() { return window_; }
  // Returns once no window that may have found `mr` valid is open; `mr`
  // must already be invalid.
  static void SynchronizeWith(const MrEntry& mr);

 private:
  static thread_local uint64_t window_;
};

bool MrEntry::Usable() const {
  // Stamp first, then read the flag (both seq-cst): a deregistration that
  // clears the flag after we read it true then reads our stamp and waits.
  // Posting threads in shared windows do not stamp (their windows are
  // counted, and their stamps could overwrite the progress thread's).
  // A region already stamped in this window (the receive ring, the send
  // pool: every frame of a batch) skips the store, a full barrier: that
  // earlier seq-cst store of ours already precedes the load below.
  if (uint64_t w = AccessEpoch::CurrentWindow();
      w != 0 && seen_in.load(std::memory_order_relaxed) != w) {
    seen_in.store(w);
  }
  return valid.load();
}

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_MR_TABLE_H_
