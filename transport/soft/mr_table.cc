#include "transport/soft/mr_table.h"

#include <infiniband/verbs.h>

#include <algorithm>
#include <mutex>

#include "absl/strings/str_format.h"

namespace coverbs::transport::soft {
namespace {

constexpr int kSupportedAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
    IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND | IBV_ACCESS_RELAXED_ORDERING;
constexpr int kWindowAccess =
    IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;

// Odd while the progress thread is inside its access window.
std::atomic<uint64_t> g_epoch{0};
std::atomic<int> g_sync_waiters{0};
std::atomic<int> g_shared{0};  // open shared (inline transmit) windows

}  // namespace

const std::shared_ptr<MrEntry>* MrKeyTable::Find(uint32_t key) const {
  // 0 marks an empty slot and is never handed out: a peer naming key 0 must
  // not match the first empty slot (whose entry is null).
  if (key == 0 || slots_.empty()) return nullptr;
  for (size_t i = key & Mask();; i = (i + 1) & Mask()) {
    const Slot& s = slots_[i];
    if (s.key == key) return &s.e;
    if (s.key == 0) return nullptr;
  }
}

void MrKeyTable::Insert(uint32_t key, std::shared_ptr<MrEntry> e) {
  if ((size_ + 1) * 2 > slots_.size()) {
    std::vector<Slot> old = std::move(slots_);
    slots_ = std::vector<Slot>(std::max<size_t>(64, old.size() * 2));
    size_ = 0;
    for (Slot& s : old) {
      if (s.key != 0) Insert(s.key, std::move(s.e));
    }
  }
  size_t i = key & Mask();
  while (slots_[i].key != 0) i = (i + 1) & Mask();
  slots_[i].key = key;
  slots_[i].e = std::move(e);
  ++size_;
}

void MrKeyTable::Erase(uint32_t key) {
  if (slots_.empty()) return;
  size_t i = key & Mask();
  while (slots_[i].key != key) {
    if (slots_[i].key == 0) return;
    i = (i + 1) & Mask();
  }
  slots_[i] = Slot();
  --size_;
  // Backward shift: move up every later entry of the run whose home slot
  // is not cyclically within (i, j], so that no lookup meets a hole before
  // its key.
  for (size_t j = (i + 1) & Mask(); slots_[j].key != 0; j = (j + 1) & Mask()) {
    size_t home = slots_[j].key & Mask();
    bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (stays) continue;
    slots_[i] = std::move(slots_[j]);
    slots_[j] = Slot();
    i = j;
  }
}

MrTable& MrTable::Get() {
  static MrTable* table = new MrTable();
  return *table;
}

MrTable::MrTable() = default;

uint32_t MrTable::NextKey() {
  for (;;) {
    // Unpredictable, not a permutation: a key may repeat one handed out
    // before, so it is checked against the keys in use (two lookups of a
    // fresh key, which mostly land on an empty slot). A peer holding a
    // stale rkey hits a reissued key with the odds of guessing one.
    uint32_t k = keys_.Next();
    if (k != 0 && lkeys_.Find(k) == nullptr && rkeys_.Find(k) == nullptr) {
      return k;
    }
  }
}

absl::StatusOr<std::shared_ptr<MrEntry>> MrTable::Register(uint64_t pd_id,
                                                           void* addr,
                                                           size_t length,
                                                           int access) {
  if (addr == nullptr || length == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: register memory %p+%u: empty region", addr, length));
  }
  if ((access & ~kSupportedAccess) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("soft: register memory: unsupported access flags 0x%x",
                        access & ~kSupportedAccess));
  }
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0 &&
      (access & IBV_ACCESS_LOCAL_WRITE) == 0) {
    return absl::InvalidArgumentError(
        "soft: register memory: REMOTE_WRITE and REMOTE_ATOMIC require "
        "LOCAL_WRITE (EINVAL, as verbs)");
  }
  if (reinterpret_cast<uintptr_t>(addr) + length < length) {
    return absl::InvalidArgumentError("soft: register memory: range wraps");
  }
  auto mr = std::make_shared<MrEntry>();
  mr->addr = static_cast<char*>(addr);
  mr->length = length;
  mr->access = access;
  mr->pd_id = pd_id;
  std::unique_lock<std::shared_mutex> lock(mu_);
  mr->lkey = NextKey();
  lkeys_.Insert(mr->lkey, mr);
  mr->rkey = NextKey();
  rkeys_.Insert(mr->rkey, mr);
  return mr;
}

void MrTable::Deregister(const std::shared_ptr<MrEntry>& mr) {
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    lkeys_.Erase(mr->lkey);
    rkeys_.Erase(mr->rkey);
  }
  mr->valid.store(false);
  AccessEpoch::SynchronizeWith(*mr);
}

std::shared_ptr<MrEntry> MrTable::ReserveWindow(uint64_t pd_id) {
  auto w = std::make_shared<MrEntry>();
  w->pd_id = pd_id;
  w->is_window = true;
  std::unique_lock<std::shared_mutex> lock(mu_);
  w->rkey = NextKey();
  rkeys_.Insert(w->rkey, w);
  return w;
}

void MrTable::DropWindow(const std::shared_ptr<MrEntry>& w) {
  // The usual end of a landing grant's bind: the peer's SEND_WITH_INV
  // already removed its rkey, and there is nothing left to wait for. No
  // exclusive lock (it stalls the progress thread's lookups) for that.
  if (w->ended_by_peer.load()) return;
  bool ended_by_peer;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    const std::shared_ptr<MrEntry>* cur = rkeys_.Find(w->rkey);
    if (cur != nullptr && cur->get() == w.get()) rkeys_.Erase(w->rkey);
    ended_by_peer = w->ended_by_peer.load();
  }
  if (ended_by_peer || !w->valid.load()) return;
  w->valid.store(false);
  AccessEpoch::SynchronizeWith(*w);
}

bool MrTable::InvalidateByPeer(uint32_t rkey, uint64_t pd_id, uint64_t qp_uid) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  const std::shared_ptr<MrEntry>* w = rkeys_.Find(rkey);
  if (w == nullptr || !(*w)->is_window || (*w)->pd_id != pd_id ||
      (*w)->qp_uid != qp_uid || qp_uid == 0) {
    return false;
  }
  // Stays valid: a READ response it admitted earlier may still be queued.
  (*w)->ended_by_peer.store(true);
  rkeys_.Erase(rkey);
  return true;
}

uint8_t MrTable::Reader::BindWindow(uint32_t rkey, uint64_t pd_id,
                                    uint32_t mr_lkey, uint64_t addr,
                                    uint64_t length, int access,
                                    uint64_t qp_uid) const {
  const std::shared_ptr<MrEntry>* w = t_.rkeys_.Find(rkey);
  const std::shared_ptr<MrEntry>* mr = t_.lkeys_.Find(mr_lkey);
  if (!exclusive_ || w == nullptr || mr == nullptr || qp_uid == 0) {
    return IBV_WC_MW_BIND_ERR;
  }
  MrEntry& e = **w;
  const MrEntry& m = **mr;
  // A reserved, never bound window entry (each bind has its own).
  if (!e.is_window || e.pd_id != pd_id || e.qp_uid != 0 || e.parent ||
      !e.valid.load()) {
    return IBV_WC_MW_BIND_ERR;
  }
  if (m.pd_id != pd_id || (m.access & IBV_ACCESS_MW_BIND) == 0 ||
      !m.valid.load() || !m.Covers(addr, length)) {
    return IBV_WC_MW_BIND_ERR;
  }
  if ((access & ~kWindowAccess) != 0 ||
      ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) != 0 &&
       (m.access & IBV_ACCESS_LOCAL_WRITE) == 0)) {
    return IBV_WC_MW_BIND_ERR;
  }
  e.addr = reinterpret_cast<char*>(addr);
  e.length = length;
  e.access = access;
  e.parent = *mr;
  e.qp_uid = qp_uid;
  return IBV_WC_SUCCESS;
}

std::shared_ptr<MrEntry> MrTable::Reader::UnmapWindow(uint32_t rkey,
                                                      uint64_t pd_id) const {
  const std::shared_ptr<MrEntry>* w = t_.rkeys_.Find(rkey);
  if (!exclusive_ || w == nullptr || !(*w)->is_window || (*w)->pd_id != pd_id ||
      (*w)->qp_uid == 0) {
    return nullptr;
  }
  std::shared_ptr<MrEntry> e = *w;
  t_.rkeys_.Erase(rkey);
  return e;
}

uint64_t NewQpUid() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

const std::shared_ptr<MrEntry>* MrTable::Reader::FindLkey(uint32_t key) const {
  return t_.lkeys_.Find(key);
}

const std::shared_ptr<MrEntry>* MrTable::Reader::FindRkey(uint32_t key) const {
  return t_.rkeys_.Find(key);
}

thread_local uint64_t AccessEpoch::window_ = 0;

void AccessEpoch::Enter() { window_ = g_epoch.fetch_add(1) + 1; }

void AccessEpoch::Exit() {
  window_ = 0;
  g_epoch.fetch_add(1);
  if (g_sync_waiters.load() > 0) g_epoch.notify_all();
}

void AccessEpoch::EnterShared() { g_shared.fetch_add(1); }

void AccessEpoch::ExitShared() {
  if (g_shared.fetch_sub(1) == 1 && g_sync_waiters.load() > 0) {
    g_shared.notify_all();
  }
}

namespace {

// Waits while the exclusive window `e` (odd) is open.
void WaitOut(uint64_t e) {
  // Seq-cst on both sides: either Exit() sees our waiter count and notifies,
  // or we see its increment and do not wait.
  for (uint64_t now = g_epoch.load(); now == e; now = g_epoch.load()) {
    g_epoch.wait(e);
  }
}

}  // namespace

void AccessEpoch::SynchronizeWith(const MrEntry& mr) {
  // Why not wait for whatever window is open: a landing grant is
  // deregistered by the reactor that just took its message's completion,
  // while the progress thread is usually still in (or back in) a window,
  // serving other frames; waiting for that window put a futex sleep and
  // wake-up on most medium messages.
  // Only the window that last found the region valid matters. Usable()
  // stamps before reading `valid`, and the caller cleared `valid` before
  // we read the stamp (all seq-cst): if the progress thread saw the region
  // valid in window w, we read w (or a later stamp, whose window opened
  // after w closed). A window other than the open one has closed, and its
  // closing increment (read here) orders its accesses before our return.
  // A region pinned (MrPin) is used without stamps: while it is pinned,
  // wait for the open window, after which every window reads `valid`
  // false; once unpinned (read after our store), its uses are over. The
  // shared windows are counted only; a thread that uses the region inside
  // one is waited for as before.
  uint64_t w = mr.pins.load() != 0 ? g_epoch.load() : mr.seen_in.load();
  bool in_window = (w & 1) != 0 && g_epoch.load() == w;
  // Nothing to wait for (the common case): no waiter count to announce.
  if (!in_window && g_shared.load() == 0) return;
  g_sync_waiters.fetch_add(1);
  if (in_window) WaitOut(w);
  // Shared windows are counted, not numbered: once the count has been zero,
  // every window open at our call has closed (ExitShared notifies only when
  // it drops the count to zero and sees a waiter; seq-cst on both sides).
  for (int v = g_shared.load(); v != 0; v = g_shared.load()) g_shared.wait(v);
  g_sync_waiters.fetch_sub(1);
}

}  // namespace coverbs::transport::soft
