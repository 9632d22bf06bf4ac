// The loop provider's process-wide memory-region table. Both ends of every
// loop connection live in this process, so one table serves every PD: an
// entry remembers its PD, and a key of another PD is refused as verbs
// refuses it.
//
// Keys are drawn at random (absl::BitGen, seeded from the OS) and kept
// unique among the keys in use: a peer cannot guess one from another.
//
// Deregistration is synchronous: work requests read and write registered
// memory while holding a Reader (the table's shared lock), and Deregister
// takes the lock exclusively, so once it returns no copy touches the
// region any more.
#ifndef COVERBS_TRANSPORT_LOOP_MR_TABLE_H_
#define COVERBS_TRANSPORT_LOOP_MR_TABLE_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <shared_mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"

namespace coverbs::transport::loop {

struct Region {
  char* addr = nullptr;
  size_t length = 0;
  int access = 0;
  uint64_t pd_id = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;

  bool Covers(uint64_t a, uint64_t len) const {
    const uint64_t base = reinterpret_cast<uintptr_t>(addr);
    return a >= base && len <= length && a - base <= length - len;
  }
};

class MrTable {
 public:
  static MrTable& Get();

  // Registers [addr, addr+length) of PD `pd_id` with IBV_ACCESS_* flags
  // (InvalidArgument for flags the provider does not know).
  absl::StatusOr<Region> Register(uint64_t pd_id, void* addr, size_t length,
                                  int access);
  // Removes the region's keys; waits for every Reader open now.
  void Deregister(uint32_t lkey, uint32_t rkey);

  // Shared access to the table for one work request: lookups, and the
  // copies into or out of the regions found.
  class Reader {
   public:
    explicit Reader(MrTable& t) : t_(t), lock_(t.mu_) {}
    // The region of a local SGE of PD `pd_id` that covers it (and allows
    // local writes when the NIC writes into it), or nullptr: a local
    // protection error.
    const Region* Local(uint64_t pd_id, const ibv_sge& sge,
                        bool nic_writes) const;
    // The region `rkey` names when it belongs to `pd_id`, covers
    // [addr, addr+len) and grants `access`; nullptr: a remote access error.
    const Region* Remote(uint64_t pd_id, uint32_t rkey, uint64_t addr,
                         uint64_t len, int access) const;

   private:
    MrTable& t_;
    std::shared_lock<std::shared_mutex> lock_;
  };

 private:
  uint32_t FreshKeyLocked();

  std::shared_mutex mu_;
  absl::BitGen gen_;  // under mu_, exclusive
  absl::flat_hash_map<uint32_t, Region> by_lkey_;
  absl::flat_hash_map<uint32_t, Region> by_rkey_;
};

}  // namespace coverbs::transport::loop

#endif  // COVERBS_TRANSPORT_LOOP_MR_TABLE_H_
