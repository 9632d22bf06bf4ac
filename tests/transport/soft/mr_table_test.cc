// Deregistration against the progress thread's access windows, with a
// thread of the test playing the progress thread (no QP exists in this
// binary, so no real one runs): Deregister waits exactly for a window that
// may be using the region, and no longer for one that cannot be.
#include "transport/soft/mr_table.h"

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "transport/soft/key_prf.h"

namespace coverbs::transport::soft {
namespace {

using std::chrono::milliseconds;

// A fake progress thread that runs the steps it is given, one at a time,
// on its own thread (windows are per thread).
class FakeProgressThread {
 public:
  FakeProgressThread() : t_([this] { Loop(); }) {}
  ~FakeProgressThread() {
    Do([this] { stop_ = true; });
    t_.join();
  }

  // Runs `fn` on the thread and returns once it has run.
  template <typename F>
  void Do(F fn) {
    std::promise<void> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      step_ = [&] {
        fn();
        done.set_value();
      };
    }
    cv_.notify_one();
    done.get_future().wait();
  }

 private:
  void Loop() {
    while (!stop_) {
      std::function<void()> step;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return step_ != nullptr; });
        step = std::move(step_);
        step_ = nullptr;
      }
      step();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> step_;
  bool stop_ = false;
  std::thread t_;
};

class MrTableTest : public ::testing::Test {
 protected:
  std::shared_ptr<MrEntry> Register() {
    auto e = MrTable::Get().Register(
        1, buf_.data(), buf_.size(),
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    EXPECT_TRUE(e.ok()) << e.status();
    return *e;
  }
  // Deregisters on another thread; the future is ready once it returned.
  std::future<void> DeregisterAsync(std::shared_ptr<MrEntry> e) {
    return std::async(std::launch::async,
                      [e] { MrTable::Get().Deregister(e); });
  }

  std::vector<char> buf_ = std::vector<char>(4096);
  FakeProgressThread progress_;
};

// The landing-grant case: the progress thread is in a window (serving other
// frames) that never used the region. Deregistration used to wait for it.
TEST_F(MrTableTest, DoesNotWaitForAWindowThatNeverUsedTheRegion) {
  auto e = Register();
  progress_.Do([] { AccessEpoch::Enter(); });
  auto done = DeregisterAsync(e);
  EXPECT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  progress_.Do([] { AccessEpoch::Exit(); });
  done.wait();
  EXPECT_FALSE(e->valid.load());
}

// A window that found the region valid may still be using its memory:
// deregistration returns only after that window closed.
TEST_F(MrTableTest, WaitsForTheWindowThatFoundTheRegionValid) {
  auto e = Register();
  std::atomic<bool> closed{false};
  progress_.Do([&] {
    AccessEpoch::Enter();
    EXPECT_TRUE(e->Usable());
  });
  auto done = DeregisterAsync(e);
  EXPECT_EQ(done.wait_for(milliseconds(200)), std::future_status::timeout);
  progress_.Do([&] {
    closed = true;
    AccessEpoch::Exit();
  });
  done.wait();
  EXPECT_TRUE(closed.load());
  // The next window sees it invalid.
  progress_.Do([&] {
    AccessEpoch::Enter();
    EXPECT_FALSE(e->Usable());
    AccessEpoch::Exit();
  });
}

// Found valid in an earlier window, and the progress thread is in another
// one now: that earlier window has closed, nothing to wait for.
TEST_F(MrTableTest, DoesNotWaitForALaterWindow) {
  auto e = Register();
  progress_.Do([&] {
    AccessEpoch::Enter();
    EXPECT_TRUE(e->Usable());
    AccessEpoch::Exit();
    AccessEpoch::Enter();
  });
  auto done = DeregisterAsync(e);
  EXPECT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  progress_.Do([] { AccessEpoch::Exit(); });
  done.wait();
}

// A pinned region (a WRITE being placed) is used across windows without
// stamps: deregistration waits for whatever window is open while the pin
// is held, and not at all once it is released.
TEST_F(MrTableTest, PinnedRegionWaitsForTheOpenWindowUntilUnpinned) {
  auto e = Register();
  MrPin pin;
  progress_.Do([&] {
    AccessEpoch::Enter();
    EXPECT_TRUE(pin.Pin(e));
    AccessEpoch::Exit();
    AccessEpoch::Enter();  // the WRITE's payload goes on in a new window
  });
  auto done = DeregisterAsync(e);
  EXPECT_EQ(done.wait_for(milliseconds(200)), std::future_status::timeout);
  progress_.Do([&] {
    EXPECT_FALSE(e->valid.load());  // what the placement checks next
    AccessEpoch::Exit();
  });
  done.wait();
  progress_.Do([&] { pin.Reset(); });

  auto f = Register();
  progress_.Do([&] {
    AccessEpoch::Enter();
    EXPECT_TRUE(pin.Pin(f));
    pin.Reset();  // the WRITE is placed; the window goes on
  });
  auto done2 = DeregisterAsync(f);
  EXPECT_EQ(done2.wait_for(std::chrono::seconds(10)),
            std::future_status::ready);
  progress_.Do([] { AccessEpoch::Exit(); });
  done2.wait();
  // A pin taken after deregistration fails.
  progress_.Do([&] { EXPECT_FALSE(pin.Pin(f)); });
}

// The key table against a std::map, with keys crowded into few home
// slots (low bits) so that probe runs wrap and erases shift entries back.
TEST(MrKeyTableTest, AgreesWithAMap) {
  MrKeyTable t;
  std::map<uint32_t, std::shared_ptr<MrEntry>> ref;
  std::mt19937 rng(7);
  auto random_key = [&] {
    uint32_t k = rng();
    if (rng() % 2) k &= 0xff00003fu;  // collide in the low bits
    return k == 0 ? 1u : k;
  };
  for (int round = 0; round < 20000; ++round) {
    uint32_t k = random_key();
    if (ref.count(k) == 0 && (ref.size() < 300 || rng() % 3 == 0)) {
      auto e = std::make_shared<MrEntry>();
      e->lkey = k;
      t.Insert(k, e);
      ref[k] = e;
    } else if (!ref.empty()) {
      auto it = ref.lower_bound(k);
      if (it == ref.end()) it = ref.begin();
      t.Erase(it->first);
      ref.erase(it);
    }
    if (round % 97 == 0) {
      ASSERT_EQ(t.size(), ref.size());
      for (const auto& [key, e] : ref) {
        const std::shared_ptr<MrEntry>* f = t.Find(key);
        ASSERT_NE(f, nullptr) << key;
        ASSERT_EQ(f->get(), e.get());
      }
      for (int i = 0; i < 50; ++i) {
        uint32_t absent = random_key();
        if (ref.count(absent) == 0) ASSERT_EQ(t.Find(absent), nullptr);
      }
    }
  }
}

// Key 0 marks an empty slot: asking for it must find nothing, whether the
// table is empty, holds entries, or had entries erased (a peer's WRITE
// naming rkey 0 once crashed the target on the null entry of an empty slot).
TEST(MrKeyTableTest, KeyZeroIsNeverFound) {
  MrKeyTable t;
  EXPECT_EQ(t.Find(0), nullptr);
  for (uint32_t k = 1; k <= 40; ++k)
    t.Insert(k * 0x9e3779b1u, std::make_shared<MrEntry>());
  EXPECT_EQ(t.Find(0), nullptr);
  for (uint32_t k = 1; k <= 40; k += 2) t.Erase(k * 0x9e3779b1u);
  EXPECT_EQ(t.Find(0), nullptr);
  MrTable::Reader r(MrTable::Get());
  EXPECT_EQ(r.FindRkey(0), nullptr);
  EXPECT_EQ(r.FindLkey(0), nullptr);
}

// Keys of a deregistered region are gone at once.
TEST_F(MrTableTest, KeysLeaveTheTable) {
  auto e = Register();
  uint32_t lkey = e->lkey, rkey = e->rkey;
  MrTable::Get().Deregister(e);
  MrTable::Reader r(MrTable::Get());
  EXPECT_EQ(r.FindLkey(lkey), nullptr);
  EXPECT_EQ(r.FindRkey(rkey), nullptr);
}

// The reference construction: the published SipHash-2-4 vector for the
// 8-byte message 00..07 under the key 00..0f.
TEST(KeyPrfTest, SipHash24MatchesTheReferenceVector) {
  EXPECT_EQ(SipHash24(0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL,
                      0x0706050403020100ULL),
            0x93f5f5799a932462ULL);
}

// Each stream draws its own secret: two of them do not agree.
TEST(KeyPrfTest, StreamsHaveSecretsOfTheirOwn) {
  KeyStream a, b;
  int same = 0;
  for (int i = 0; i < 64; ++i) same += a.Next() == b.Next();
  EXPECT_LT(same, 2);
}

// Keys of live registrations never collide and are never 0, and every bit
// of them is as often 1 as 0 (nothing like a counter shows through).
TEST_F(MrTableTest, KeysAreUniqueNonZeroAndBalanced) {
  std::vector<std::shared_ptr<MrEntry>> live;
  std::set<uint32_t> keys;
  int ones[32] = {};
  constexpr int kRegions = 4096;
  for (int i = 0; i < kRegions; ++i) {
    live.push_back(Register());
    for (uint32_t k : {live.back()->lkey, live.back()->rkey}) {
      ASSERT_NE(k, 0u);
      ASSERT_TRUE(keys.insert(k).second) << "key 0x" << std::hex << k;
      for (int b = 0; b < 32; ++b) ones[b] += (k >> b) & 1;
    }
  }
  for (int b = 0; b < 32; ++b) {
    // 8192 keys: 10% off half is more than 12 standard deviations.
    EXPECT_NEAR(ones[b], kRegions, kRegions / 10) << "bit " << b;
  }
  for (auto& e : live) MrTable::Get().Deregister(e);
}

// A window's rkey reaches memory only once bound, and only as bound: to
// the QP named, within the range and access given; the peer's invalidation
// must come through that QP; dropping it ends it.
TEST_F(MrTableTest, WindowBindScopesTheKey) {
  auto mr = MrTable::Get().Register(
      1, buf_.data(), buf_.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  ASSERT_TRUE(mr.ok()) << mr.status();
  auto no_bind = Register();  // LOCAL_WRITE | REMOTE_WRITE, no MW_BIND
  auto w = MrTable::Get().ReserveWindow(1);
  ASSERT_NE(w->rkey, 0u);
  const uint64_t base = reinterpret_cast<uint64_t>(buf_.data());
  {
    MrTable::Reader t(MrTable::Get(), true);
    // Refused: another PD, a region without MW_BIND, beyond the region.
    EXPECT_EQ(t.BindWindow(w->rkey, 2, (*mr)->lkey, base, 64,
                           IBV_ACCESS_REMOTE_WRITE, 7),
              IBV_WC_MW_BIND_ERR);
    EXPECT_EQ(t.BindWindow(w->rkey, 1, no_bind->lkey, base, 64,
                           IBV_ACCESS_REMOTE_WRITE, 7),
              IBV_WC_MW_BIND_ERR);
    EXPECT_EQ(t.BindWindow(w->rkey, 1, (*mr)->lkey, base, buf_.size() + 1,
                           IBV_ACCESS_REMOTE_WRITE, 7),
              IBV_WC_MW_BIND_ERR);
    EXPECT_EQ(t.BindWindow(w->rkey, 1, (*mr)->lkey, base, 64,
                           IBV_ACCESS_REMOTE_WRITE, 7),
              IBV_WC_SUCCESS);
    // Bound once: a second bind of the same entry is refused.
    EXPECT_EQ(t.BindWindow(w->rkey, 1, (*mr)->lkey, base, 64,
                           IBV_ACCESS_REMOTE_WRITE, 8),
              IBV_WC_MW_BIND_ERR);
    const std::shared_ptr<MrEntry>* e = t.FindRkey(w->rkey);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ((*e)->qp_uid, 7u);
    EXPECT_TRUE((*e)->Covers(base, 64));
    EXPECT_FALSE((*e)->Covers(base, 65));
  }
  EXPECT_FALSE(MrTable::Get().InvalidateByPeer(w->rkey, 1, 8));
  EXPECT_FALSE(MrTable::Get().InvalidateByPeer(w->rkey, 2, 7));
  EXPECT_TRUE(MrTable::Get().InvalidateByPeer(w->rkey, 1, 7));
  {
    MrTable::Reader t(MrTable::Get());
    EXPECT_EQ(t.FindRkey(w->rkey), nullptr);
  }
  MrTable::Get().DropWindow(w);  // after the peer's: nothing to wait for
  // A second window, ended by dropping it (deallocation, LOCAL_INV).
  auto w2 = MrTable::Get().ReserveWindow(1);
  {
    MrTable::Reader t(MrTable::Get(), true);
    ASSERT_EQ(t.BindWindow(w2->rkey, 1, (*mr)->lkey, base, 64,
                           IBV_ACCESS_REMOTE_READ, 9),
              IBV_WC_SUCCESS);
  }
  MrTable::Get().DropWindow(w2);
  EXPECT_FALSE(w2->Live());
  {
    MrTable::Reader t(MrTable::Get());
    EXPECT_EQ(t.FindRkey(w2->rkey), nullptr);
  }
  // A window lives only as long as its region.
  auto w3 = MrTable::Get().ReserveWindow(1);
  {
    MrTable::Reader t(MrTable::Get(), true);
    ASSERT_EQ(t.BindWindow(w3->rkey, 1, (*mr)->lkey, base, 64,
                           IBV_ACCESS_REMOTE_READ, 9),
              IBV_WC_SUCCESS);
  }
  EXPECT_TRUE(w3->Live());
  MrTable::Get().Deregister(*mr);
  EXPECT_FALSE(w3->Live());
  MrTable::Get().DropWindow(w3);
  MrTable::Get().Deregister(no_bind);
}

}  // namespace
}  // namespace coverbs::transport::soft
