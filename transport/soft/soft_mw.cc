#include "transport/soft/soft_mw.h"

#include <infiniband/verbs.h>

#include "transport/soft/mr_table.h"

namespace coverbs::transport::soft {
namespace {

class SoftMw : public ProviderMw {
 public:
  explicit SoftMw(uint64_t pd_id) : pd_id_(pd_id) {}
  // Deallocation ends the current bind; once it returns no access through
  // the window is in progress.
  ~SoftMw() override {
    if (entry_ != nullptr) MrTable::Get().DropWindow(entry_);
  }

  uint32_t rkey() const override { return entry_ ? entry_->rkey : 0; }

  uint32_t PrepareBind(ibv_send_wr& wr, const ProviderMr& mr, uint64_t addr,
                       size_t length, int access) override {
    // Each bind is a table entry of its own whose rkey is reserved now, so
    // the WR can carry it. Binding again ends the previous bind (verbs
    // refuses to bind a bound type-2 window; the grants and exposures of
    // cm bind a window again only once its last bind has ended).
    if (entry_ != nullptr) MrTable::Get().DropWindow(entry_);
    entry_ = MrTable::Get().ReserveWindow(pd_id_);
    // The WR names the region through an ibv_mr as verbs does; the bind
    // reads its lkey when it is posted.
    raw_mr_ = ibv_mr{};
    raw_mr_.addr = mr.addr();
    raw_mr_.length = mr.length();
    raw_mr_.lkey = mr.lkey();
    raw_mr_.rkey = mr.rkey();
    raw_mw_ = ibv_mw{};
    raw_mw_.rkey = entry_->rkey;
    raw_mw_.type = IBV_MW_TYPE_2;
    wr.opcode = IBV_WR_BIND_MW;
    wr.num_sge = 0;
    wr.sg_list = nullptr;
    wr.bind_mw.mw = &raw_mw_;
    wr.bind_mw.rkey = entry_->rkey;
    wr.bind_mw.bind_info.mr = &raw_mr_;
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = length;
    wr.bind_mw.bind_info.mw_access_flags = static_cast<unsigned>(access);
    return entry_->rkey;
  }

 private:
  const uint64_t pd_id_;
  std::shared_ptr<MrEntry> entry_;  // the last bind prepared
  ibv_mr raw_mr_{};
  ibv_mw raw_mw_{};
};

}  // namespace

std::unique_ptr<ProviderMw> NewSoftMw(uint64_t pd_id) {
  return std::make_unique<SoftMw>(pd_id);
}

}  // namespace coverbs::transport::soft
