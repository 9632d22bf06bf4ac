// The operation builders of QueuePair (Send, Recv, Write, WriteWithImm,
// Read, CompareSwap, FetchAdd, PostBatch) and SendBatch's Add*: each turns
// its arguments into an internal_qp::OpSpec -- the work request to post and
// the checks that fail it before posting (SGE limits, inline size, what the
// device supports). internal_qp::OpBase (queue_pair_op.cc) posts it.
#include <arpa/inet.h>

#include "absl/strings/str_format.h"
#include "transport/queue_pair.h"

namespace coverbs::transport {
namespace {

// One WR of a SendBatch; PostNow fills in wr_id, the SGE, the flags and the
// chain. `remote` is unused (zero) for a SEND.
ibv_send_wr BatchWr(ibv_wr_opcode opcode, RemoteRegion remote,
                    std::optional<uint32_t> imm) {
  ibv_send_wr wr{};
  wr.opcode = opcode;
  if (imm) wr.imm_data = htonl(*imm);
  wr.wr.rdma.remote_addr = remote.addr;
  wr.wr.rdma.rkey = remote.rkey;
  wr.num_sge = 1;
  return wr;
}

// What every builder fills in first: the operation's name and opcode, its
// local buffers and (one-sided operations) the remote region.
internal_qp::OpSpec MakeSpec(const char* name, ibv_wr_opcode opcode,
                             std::span<const LocalBuffer> bufs,
                             RemoteRegion remote = {}) {
  internal_qp::OpSpec spec;
  spec.name = name;
  spec.opcode = opcode;
  spec.bufs = bufs;
  spec.remote = remote;
  return spec;
}

// CompareSwap and FetchAdd: the original remote value lands in `result`,
// which must be 8 bytes, on a device with atomics. `result` is referenced
// by the spec: it must outlive the Op built from it.
internal_qp::OpSpec AtomicSpec(const DeviceCaps& caps, uint32_t qpn,
                               const char* name, ibv_wr_opcode opcode,
                               const LocalBuffer& result, RemoteRegion remote,
                               uint64_t compare_add, uint64_t swap) {
  internal_qp::OpSpec spec =
      MakeSpec(name, opcode, std::span<const LocalBuffer>(&result, 1), remote);
  spec.compare_add = compare_add;
  spec.swap = swap;
  if (!caps.atomics) {
    spec.error = absl::UnimplementedError(
        absl::StrFormat("%s on QP 0x%x: %s does not support atomic operations",
                        name, qpn, caps.device_name));
  } else if (result.length != 8) {
    spec.error = absl::InvalidArgumentError(absl::StrFormat(
        "%s on QP 0x%x: the result buffer must be 8 bytes, not %u", name, qpn,
        result.length));
  }
  return spec;
}

}  // namespace

// ---------------------------------------------------------------------------
// SendBatch

void SendBatch::AddSend(LocalBuffer buf, std::optional<uint32_t> imm) {
  wrs_.push_back(BatchWr(imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND, {}, imm));
  sges_.push_back(buf.sge());
}

void SendBatch::AddWrite(LocalBuffer buf, RemoteRegion remote,
                         std::optional<uint32_t> imm) {
  wrs_.push_back(BatchWr(imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE,
                         remote, imm));
  sges_.push_back(buf.sge());
}

void SendBatch::AddRead(LocalBuffer buf, RemoteRegion remote) {
  wrs_.push_back(BatchWr(IBV_WR_RDMA_READ, remote, std::nullopt));
  sges_.push_back(buf.sge());
}

uint32_t SendBatch::AddBind(MemoryWindow& mw, const MemoryRegion& mr,
                            std::span<std::byte> range, int access) {
  ibv_send_wr wr{};
  uint32_t rkey = mw.provider()->PrepareBind(
      wr, *mr.provider(), reinterpret_cast<uint64_t>(range.data()),
      range.size(), access);
  wrs_.push_back(wr);
  sges_.push_back({});  // keeps sges_[i] beside wrs_[i]; a bind has none
  return rkey;
}

void SendBatch::AddLocalInvalidate(uint32_t rkey) {
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_LOCAL_INV;
  wr.invalidate_rkey = rkey;
  wrs_.push_back(wr);
  sges_.push_back({});  // keeps sges_[i] beside wrs_[i]; it has none
}

void SendBatch::AddSendWithInvalidate(LocalBuffer buf, uint32_t rkey) {
  ibv_send_wr wr = BatchWr(IBV_WR_SEND_WITH_INV, {}, std::nullopt);
  wr.invalidate_rkey = rkey;
  wrs_.push_back(wr);
  sges_.push_back(buf.sge());
}

// ---------------------------------------------------------------------------
// QueuePair: operation builders

void QueuePair::LimitSges(internal_qp::OpSpec& spec, const char* limit_name,
                          uint32_t limit) const {
  if (spec.bufs.size() > limit) {
    spec.error = absl::InvalidArgumentError(
        absl::StrFormat("%s on QP 0x%x: %u SGEs exceed %s %u", spec.name,
                        qp_num_, spec.bufs.size(), limit_name, limit));
  }
}

QueuePair::Op QueuePair::Send(std::span<const LocalBuffer> bufs,
                              SendOptions o) {
  // The usual message (no immediate, a few SGEs, inline only if it fits):
  // without the OpSpec and the checks below, which it passes.
  if (!o.imm && !bufs.empty() && bufs.size() <= internal_qp::kInlineSges &&
      bufs.size() <= options_.max_send_sge) {
    uint64_t total = 0;
    if (o.inline_data) {
      for (const LocalBuffer& b : bufs) total += b.length;
    }
    if (total <= max_inline_) return Op(this, bufs, o);
  }
  internal_qp::OpSpec spec =
      MakeSpec(o.imm ? "SEND_WITH_IMM" : "SEND",
               o.imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND, bufs);
  spec.imm = o.imm;
  spec.send_flags = (o.inline_data ? IBV_SEND_INLINE : 0) |
                    (o.fence ? IBV_SEND_FENCE : 0);
  spec.cancellable = !o.ignore_stop;
  if (o.imm && !caps().send_with_imm) {
    spec.error = absl::UnimplementedError(absl::StrFormat(
        "SEND_WITH_IMM on QP 0x%x: %s (%s) has no immediate data", qp_num_,
        caps().device_name, TransportKindName(caps().transport)));
  }
  if (o.inline_data) {
    uint64_t total = 0;
    for (const LocalBuffer& b : bufs) total += b.length;
    if (total > max_inline_) {
      spec.error = absl::InvalidArgumentError(absl::StrFormat(
          "inline SEND on QP 0x%x: %u bytes exceed the QP's max_inline_data "
          "of %u",
          qp_num_, total, max_inline_));
    }
  }
  if (bufs.size() > options_.max_send_sge) {
    LimitSges(spec, "max_send_sge", options_.max_send_sge);
  }
  return Op(this, spec);
}

QueuePair::Op QueuePair::Recv(std::span<const LocalBuffer> bufs) {
  internal_qp::OpSpec spec;
  spec.name = "RECV";
  spec.recv = true;
  spec.bufs = bufs;
  LimitSges(spec, "max_recv_sge", options_.max_recv_sge);
  return Op(this, spec);
}

QueuePair::Op QueuePair::Write(std::span<const LocalBuffer> bufs,
                               RemoteRegion remote) {
  internal_qp::OpSpec spec =
      MakeSpec("RDMA_WRITE", IBV_WR_RDMA_WRITE, bufs, remote);
  LimitSges(spec, "max_send_sge", options_.max_send_sge);
  return Op(this, spec);
}

QueuePair::Op QueuePair::WriteWithImm(LocalBuffer buf, RemoteRegion remote,
                                      uint32_t imm) {
  internal_qp::OpSpec spec =
      MakeSpec("RDMA_WRITE_WITH_IMM", IBV_WR_RDMA_WRITE_WITH_IMM,
               std::span<const LocalBuffer>(&buf, 1), remote);
  spec.imm = imm;
  if (!caps().write_with_imm) {
    spec.error = absl::UnimplementedError(absl::StrFormat(
        "RDMA_WRITE_WITH_IMM on QP 0x%x: %s (%s) does not support it",
        qp_num_, caps().device_name, TransportKindName(caps().transport)));
  }
  return Op(this, spec);
}

QueuePair::Op QueuePair::Read(std::span<const LocalBuffer> bufs,
                              RemoteRegion remote) {
  internal_qp::OpSpec spec =
      MakeSpec("RDMA_READ", IBV_WR_RDMA_READ, bufs, remote);
  uint32_t max_rd = caps().max_sge_rd ? caps().max_sge_rd : caps().max_sge;
  if (bufs.size() > max_rd) {
    spec.error = absl::InvalidArgumentError(absl::StrFormat(
        "RDMA_READ on QP 0x%x: %u SGEs exceed the device's max_sge_rd %u "
        "(%s)",
        qp_num_, bufs.size(), max_rd, caps().device_name));
  }
  LimitSges(spec, "max_send_sge", options_.max_send_sge);
  return Op(this, spec);
}

QueuePair::Op QueuePair::CompareSwap(LocalBuffer result, RemoteRegion remote,
                                     uint64_t compare, uint64_t swap) {
  return Op(this, AtomicSpec(caps(), qp_num_, "ATOMIC_CMP_AND_SWP",
                             IBV_WR_ATOMIC_CMP_AND_SWP, result, remote, compare,
                             swap));
}

QueuePair::Op QueuePair::FetchAdd(LocalBuffer result, RemoteRegion remote,
                                  uint64_t add) {
  return Op(this,
            AtomicSpec(caps(), qp_num_, "ATOMIC_FETCH_AND_ADD",
                       IBV_WR_ATOMIC_FETCH_AND_ADD, result, remote, add, 0));
}

QueuePair::Op QueuePair::PostBatch(SendBatch& batch, bool ignore_stop) {
  internal_qp::OpSpec spec;
  spec.name = "batch";
  spec.batch = &batch;
  spec.cancellable = !ignore_stop;
  if (batch.size() == 0) {
    spec.error = absl::InvalidArgumentError("PostBatch: the batch is empty");
  }
  for (const ibv_send_wr& wr : batch.wrs_) {
    if (((wr.opcode == IBV_WR_BIND_MW || wr.opcode == IBV_WR_LOCAL_INV) &&
         !caps().memory_windows) ||
        (wr.opcode == IBV_WR_SEND_WITH_INV && !caps().send_with_invalidate)) {
      spec.error = absl::UnimplementedError(absl::StrFormat(
          "batch on QP 0x%x: %s does not support %s", qp_num_,
          caps().device_name, WrOpcodeName(wr.opcode)));
    }
    bool imm = wr.opcode == IBV_WR_SEND_WITH_IMM ||
               wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    if (imm && ((wr.opcode == IBV_WR_SEND_WITH_IMM && !caps().send_with_imm) ||
                (wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM &&
                 !caps().write_with_imm))) {
      spec.error = absl::UnimplementedError(absl::StrFormat(
          "batch on QP 0x%x: %s does not support %s", qp_num_,
          caps().device_name, WrOpcodeName(wr.opcode)));
    }
  }
  return Op(this, spec);
}

}  // namespace coverbs::transport
