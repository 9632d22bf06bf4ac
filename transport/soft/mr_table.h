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
#include "transport/soft/key_prf.h"

namespace coverbs::transport::soft {

// One registered region, or one bind of a type-2 memory window (an rkey
// alone, usable through one QP). A region is immutable except `valid`; a
// window's fields are set once, by its bind, under the table's exclusive
// lock, and read under its shared lock (CheckRemote) or after a check that
// found them bound.
struct MrEntry {
  char* addr = nullptr;
  size_t length = 0;
  int access = 0;
  uint64_t pd_id = 0;
  uint32_t lkey = 0;  // 0 for a window (it has no local key)
  uint32_t rkey = 0;
  // Windows: the region the bind covers (its memory's owner: a window is
  // usable only while it is), and the QP it is bound to (QpCore::uid(), 0
  // while unbound). Null / 0 for a region.
  std::shared_ptr<MrEntry> parent;
  uint64_t qp_uid = 0;
  bool is_window = false;
  // The peer ended the bind (SEND_WITH_INV) after its last access through
  // it, in the order of that QP's stream: nothing is left to wait for.
  // Set under the table's exclusive lock together with the rkey's removal,
  // so a reader that sees it set needs no lock to know the window is gone.
  std::atomic<bool> ended_by_peer{false};
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
  // `valid`, and the parent's for a window (no stamp: for pinned uses).
  bool Live() const {
    return valid.load() && (parent == nullptr || parent->valid.load());
  }

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
  // then load); false, and nothing held, when it is no longer valid. A
  // window pins its region too: deregistering that waits as well.
  bool Pin(const std::shared_ptr<MrEntry>& e) {
    Reset();
    e->pins.fetch_add(1);
    if (e->parent != nullptr) e->parent->pins.fetch_add(1);
    e_ = e;
    if (!e->Live()) {
      Reset();
      return false;
    }
    return true;
  }
  // After the last access to the memory.
  void Reset() {
    if (e_ != nullptr) {
      if (e_->parent != nullptr) e_->parent->pins.fetch_sub(1);
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

  // --- Type-2 memory windows (soft_mw.cc). Each bind is an entry of its
  // own with a fresh rkey, reserved here (unbound: no QP can use it) before
  // the bind work request that names it is posted.
  std::shared_ptr<MrEntry> ReserveWindow(uint64_t pd_id);
  // Ends `w` (a reserved or bound window): its rkey stops matching and,
  // unless the peer ended it, waits like Deregister until no access
  // window may still use it. Idempotent.
  void DropWindow(const std::shared_ptr<MrEntry>& w);
  // The peer's SEND_WITH_INV, on the progress thread: ends the window
  // `rkey` if it is bound to QP `qp_uid` of PD `pd_id`; false otherwise (the
  // request is invalid). No wait: only that QP's stream could use it, and
  // every earlier access on it is placed.
  bool InvalidateByPeer(uint32_t rkey, uint64_t pd_id, uint64_t qp_uid);

  // Lookups (nullptr when absent). Lock the table once for a batch;
  // exclusively for one that binds or invalidates windows.
  class Reader {
   public:
    explicit Reader(MrTable& t, bool exclusive = false)
        : t_(t), exclusive_(exclusive) {
      if (exclusive_) {
        t_.mu_.lock();
      } else {
        t_.mu_.lock_shared();
      }
    }
    ~Reader() {
      if (exclusive_) {
        t_.mu_.unlock();
      } else {
        t_.mu_.unlock_shared();
      }
    }
    Reader(const Reader&) = delete;
    Reader& operator=(const Reader&) = delete;
    const std::shared_ptr<MrEntry>* FindLkey(uint32_t key) const;
    const std::shared_ptr<MrEntry>* FindRkey(uint32_t key) const;
    // Exclusive readers only. IBV_WR_BIND_MW: binds the reserved window
    // `rkey` of PD `pd_id` to [addr, addr+length) of the region whose lkey
    // is `mr_lkey` (same PD, registered with IBV_ACCESS_MW_BIND) with
    // remote `access`, for QP `qp_uid`. IBV_WC_SUCCESS or
    // IBV_WC_MW_BIND_ERR.
    uint8_t BindWindow(uint32_t rkey, uint64_t pd_id, uint32_t mr_lkey,
                       uint64_t addr, uint64_t length, int access,
                       uint64_t qp_uid) const;
    // IBV_WR_LOCAL_INV: unmaps the window `rkey` bound in PD `pd_id` and
    // returns it (the caller ends it with DropWindow once the lock is
    // released); null if `rkey` names no bound window of the PD.
    std::shared_ptr<MrEntry> UnmapWindow(uint32_t rkey, uint64_t pd_id) const;

   private:
    MrTable& t_;
    const bool exclusive_;
  };

 private:
  MrTable();
  uint32_t NextKey();  // mu_ held exclusively

  // std (pthread) locks rather than absl::Mutex: the system's prebuilt absl is
  // not instrumented for ThreadSanitizer.
  std::shared_mutex mu_;
  MrKeyTable lkeys_;  // mu_
  MrKeyTable rkeys_;  // mu_
  KeyStream keys_;    // mu_
};

// A process-wide identity for a QP, never reused (window binds name it: a
// QP number can come back after its QP is gone).
uint64_t NewQpUid();

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
  // A window's memory is its region's: both must be usable (and both are
  // stamped, so that either's end waits for this use).
  return valid.load() && (parent == nullptr || parent->Usable());
}

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_MR_TABLE_H_
