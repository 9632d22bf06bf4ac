#include "transport/loop/mr_table.h"

#include <mutex>

#include "absl/strings/str_format.h"

namespace coverbs::transport::loop {
namespace {

constexpr int kSupportedAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
    IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_RELAXED_ORDERING;

}  // namespace

MrTable& MrTable::Get() {
  static MrTable* table = new MrTable();  // never destroyed: used at exit
  return *table;
}

uint32_t MrTable::FreshKeyLocked() {
  for (;;) {
    uint32_t k = absl::Uniform<uint32_t>(gen_);
    // 0 is never handed out, and a key is unique among lkeys and rkeys in
    // use (so that a peer's rkey never equals a local key by chance).
    if (k != 0 && !by_lkey_.contains(k) && !by_rkey_.contains(k)) return k;
  }
}

absl::StatusOr<Region> MrTable::Register(uint64_t pd_id, void* addr,
                                         size_t length, int access) {
  if ((access & ~kSupportedAccess) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "loop: register memory: access flags 0x%x not supported (the loop "
        "provider has no memory windows, so no IBV_ACCESS_MW_BIND)",
        access & ~kSupportedAccess));
  }
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0 &&
      (access & IBV_ACCESS_LOCAL_WRITE) == 0) {
    return absl::InvalidArgumentError(
        "loop: register memory: remote write or atomic access needs "
        "IBV_ACCESS_LOCAL_WRITE (EINVAL)");
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  Region r;
  r.addr = static_cast<char*>(addr);
  r.length = length;
  r.access = access;
  r.pd_id = pd_id;
  r.lkey = FreshKeyLocked();
  by_lkey_[r.lkey] = r;  // reserve it before drawing the rkey
  r.rkey = FreshKeyLocked();
  by_lkey_[r.lkey] = r;
  by_rkey_[r.rkey] = r;
  return r;
}

void MrTable::Deregister(uint32_t lkey, uint32_t rkey) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  by_lkey_.erase(lkey);
  by_rkey_.erase(rkey);
}

const Region* MrTable::Reader::Local(uint64_t pd_id, const ibv_sge& sge,
                                     bool nic_writes) const {
  auto it = t_.by_lkey_.find(sge.lkey);
  if (it == t_.by_lkey_.end()) return nullptr;
  const Region& r = it->second;
  if (r.pd_id != pd_id || !r.Covers(sge.addr, sge.length)) return nullptr;
  if (nic_writes && (r.access & IBV_ACCESS_LOCAL_WRITE) == 0) return nullptr;
  return &r;
}

const Region* MrTable::Reader::Remote(uint64_t pd_id, uint32_t rkey,
                                      uint64_t addr, uint64_t len,
                                      int access) const {
  auto it = t_.by_rkey_.find(rkey);
  if (it == t_.by_rkey_.end()) return nullptr;
  const Region& r = it->second;
  if (r.pd_id != pd_id || !r.Covers(addr, len)) return nullptr;
  if ((r.access & access) != access) return nullptr;
  return &r;
}

}  // namespace coverbs::transport::loop
