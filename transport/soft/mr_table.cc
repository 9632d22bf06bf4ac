#include "transport/soft/mr_table.h"

#include <infiniband/verbs.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <random>

#include "absl/strings/str_format.h"

namespace coverbs::transport::soft {
namespace {

// A bijection on 32-bit integers (lowbias32): consecutive counters map to
// scattered keys that do not repeat until the counter wraps.
uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

constexpr int kSupportedAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
    IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_RELAXED_ORDERING;

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

MrTable::MrTable() {
  std::random_device rd;
  counter_ =
      rd() ^ static_cast<uint32_t>(
                 std::chrono::steady_clock::now().time_since_epoch().count());
  first_counter_ = counter_;
}

uint32_t MrTable::NextKey() {
  for (;;) {
    uint32_t k = Mix(counter_++);
    if (counter_ == first_counter_) wrapped_ = true;
    // Mix is a bijection: until the counter wraps, no key can be in use
    // (two lookups per key saved on every registration).
    if (k != 0 && (!wrapped_ ||
                   (lkeys_.Find(k) == nullptr && rkeys_.Find(k) == nullptr))) {
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
