#include "transport/soft/qp_core.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "transport/soft/engine.h"

namespace coverbs::transport::soft {
namespace {

constexpr size_t kRbufSize = 64 * 1024;     // receive staging buffer
constexpr size_t kArenaSize = 32 * 1024;    // transmit headers + inline data
constexpr size_t kMaxSegs = 256;            // iovecs per sendmsg
constexpr size_t kDirectMin = 4096;         // payload read straight to target
constexpr size_t kRxBudget = 4 * 1024 * 1024;  // bytes per QP per iteration
constexpr int kTxRounds = 8;                // batches per QP per iteration
// Bytes handed to sendmsg per QP per iteration: small enough that a reader
// on the same host copies them out while they are still in cache.
constexpr size_t kTxBudget = 384 * 1024;
constexpr uint32_t kMaxRdAtomic = 128;      // outstanding READ/atomics
constexpr uint64_t kMaxMessage = 1ULL << 31;
constexpr auto kCloseTimeout = std::chrono::seconds(2);

// IB min_rnr_timer encoding in units of 10 us.
constexpr uint32_t kRnrTable[32] = {
    65536, 1,    2,    3,    4,    6,    8,     12,    16,    24,   32,
    48,    64,   96,   128,  192,  256,  384,   512,   768,   1024, 1536,
    2048,  3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152};

ibv_wc_opcode WcOpcode(uint8_t wr_opcode) {
  switch (wr_opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return IBV_WC_FETCH_ADD;
    default:
      return IBV_WC_SEND;
  }
}

bool IsAtomic(uint8_t op) {
  return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

const char* WcStatusName(uint8_t s) {
  return ibv_wc_status_str(static_cast<ibv_wc_status>(s));
}

}  // namespace

std::chrono::microseconds RnrDelay(uint8_t code) {
  return std::chrono::microseconds(kRnrTable[code & 31]);
}

QpCore::QpCore(Engine* engine, uint64_t id, QpConfig config)
    : engine_(engine),
      id_(id),
      cfg_(std::move(config)),
      sq_cap_(cfg_.init.max_send_wr),
      max_send_sge_(cfg_.init.max_send_sge),
      max_inline_(cfg_.init.max_inline_data),
      rq_(cfg_.srq ? nullptr
                   : std::make_unique<RecvQueue>(cfg_.init.max_recv_wr,
                                                 cfg_.init.max_recv_sge,
                                                 cfg_.pd_id)),
      sq_(sq_cap_),
      sq_sge_(static_cast<size_t>(sq_cap_) * max_send_sge_),
      sq_mr_(static_cast<size_t>(sq_cap_) * max_send_sge_),
      sq_inline_(static_cast<size_t>(sq_cap_) * max_inline_) {}

QpCore::~QpCore() {
  if (fd_ >= 0) close(fd_);
}

// ---------------------------------------------------------------------------
// Application side

bool QpCore::IsRdAtomic(const SendWqe& w) const {
  return w.opcode == IBV_WR_RDMA_READ || IsAtomic(w.opcode);
}

absl::Status QpCore::CheckSendWr(const ibv_send_wr& wr) const {
  switch (wr.opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_RDMA_READ:
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post send on qp %u: opcode %d not supported (EINVAL)",
          qp_num(), static_cast<int>(wr.opcode)));
  }
  if (wr.num_sge < 0 || static_cast<uint32_t>(wr.num_sge) > max_send_sge_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: num_sge %d exceeds max_send_sge %u "
        "(EINVAL)",
        qp_num(), wr.num_sge, max_send_sge_));
  }
  if (wr.num_sge > 0 && wr.sg_list == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: null sg_list (EINVAL)", qp_num()));
  }
  uint64_t total = 0;
  for (int i = 0; i < wr.num_sge; ++i) total += wr.sg_list[i].length;
  if (total > kMaxMessage) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: message of %u bytes exceeds 2 GiB (EINVAL)",
        qp_num(), total));
  }
  if (IsAtomic(wr.opcode) &&
      (wr.num_sge != 1 || wr.sg_list[0].length != 8)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: an atomic needs one 8-byte SGE (EINVAL)",
        qp_num()));
  }
  if ((wr.send_flags & IBV_SEND_INLINE) != 0) {
    if (wr.opcode == IBV_WR_RDMA_READ || IsAtomic(wr.opcode)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post send on qp %u: IBV_SEND_INLINE on a READ or atomic "
          "(EINVAL)",
          qp_num()));
    }
    if (total > max_inline_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post send on qp %u: inline message of %u bytes exceeds "
          "max_inline_data %u (EINVAL)",
          qp_num(), total, max_inline_));
    }
  }
  return absl::OkStatus();
}

void QpCore::FillSendWqe(const MrTable::Reader& table, const ibv_send_wr& wr,
                         uint64_t index) {
  size_t i = index % sq_cap_;
  SendWqe& w = sq_[i];
  w.wr_id = wr.wr_id;
  w.opcode = static_cast<uint8_t>(wr.opcode);
  w.status = IBV_WC_SUCCESS;
  w.rnr_retries = 0;
  w.signaled = cfg_.init.sq_sig_all || (wr.send_flags & IBV_SEND_SIGNALED);
  w.solicited = (wr.send_flags & IBV_SEND_SOLICITED) != 0;
  w.inlined = (wr.send_flags & IBV_SEND_INLINE) != 0;
  w.num_sge = static_cast<uint32_t>(wr.num_sge);
  w.imm = (wr.opcode == IBV_WR_SEND_WITH_IMM ||
           wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM)
              ? wr.imm_data
              : 0;
  w.remote_addr = 0;
  w.rkey = 0;
  w.compare_add = 0;
  w.swap = 0;
  if (IsAtomic(wr.opcode)) {
    w.remote_addr = wr.wr.atomic.remote_addr;
    w.rkey = wr.wr.atomic.rkey;
    w.compare_add = wr.wr.atomic.compare_add;
    w.swap = wr.wr.atomic.swap;
  } else if (wr.opcode != IBV_WR_SEND && wr.opcode != IBV_WR_SEND_WITH_IMM) {
    w.remote_addr = wr.wr.rdma.remote_addr;
    w.rkey = wr.wr.rdma.rkey;
  }
  w.total = 0;
  if (w.inlined) {
    // Copied now: the buffer is the caller's again when PostSend returns.
    char* dst = sq_inline_.data() + i * max_inline_;
    for (int k = 0; k < wr.num_sge; ++k) {
      const ibv_sge& sge = wr.sg_list[k];
      if (sge.length == 0) continue;
      std::memcpy(dst + w.total, reinterpret_cast<const void*>(sge.addr),
                  sge.length);
      w.total += sge.length;
    }
    return;
  }
  bool nic_writes = wr.opcode == IBV_WR_RDMA_READ || IsAtomic(wr.opcode);
  for (int k = 0; k < wr.num_sge; ++k) {
    const ibv_sge& sge = wr.sg_list[k];
    size_t j = i * max_send_sge_ + k;
    sq_sge_[j] = sge;
    w.total += sge.length;
    if (sge.length == 0) {
      sq_mr_[j].reset();
      continue;
    }
    const std::shared_ptr<MrEntry>* mr =
        CheckLocalSge(table, cfg_.pd_id, sge, nic_writes);
    if (mr == nullptr) {
      w.status = IBV_WC_LOC_PROT_ERR;
      sq_mr_[j].reset();
    } else {
      sq_mr_[j] = *mr;
    }
  }
}

absl::Status QpCore::PostSend(ibv_send_wr* wr, ibv_send_wr** bad) {
  int st = state_.load(std::memory_order_acquire);
  if (st != IBV_QPS_RTS && st != IBV_QPS_ERR) {
    if (bad) *bad = wr;
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: QP is not connected (state %d) (EINVAL)",
        qp_num(), st));
  }
  absl::Status status;
  bool posted = false;
  {
    MrTable::Reader table(MrTable::Get());
    std::lock_guard<std::mutex> lock(mu_);
    for (; wr != nullptr; wr = wr->next) {
      status = CheckSendWr(*wr);
      if (status.ok() && sq_head_ - sq_tail_ >= sq_cap_) {
        status = absl::ResourceExhaustedError(absl::StrFormat(
            "soft: post send on qp %u: send queue full (%u WRs) (ENOMEM)",
            qp_num(), sq_cap_));
      }
      if (!status.ok()) {
        if (bad) *bad = wr;
        break;
      }
      FillSendWqe(table, *wr, sq_head_);
      ++sq_head_;
      posted = true;
    }
  }
  if (posted) Kick();
  return status;
}

absl::Status QpCore::PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (!rq_) {
    if (bad) *bad = wr;
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post recv on qp %u: the QP receives from an SRQ (EINVAL)",
        qp_num()));
  }
  absl::Status s = rq_->Post(wr, bad, qp_num());
  // A QP in error flushes what is posted to it.
  if (state_.load() == IBV_QPS_ERR) Kick();
  return s;
}

void QpCore::RequestError() {
  error_requested_.store(true);
  state_.store(IBV_QPS_ERR);
  Kick();
}

void QpCore::Kick() {
  if (!kicked_.exchange(true)) engine_->Kick(this);
}

// ---------------------------------------------------------------------------
// Progress thread: life cycle

void QpCore::Connect(int fd) {
  if (err_ || removed_) {
    close(fd);
    return;
  }
  fd_ = fd;
  // Not zero-filled (make_unique would touch every page): an idle
  // connection keeps only what it has used resident.
  rbuf_ = std::make_unique_for_overwrite<char[]>(kRbufSize);
  arena_ = std::make_unique_for_overwrite<char[]>(kArenaSize);
  segs_.resize(kMaxSegs);
  engine_->WatchIn(this);
  engine_->Activate(this);
}

void QpCore::OnKick() {
  kicked_.store(false);
  if (removed_) return;
  if (error_requested_.load() && !err_) {
    EnterError(Cause::kLocalRequest, "moved to the error state by SetError");
  }
  if (err_) {
    FlushRq();
    if (nsegs_ == 0) FlushSq();
    return;
  }
  engine_->Activate(this);
}

void QpCore::OnReadable() {
  rx_ready_ = true;
  engine_->Activate(this);
}

void QpCore::OnWritable() {
  tx_blocked_ = false;
  engine_->Activate(this);
}

void QpCore::Service() {
  if (removed_) return;
  if (rx_ready_ && fd_ >= 0) DoRx();
  DoTx();
}

std::chrono::nanoseconds QpCore::AckTimeout() const {
  // IB: 4.096 us x 2^timeout per attempt, retry_cnt retries; 0 = infinite.
  uint8_t t = cfg_.init.timeout;
  if (t == 0) return std::chrono::nanoseconds(0);
  int64_t attempt = int64_t{4096} << std::min<uint8_t>(t, 31);
  return std::chrono::nanoseconds(attempt * (cfg_.init.retry_cnt + 1));
}

void QpCore::NoteProgress() {
  progress_at_ = std::chrono::steady_clock::now();
  ArmAckTimer();
}

void QpCore::ArmAckTimer() {
  if (err_ || removed_ || ack_timer_armed_ || comp_ptr_ >= send_ptr_) return;
  auto t = AckTimeout();
  if (t.count() == 0) return;
  ack_timer_armed_ = true;
  ack_due_ = progress_at_ + t;
  engine_->AddTimer(this, ack_due_);
}

void QpCore::OnTimer(SteadyTime now) {
  if (removed_) return;
  if (ack_timer_armed_ && now >= ack_due_) {
    ack_timer_armed_ = false;
    if (!err_ && comp_ptr_ < send_ptr_) {
      if (now >= progress_at_ + AckTimeout()) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
            now - progress_at_);
        CompleteWqe(comp_ptr_, IBV_WC_RETRY_EXC_ERR);
        EnterError(Cause::kFault,
                   absl::StrFormat(
                       "transport retry counter exceeded: nothing from the "
                       "peer for %d ms with requests outstanding (timeout "
                       "%u, retry_cnt %u)",
                       ms.count(), cfg_.init.timeout, cfg_.init.retry_cnt));
        return;
      }
      ArmAckTimer();  // progress since: wait from the latest
    }
  }
  if (rnr_wait_ && now >= rnr_until_) {
    rnr_wait_ = false;
    engine_->Activate(this);
  }
  if (err_ && !closed_ && now >= close_deadline_) CloseNow();
}

void QpCore::Destroy() {
  removed_ = true;
  if (fd_ >= 0) {
    // Best effort: tell the peer this was deliberate (when the stream is at a
    // frame boundary) so it does not report a fault.
    if (!err_ && hello_sent_ && seg_idx_ == nsegs_) {
      char buf[wire::kHeaderSize];
      wire::Header h;
      h.opcode = wire::kDisconnect;
      wire::Encode(h, buf);
      ssize_t n = send(fd_, buf, sizeof(buf), MSG_DONTWAIT | MSG_NOSIGNAL);
      (void)n;
    }
    engine_->Unwatch(this);
    close(fd_);
    fd_ = -1;
  }
  closed_ = true;
  ResetTx();
  ctrl_.clear();
  rx_mr_.reset();
  have_cur_recv_ = false;
  for (auto& mr : cur_recv_.mr) mr.reset();
}

// ---------------------------------------------------------------------------
// Progress thread: receive

bool QpCore::RecvResult(ssize_t n) {
  if (n > 0) {
    NoteProgress();
    return true;
  }
  if (n == 0) {
    if (err_) {
      CloseNow();
    } else {
      ConnectionLost("connection closed by the peer");
    }
    return false;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK) {
    rx_ready_ = false;
    return false;
  }
  if (errno == EINTR) {
    engine_->Activate(this);  // try again next iteration
    return false;
  }
  if (err_) {
    CloseNow();
  } else {
    ConnectionLost(absl::StrFormat("receive failed: %s", strerror(errno)));
  }
  return false;
}

void QpCore::DrainAfterError() {
  // After the error transition nothing more is parsed: bytes are read and
  // dropped until the peer closes (or the close timer fires).
  for (int i = 0; i < 64 && rx_ready_ && fd_ >= 0; ++i) {
    ssize_t n = recv(fd_, engine_->discard_buffer(), Engine::kDiscardSize,
                     MSG_DONTWAIT);
    if (!RecvResult(n)) return;
  }
  if (rx_ready_) engine_->Activate(this);
}

void QpCore::DoRx() {
  size_t budget = kRxBudget;
  while (rx_ready_ && fd_ >= 0) {
    if (err_) {
      DrainAfterError();
      return;
    }
    if (!in_payload_) {
      if (rend_ - rpos_ >= wire::kHeaderSize) {
        wire::Header h = wire::Decode(rbuf_.get() + rpos_);
        rpos_ += wire::kHeaderSize;
        StartFrame(h);
        continue;
      }
      if (budget == 0) break;
      if (rpos_ > 0) {
        std::memmove(rbuf_.get(), rbuf_.get() + rpos_, rend_ - rpos_);
        rend_ -= rpos_;
        rpos_ = 0;
      }
      ssize_t n =
          recv(fd_, rbuf_.get() + rend_, kRbufSize - rend_, MSG_DONTWAIT);
      if (!RecvResult(n)) return;
      rend_ += n;
      budget -= std::min<size_t>(budget, n);
      continue;
    }
    size_t avail = rend_ - rpos_;
    if (avail > 0) {
      size_t take = std::min<uint64_t>(avail, pay_left_);
      Place(rbuf_.get() + rpos_, take);
      rpos_ += take;
      pay_left_ -= take;
      if (pay_left_ == 0) {
        in_payload_ = false;
        FinishFrame();
      }
      continue;
    }
    if (budget == 0) break;
    rpos_ = rend_ = 0;
    ssize_t n;
    if (pay_left_ >= kDirectMin) {
      // Payload straight into its destination; whatever follows it lands in
      // the staging buffer.
      iovec iov[kMaxSge + 1];
      size_t covered = 0;
      int niov = DestIov(iov, kMaxSge, &covered);
      if (covered == pay_left_) {
        iov[niov].iov_base = rbuf_.get();
        iov[niov].iov_len = kRbufSize;
        ++niov;
      }
      n = readv(fd_, iov, niov);
      if (!RecvResult(n)) return;
      size_t placed = std::min<uint64_t>(n, pay_left_);
      AdvanceDest(placed);
      pay_left_ -= placed;
      rend_ = n - placed;
      if (pay_left_ == 0) {
        in_payload_ = false;
        FinishFrame();
      }
    } else {
      n = recv(fd_, rbuf_.get(), kRbufSize, MSG_DONTWAIT);
      if (!RecvResult(n)) return;
      rend_ = n;
    }
    budget -= std::min<size_t>(budget, n);
  }
  if (rx_ready_ && fd_ >= 0) engine_->Activate(this);
}

void QpCore::BeginPayload(RxKind kind, uint64_t len) {
  rx_kind_ = kind;
  rx_err_ = false;
  dest_idx_ = 0;
  dest_off_ = 0;
  pay_left_ = len;
  if (len == 0) {
    FinishFrame();
  } else {
    in_payload_ = true;
  }
}

void QpCore::Place(const char* src, size_t n) {
  if (rx_kind_ == RxKind::kDiscard || rx_err_) return;
  while (n > 0 && dest_idx_ < ndest_) {
    Dest& d = dests_[dest_idx_];
    if (d.mr != nullptr && !d.mr->valid.load()) {
      rx_err_ = true;
      return;
    }
    size_t c = std::min(n, d.len - dest_off_);
    std::memcpy(d.p + dest_off_, src, c);
    src += c;
    n -= c;
    dest_off_ += c;
    if (dest_off_ == d.len) {
      ++dest_idx_;
      dest_off_ = 0;
    }
  }
}

int QpCore::DestIov(iovec* iov, int max, size_t* covered) {
  int n = 0;
  *covered = 0;
  if (rx_kind_ != RxKind::kDiscard && !rx_err_) {
    uint64_t left = pay_left_;
    for (uint32_t i = dest_idx_; i < ndest_ && n < max && left > 0; ++i) {
      Dest& d = dests_[i];
      if (d.mr != nullptr && !d.mr->valid.load()) {
        rx_err_ = true;
        n = 0;
        break;
      }
      size_t off = i == dest_idx_ ? dest_off_ : 0;
      size_t len = std::min<uint64_t>(d.len - off, left);
      iov[n].iov_base = d.p + off;
      iov[n].iov_len = len;
      left -= len;
      *covered += len;
      ++n;
    }
    if (n > 0) return n;
    *covered = 0;
  }
  iov[0].iov_base = engine_->discard_buffer();
  iov[0].iov_len = std::min<uint64_t>(pay_left_, Engine::kDiscardSize);
  *covered = iov[0].iov_len;
  return 1;
}

void QpCore::AdvanceDest(size_t n) {
  if (rx_kind_ == RxKind::kDiscard || rx_err_) return;
  while (n > 0 && dest_idx_ < ndest_) {
    size_t c = std::min(n, dests_[dest_idx_].len - dest_off_);
    n -= c;
    dest_off_ += c;
    if (dest_off_ == dests_[dest_idx_].len) {
      ++dest_idx_;
      dest_off_ = 0;
    }
  }
}

bool QpCore::TakeRecv() {
  RecvQueue* q = rq_ ? rq_.get() : cfg_.srq.get();
  if (!q->Take(&cur_recv_)) return false;
  have_cur_recv_ = true;
  return true;
}

uint8_t QpCore::CheckRemote(uint32_t rkey, uint64_t addr, uint64_t len,
                            int access, std::shared_ptr<MrEntry>* out) const {
  MrTable::Reader table(MrTable::Get());
  const std::shared_ptr<MrEntry>* mr = table.FindRkey(rkey);
  if (mr == nullptr) return IBV_WC_REM_ACCESS_ERR;
  const MrEntry& e = **mr;
  if (e.pd_id != cfg_.pd_id || (e.access & access) == 0 ||
      !e.Covers(addr, len) || !e.valid.load()) {
    return IBV_WC_REM_ACCESS_ERR;
  }
  *out = *mr;
  return IBV_WC_SUCCESS;
}

void QpCore::QueueCtrl(Ctrl c) {
  ctrl_.push_back(std::move(c));
  engine_->Activate(this);
}

void QpCore::QueueAck(uint64_t seq) {
  if (!ctrl_.empty() && ctrl_.back().op == wire::kAck) {
    ctrl_.back().seq = seq;
    return;
  }
  Ctrl c;
  c.op = wire::kAck;
  c.seq = seq;
  QueueCtrl(std::move(c));
}

void QpCore::RespondError(uint8_t nak_status, const std::string& why) {
  Ctrl c;
  c.op = wire::kNak;
  c.seq = cur_.seq;
  c.syndrome = nak_status;
  QueueCtrl(std::move(c));
  EnterError(Cause::kFault, why);
}

void QpCore::PushRecvWc(uint8_t status, ibv_wc_opcode op, uint32_t len,
                        bool imm, uint32_t imm_data) {
  ibv_wc wc{};
  wc.wr_id = cur_recv_.wr_id;
  wc.status = static_cast<ibv_wc_status>(status);
  wc.opcode = op;
  wc.byte_len = len;
  wc.qp_num = qp_num();
  wc.src_qp = peer_qpn_;
  if (imm) {
    wc.wc_flags = IBV_WC_WITH_IMM;
    wc.imm_data = imm_data;
  }
  have_cur_recv_ = false;
  for (uint32_t k = 0; k < cur_recv_.num_sge; ++k) cur_recv_.mr[k].reset();
  if (!cfg_.recv_cq->Push(wc)) {
    EnterError(Cause::kFault, "receive CQ overrun");
  }
}

void QpCore::RecvFailed(uint8_t recv_status, uint8_t nak_status,
                        const std::string& why) {
  PushRecvWc(recv_status, IBV_WC_RECV, 0, false, 0);
  RespondError(nak_status, why);
}

void QpCore::ProtocolError(const std::string& why) {
  EnterError(Cause::kFault, "protocol error: " + why);
}

void QpCore::StartFrame(const wire::Header& h) {
  cur_ = h;
  if (!hello_rx_) {
    if (h.opcode != wire::kHello || h.addr != wire::kHelloMagic ||
        h.payload_len != 0) {
      ProtocolError("the peer is not a coverbs soft QP (bad hello)");
      return;
    }
    if (h.dma_len != wire::kVersion) {
      ProtocolError(absl::StrFormat("peer speaks version %u, we speak %u",
                                    h.dma_len, wire::kVersion));
      return;
    }
    hello_rx_ = true;
    peer_qpn_ = h.qpn;
    return;
  }
  switch (h.opcode) {
    case wire::kSend:
    case wire::kSendImm:
    case wire::kWrite:
    case wire::kWriteImm:
    case wire::kReadReq:
    case wire::kCmpSwap:
    case wire::kFetchAdd:
      StartRequest(h);
      return;
    case wire::kAck:
      if (h.payload_len != 0) break;
      AckBefore(h.seq + 1);
      return;
    case wire::kNak:
    case wire::kRnrNak: {
      if (h.payload_len != 0) break;
      if (!AckBefore(h.seq)) return;
      if (h.seq != comp_ptr_ || h.seq >= send_ptr_) {
        ProtocolError(absl::StrFormat("NAK for request %u not outstanding",
                                      h.seq));
        return;
      }
      SendWqe& w = Wqe(h.seq);
      if (h.opcode == wire::kNak) {
        uint8_t st = h.syndrome;
        if (st != IBV_WC_REM_ACCESS_ERR && st != IBV_WC_REM_INV_REQ_ERR &&
            st != IBV_WC_REM_OP_ERR) {
          st = IBV_WC_REM_OP_ERR;
        }
        CompleteWqe(h.seq, st);
        EnterError(Cause::kFault,
                   absl::StrFormat("request %u failed at the responder: %s",
                                   h.seq, WcStatusName(st)));
        return;
      }
      uint8_t limit = cfg_.init.rnr_retry;
      if (limit != 7 && w.rnr_retries >= limit) {
        CompleteWqe(h.seq, IBV_WC_RNR_RETRY_EXC_ERR);
        EnterError(Cause::kFault,
                   absl::StrFormat("RNR retries exhausted (rnr_retry %u)",
                                   limit));
        return;
      }
      ++w.rnr_retries;
      // Go back: everything from this request on is sent again.
      send_ptr_ = h.seq;
      rd_atomic_out_ = 0;
      rnr_wait_ = true;
      rnr_until_ = std::chrono::steady_clock::now() + RnrDelay(h.syndrome);
      engine_->AddTimer(this, rnr_until_);
      return;
    }
    case wire::kReadResp:
    case wire::kAtomicResp: {
      if (!AckBefore(h.seq)) return;
      bool read = h.opcode == wire::kReadResp;
      if (h.seq != comp_ptr_ || h.seq >= send_ptr_) {
        ProtocolError(absl::StrFormat("response for request %u not outstanding",
                                      h.seq));
        return;
      }
      SendWqe& w = Wqe(h.seq);
      if (read ? w.opcode != IBV_WR_RDMA_READ : !IsAtomic(w.opcode)) {
        ProtocolError("response does not match the request");
        return;
      }
      if (read ? h.payload_len != w.total
               : h.payload_len != wire::kAtomicRespSize) {
        ProtocolError("response length does not match the request");
        return;
      }
      size_t base = (h.seq % sq_cap_) * max_send_sge_;
      if (read) {
        ndest_ = 0;
        for (uint32_t k = 0; k < w.num_sge; ++k) {
          const ibv_sge& sge = sq_sge_[base + k];
          if (sge.length == 0) continue;
          dests_[ndest_++] = Dest{reinterpret_cast<char*>(sge.addr),
                                  sge.length, sq_mr_[base + k].get()};
        }
        BeginPayload(RxKind::kReadResp, h.payload_len);
      } else {
        ndest_ = 1;
        dests_[0] = Dest{atomic_buf_, wire::kAtomicRespSize, nullptr};
        BeginPayload(RxKind::kAtomicResp, h.payload_len);
      }
      return;
    }
    case wire::kDisconnect:
      EnterError(Cause::kPeerDisconnect, "the peer QP disconnected");
      return;
    default:
      break;
  }
  ProtocolError(absl::StrFormat("unexpected frame opcode %u length %u",
                                h.opcode, h.payload_len));
}

void QpCore::StartRequest(const wire::Header& h) {
  if (h.seq != expected_seq_) {
    if (rnr_drop_ && h.seq > expected_seq_) {
      // Sent before our RNR NAK reached the requester: dropped, resent later.
      ndest_ = 0;
      BeginPayload(RxKind::kDiscard, h.payload_len);
      return;
    }
    ProtocolError(absl::StrFormat("request %u, expected %u", h.seq,
                                  expected_seq_));
    return;
  }
  rnr_drop_ = false;
  auto rnr = [&] {
    Ctrl c;
    c.op = wire::kRnrNak;
    c.seq = h.seq;
    c.syndrome = cfg_.init.min_rnr_timer;
    QueueCtrl(std::move(c));
    rnr_drop_ = true;
    ndest_ = 0;
    BeginPayload(RxKind::kDiscard, h.payload_len);
  };
  switch (h.opcode) {
    case wire::kSend:
    case wire::kSendImm: {
      if (h.payload_len > kMaxMessage) {
        ProtocolError("SEND larger than 2 GiB");
        return;
      }
      if (!TakeRecv()) {
        rnr();
        return;
      }
      if (cur_recv_.status != IBV_WC_SUCCESS) {
        RecvFailed(IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR,
                   "receive WR has an invalid local key");
        return;
      }
      if (h.payload_len > cur_recv_.total) {
        RecvFailed(IBV_WC_LOC_LEN_ERR, IBV_WC_REM_INV_REQ_ERR,
                   absl::StrFormat("SEND of %u bytes into a %u-byte receive",
                                   h.payload_len, cur_recv_.total));
        return;
      }
      ndest_ = 0;
      for (uint32_t k = 0; k < cur_recv_.num_sge; ++k) {
        if (cur_recv_.sge[k].length == 0) continue;
        dests_[ndest_++] = Dest{reinterpret_cast<char*>(cur_recv_.sge[k].addr),
                                cur_recv_.sge[k].length, cur_recv_.mr[k].get()};
      }
      BeginPayload(RxKind::kRecv, h.payload_len);
      return;
    }
    case wire::kWrite:
    case wire::kWriteImm: {
      ndest_ = 0;
      if (h.payload_len > 0) {
        if (CheckRemote(h.rkey, h.addr, h.payload_len,
                        IBV_ACCESS_REMOTE_WRITE, &rx_mr_) != IBV_WC_SUCCESS) {
          RespondError(IBV_WC_REM_ACCESS_ERR,
                       absl::StrFormat("RDMA WRITE denied: rkey 0x%x addr "
                                       "0x%x len %u",
                                       h.rkey, h.addr, h.payload_len));
          return;
        }
        ndest_ = 1;
        dests_[0] = Dest{reinterpret_cast<char*>(h.addr), h.payload_len,
                         rx_mr_.get()};
      }
      if (h.opcode == wire::kWriteImm && !TakeRecv()) {
        rx_mr_.reset();
        rnr();
        return;
      }
      BeginPayload(RxKind::kWrite, h.payload_len);
      return;
    }
    case wire::kReadReq: {
      if (h.payload_len != 0) break;
      Ctrl c;
      c.op = wire::kReadResp;
      c.seq = h.seq;
      c.addr = h.addr;
      c.len = h.dma_len;
      if (h.dma_len > 0 &&
          CheckRemote(h.rkey, h.addr, h.dma_len, IBV_ACCESS_REMOTE_READ,
                      &c.mr) != IBV_WC_SUCCESS) {
        RespondError(IBV_WC_REM_ACCESS_ERR,
                     absl::StrFormat("RDMA READ denied: rkey 0x%x addr 0x%x "
                                     "len %u",
                                     h.rkey, h.addr, h.dma_len));
        return;
      }
      ++expected_seq_;
      QueueCtrl(std::move(c));
      return;
    }
    case wire::kCmpSwap:
    case wire::kFetchAdd:
      if (h.payload_len != wire::kAtomicReqSize) break;
      ndest_ = 1;
      dests_[0] = Dest{atomic_buf_, wire::kAtomicReqSize, nullptr};
      BeginPayload(RxKind::kAtomicReq, h.payload_len);
      return;
    default:
      break;
  }
  ProtocolError(absl::StrFormat("malformed request opcode %u length %u",
                                h.opcode, h.payload_len));
}

void QpCore::FinishFrame() {
  const wire::Header& h = cur_;
  switch (rx_kind_) {
    case RxKind::kDiscard:
      return;
    case RxKind::kRecv:
      if (rx_err_) {
        RecvFailed(IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR,
                   "receive buffer deregistered while a SEND landed in it");
        return;
      }
      ++expected_seq_;
      QueueAck(h.seq);
      PushRecvWc(IBV_WC_SUCCESS, IBV_WC_RECV, h.payload_len,
                 h.opcode == wire::kSendImm, h.imm);
      return;
    case RxKind::kWrite:
      rx_mr_.reset();
      if (rx_err_) {
        RespondError(IBV_WC_REM_ACCESS_ERR,
                     "target region deregistered during an RDMA WRITE");
        return;
      }
      ++expected_seq_;
      QueueAck(h.seq);
      if (h.opcode == wire::kWriteImm) {
        PushRecvWc(IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, h.payload_len,
                   true, h.imm);
      }
      return;
    case RxKind::kAtomicReq: {
      std::shared_ptr<MrEntry> mr;
      if ((h.addr & 7) != 0 ||
          CheckRemote(h.rkey, h.addr, 8, IBV_ACCESS_REMOTE_ATOMIC, &mr) !=
              IBV_WC_SUCCESS) {
        RespondError(IBV_WC_REM_ACCESS_ERR,
                     absl::StrFormat("atomic denied: rkey 0x%x addr 0x%x",
                                     h.rkey, h.addr));
        return;
      }
      uint64_t compare_add = wire::GetLe64(atomic_buf_);
      uint64_t swap = wire::GetLe64(atomic_buf_ + 8);
      auto* target = reinterpret_cast<uint64_t*>(h.addr);
      uint64_t orig;
      if (h.opcode == wire::kCmpSwap) {
        orig = compare_add;
        __atomic_compare_exchange_n(target, &orig, swap, false,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
      } else {
        orig = __atomic_fetch_add(target, compare_add, __ATOMIC_SEQ_CST);
      }
      ++expected_seq_;
      Ctrl c;
      c.op = wire::kAtomicResp;
      c.seq = h.seq;
      c.value = orig;
      QueueCtrl(std::move(c));
      return;
    }
    case RxKind::kReadResp:
    case RxKind::kAtomicResp: {
      uint64_t i = h.seq;
      uint8_t st = IBV_WC_SUCCESS;
      if (rx_kind_ == RxKind::kAtomicResp) {
        size_t j = (i % sq_cap_) * max_send_sge_;
        const ibv_sge& sge = sq_sge_[j];
        if (sq_mr_[j] && sq_mr_[j]->valid.load()) {
          uint64_t v = wire::GetLe64(atomic_buf_);
          std::memcpy(reinterpret_cast<void*>(sge.addr), &v, 8);
        } else {
          st = IBV_WC_LOC_PROT_ERR;
        }
      } else if (rx_err_) {
        st = IBV_WC_LOC_PROT_ERR;
      }
      CompleteWqe(i, st);
      PublishTail();
      if (st != IBV_WC_SUCCESS) {
        EnterError(Cause::kFault,
                   "local buffer deregistered while a response landed in it");
      }
      engine_->Activate(this);
      return;
    }
  }
}

// ---------------------------------------------------------------------------
// Progress thread: requester completions

uint64_t QpCore::ReadHead() {
  std::lock_guard<std::mutex> lock(mu_);
  head_cache_ = sq_head_;
  return head_cache_;
}

void QpCore::PublishTail() {
  std::lock_guard<std::mutex> lock(mu_);
  sq_tail_ = comp_ptr_;
}

void QpCore::PushSendWc(const SendWqe& w, uint8_t status) {
  ibv_wc wc{};
  wc.wr_id = w.wr_id;
  wc.status = static_cast<ibv_wc_status>(status);
  wc.opcode = WcOpcode(w.opcode);
  wc.byte_len = IsAtomic(w.opcode) ? 8 : static_cast<uint32_t>(w.total);
  wc.qp_num = qp_num();
  wc.src_qp = peer_qpn_;
  if (!cfg_.send_cq->Push(wc)) {
    EnterError(Cause::kFault, "send CQ overrun");
  }
}

void QpCore::CompleteWqe(uint64_t i, uint8_t status) {
  SendWqe& w = Wqe(i);
  if (IsRdAtomic(w) && i < send_ptr_ && rd_atomic_out_ > 0) --rd_atomic_out_;
  ++comp_ptr_;
  if (status != IBV_WC_SUCCESS || w.signaled) {
    // The slots are free before the poster can see the completion.
    PublishTail();
    PushSendWc(w, status);
  }
}

bool QpCore::AckBefore(uint64_t end) {
  if (end <= comp_ptr_) return true;
  if (end > send_ptr_) {
    ProtocolError(absl::StrFormat("ACK for request %u never sent", end - 1));
    return false;
  }
  while (comp_ptr_ < end) {
    if (IsRdAtomic(Wqe(comp_ptr_))) {
      ProtocolError("ACK passes an unanswered READ or atomic");
      return false;
    }
    CompleteWqe(comp_ptr_, IBV_WC_SUCCESS);
  }
  PublishTail();
  engine_->Activate(this);
  return true;
}

// ---------------------------------------------------------------------------
// Progress thread: transmit

void QpCore::ResetTx() {
  for (size_t i = 0; i < nsegs_; ++i) segs_[i].mr.reset();
  nsegs_ = seg_idx_ = seg_off_ = 0;
  arena_used_ = 0;
}

void QpCore::AppendHeader(const wire::Header& h, const char* extra,
                          size_t n) {
  char* p = arena_.get() + arena_used_;
  wire::Encode(h, p);
  if (n > 0) std::memcpy(p + wire::kHeaderSize, extra, n);
  size_t len = wire::kHeaderSize + n;
  arena_used_ += len;
  if (nsegs_ > 0) {
    Seg& last = segs_[nsegs_ - 1];
    if (!last.mr && last.p + last.len == p) {
      last.len += len;
      return;
    }
  }
  Seg& s = segs_[nsegs_++];
  s.p = p;
  s.len = len;
  s.mr.reset();
  s.slot = -1;
}

void QpCore::AppendUser(const char* p, size_t n,
                        const std::shared_ptr<MrEntry>& mr, int64_t slot) {
  Seg& s = segs_[nsegs_++];
  s.p = p;
  s.len = n;
  s.mr = mr;
  s.slot = slot;
}

bool QpCore::Build() {
  ResetTx();
  constexpr size_t kFrameRoom = wire::kHeaderSize + 256 + 16;
  auto room = [&](size_t segs) {
    return arena_used_ + kFrameRoom <= kArenaSize &&
           nsegs_ + segs + 1 <= kMaxSegs;
  };
  if (!hello_sent_) {
    wire::Header h;
    h.opcode = wire::kHello;
    h.addr = wire::kHelloMagic;
    h.dma_len = wire::kVersion;
    h.qpn = qp_num();
    AppendHeader(h, nullptr, 0);
    hello_sent_ = true;
  }
  bool fault = false;
  while (!ctrl_.empty() && room(1)) {
    Ctrl& c = ctrl_.front();
    wire::Header h;
    h.opcode = c.op;
    h.seq = c.seq;
    h.syndrome = c.syndrome;
    if (c.op == wire::kReadResp) {
      if (c.len > 0 && !c.mr->valid.load()) {
        h.opcode = wire::kNak;
        h.syndrome = IBV_WC_REM_ACCESS_ERR;
        AppendHeader(h, nullptr, 0);
        fault = true;
      } else {
        h.payload_len = c.len;
        AppendHeader(h, nullptr, 0);
        if (c.len > 0) {
          AppendUser(reinterpret_cast<const char*>(c.addr), c.len, c.mr, -1);
        }
      }
    } else if (c.op == wire::kAtomicResp) {
      char v[8];
      wire::PutLe64(c.value, v);
      h.payload_len = 8;
      AppendHeader(h, v, 8);
    } else {
      AppendHeader(h, nullptr, 0);
    }
    ctrl_.pop_front();
    if (fault) break;
  }
  if (fault) {
    EnterError(Cause::kFault, "source of an RDMA READ response deregistered");
  }
  if (err_ || rnr_wait_ || fd_ < 0) return nsegs_ > 0;

  uint64_t head = ReadHead();
  while (send_ptr_ < head && room(max_send_sge_)) {
    uint64_t seq = send_ptr_;
    SendWqe& w = Wqe(seq);
    if (IsRdAtomic(w) && rd_atomic_out_ >= kMaxRdAtomic) break;
    size_t base = (seq % sq_cap_) * max_send_sge_;
    if (w.status == IBV_WC_SUCCESS && !w.inlined) {
      for (uint32_t k = 0; k < w.num_sge; ++k) {
        if (sq_mr_[base + k] && !sq_mr_[base + k]->valid.load()) {
          w.status = IBV_WC_LOC_PROT_ERR;
        }
      }
    }
    if (w.status != IBV_WC_SUCCESS) {
      // Completed in order: only once every earlier WR has completed.
      if (seq == comp_ptr_) {
        uint8_t st = w.status;
        CompleteWqe(seq, st);  // never sent: no READ/atomic credit to return
        ++send_ptr_;
        EnterError(Cause::kFault,
                   absl::StrFormat("work request %u failed locally: %s", seq,
                                   WcStatusName(st)));
      }
      break;
    }
    wire::Header h;
    h.seq = seq;
    h.flags = w.solicited ? wire::kFlagSolicited : 0;
    const char* extra = nullptr;
    size_t extra_len = 0;
    char atomic_args[wire::kAtomicReqSize];
    switch (w.opcode) {
      case IBV_WR_SEND:
        h.opcode = wire::kSend;
        break;
      case IBV_WR_SEND_WITH_IMM:
        h.opcode = wire::kSendImm;
        h.imm = w.imm;
        break;
      case IBV_WR_RDMA_WRITE:
        h.opcode = wire::kWrite;
        break;
      case IBV_WR_RDMA_WRITE_WITH_IMM:
        h.opcode = wire::kWriteImm;
        h.imm = w.imm;
        break;
      case IBV_WR_RDMA_READ:
        h.opcode = wire::kReadReq;
        h.dma_len = static_cast<uint32_t>(w.total);
        break;
      case IBV_WR_ATOMIC_CMP_AND_SWP:
      case IBV_WR_ATOMIC_FETCH_AND_ADD:
        h.opcode = w.opcode == IBV_WR_ATOMIC_CMP_AND_SWP ? wire::kCmpSwap
                                                          : wire::kFetchAdd;
        wire::PutLe64(w.compare_add, atomic_args);
        wire::PutLe64(w.swap, atomic_args + 8);
        extra = atomic_args;
        extra_len = sizeof(atomic_args);
        h.payload_len = wire::kAtomicReqSize;
        break;
    }
    if (w.opcode != IBV_WR_SEND && w.opcode != IBV_WR_SEND_WITH_IMM) {
      h.addr = w.remote_addr;
      h.rkey = w.rkey;
    }
    bool carries_data = h.opcode == wire::kSend || h.opcode == wire::kSendImm ||
                        h.opcode == wire::kWrite || h.opcode == wire::kWriteImm;
    if (carries_data) {
      h.payload_len = static_cast<uint32_t>(w.total);
      if (w.inlined) {
        extra = sq_inline_.data() + (seq % sq_cap_) * max_inline_;
        extra_len = w.total;
      }
    }
    AppendHeader(h, extra, extra_len);
    if (carries_data && !w.inlined) {
      for (uint32_t k = 0; k < w.num_sge; ++k) {
        const ibv_sge& sge = sq_sge_[base + k];
        if (sge.length == 0) continue;
        AppendUser(reinterpret_cast<const char*>(sge.addr), sge.length,
                   sq_mr_[base + k], static_cast<int64_t>(seq));
      }
    }
    if (IsRdAtomic(w)) ++rd_atomic_out_;
    // The first outstanding request starts the transport timer.
    if (comp_ptr_ == send_ptr_) progress_at_ = std::chrono::steady_clock::now();
    ++send_ptr_;
    ArmAckTimer();
  }
  return nsegs_ > 0;
}

bool QpCore::SendPending(size_t* budget) {
  iovec iov[kMaxSegs];
  int n = 0;
  size_t want = 0;
  for (size_t i = seg_idx_; i < nsegs_ && want < *budget; ++i) {
    const Seg& s = segs_[i];
    if (s.mr && !s.mr->valid.load()) {
      // A source region vanished mid-frame: the stream cannot be completed.
      int64_t slot = s.slot;
      ResetTx();
      if (slot >= 0 && static_cast<uint64_t>(slot) >= comp_ptr_) {
        while (comp_ptr_ < static_cast<uint64_t>(slot)) {
          CompleteWqe(comp_ptr_, IBV_WC_WR_FLUSH_ERR);
        }
        CompleteWqe(comp_ptr_, IBV_WC_LOC_PROT_ERR);
        PublishTail();
      }
      if (!err_) {
        EnterError(Cause::kFault,
                   "a registered source buffer was deregistered while being "
                   "sent");
      }
      CloseNow();
      return false;
    }
    size_t off = i == seg_idx_ ? seg_off_ : 0;
    iov[n].iov_base = const_cast<char*>(s.p + off);
    iov[n].iov_len = std::min(s.len - off, *budget - want);
    want += iov[n].iov_len;
    ++n;
  }
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n;
  ssize_t sent = sendmsg(fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (sent < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      tx_blocked_ = true;
      engine_->WatchOut(this);
      return false;
    }
    if (errno == EINTR) {
      engine_->Activate(this);
      return false;
    }
    if (err_) {
      ResetTx();
      CloseNow();
    } else {
      ConnectionLost(absl::StrFormat("send failed: %s", strerror(errno)));
    }
    return false;
  }
  size_t left = static_cast<size_t>(sent);
  if (left > 0) NoteProgress();
  *budget -= left;
  while (left > 0 && seg_idx_ < nsegs_) {
    size_t in_seg = segs_[seg_idx_].len - seg_off_;
    if (left >= in_seg) {
      left -= in_seg;
      segs_[seg_idx_].mr.reset();
      ++seg_idx_;
      seg_off_ = 0;
    } else {
      seg_off_ += left;
      left = 0;
    }
  }
  if (seg_idx_ == nsegs_) {
    ResetTx();
    return true;
  }
  if (static_cast<size_t>(sent) == want) {
    // This turn's budget is spent, the socket is not full: let the rest of
    // the loop (the peer's receive, on loopback) run first.
    engine_->Activate(this);
    return false;
  }
  tx_blocked_ = true;
  engine_->WatchOut(this);
  return false;
}

void QpCore::DoTx() {
  if (fd_ < 0 || closed_) {
    if (err_) FlushSq();
    return;
  }
  if (tx_blocked_) return;
  size_t budget = kTxBudget;
  for (int round = 0; round < kTxRounds && budget > 0; ++round) {
    if (seg_idx_ < nsegs_ && !SendPending(&budget)) return;
    if (err_) {
      // Nothing of ours is on the way any more: flush the send queue.
      FlushSq();
      if (ctrl_.empty()) {
        if (!fin_sent_ && fd_ >= 0) {
          shutdown(fd_, SHUT_WR);
          fin_sent_ = true;
        }
        return;
      }
    }
    if (fd_ < 0 || !Build()) return;
  }
  engine_->Activate(this);
}

// ---------------------------------------------------------------------------
// Progress thread: errors

void QpCore::EnterError(Cause cause, const std::string& why) {
  if (err_) return;
  err_ = true;
  state_.store(IBV_QPS_ERR);
  if (cause == Cause::kFault && cfg_.async) {
    cfg_.async->Push(AsyncEvent{
        IBV_EVENT_QP_FATAL, qp_num(),
        absl::StrFormat("soft: qp %u (peer qp %u) error: %s", qp_num(),
                        peer_qpn_, why)});
  }
  in_payload_ = false;
  rx_mr_.reset();
  rnr_wait_ = false;
  FlushRq();
  if (fd_ < 0) {
    closed_ = true;
    FlushSq();
    return;
  }
  Ctrl c;
  c.op = wire::kDisconnect;
  ctrl_.push_back(std::move(c));
  close_deadline_ = std::chrono::steady_clock::now() + kCloseTimeout;
  engine_->AddTimer(this, close_deadline_);
  engine_->Activate(this);
}

void QpCore::FlushRq() {
  if (have_cur_recv_) {
    PushRecvWc(IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, false, 0);
  }
  if (!rq_) return;
  std::vector<uint64_t> ids;
  rq_->TakeAllIds(&ids);
  for (uint64_t id : ids) {
    ibv_wc wc{};
    wc.wr_id = id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = qp_num();
    wc.src_qp = peer_qpn_;
    cfg_.recv_cq->Push(wc);
  }
}

void QpCore::FlushSq() {
  uint64_t head = ReadHead();
  if (comp_ptr_ == head) return;
  while (comp_ptr_ < head) CompleteWqe(comp_ptr_, IBV_WC_WR_FLUSH_ERR);
  send_ptr_ = comp_ptr_;
  rd_atomic_out_ = 0;
  PublishTail();
}

void QpCore::CloseNow() {
  if (fd_ >= 0) {
    engine_->Unwatch(this);
    close(fd_);
    fd_ = -1;
  }
  closed_ = true;
  rx_ready_ = false;
  tx_blocked_ = false;
  ResetTx();
  ctrl_.clear();
  if (err_) FlushSq();
}

void QpCore::ConnectionLost(const std::string& why) {
  EnterError(Cause::kFault, why);
  CloseNow();
}

}  // namespace coverbs::transport::soft
