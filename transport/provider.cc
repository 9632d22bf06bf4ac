#include "transport/provider.h"

namespace coverbs::transport {

const char* TransportKindName(TransportKind k) {
  switch (k) {
    case TransportKind::kInfiniBand:
      return "InfiniBand";
    case TransportKind::kRoCE:
      return "RoCE";
    case TransportKind::kIWarp:
      return "iWARP";
    case TransportKind::kSoft:
      return "soft";
    case TransportKind::kLoop:
      return "loop";
  }
  return "?";
}


const char* WrOpcodeName(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_SEND:
      return "SEND";
    case IBV_WR_SEND_WITH_IMM:
      return "SEND_WITH_IMM";
    case IBV_WR_SEND_WITH_INV:
      return "SEND_WITH_INV";
    case IBV_WR_RDMA_WRITE:
      return "RDMA_WRITE";
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return "RDMA_WRITE_WITH_IMM";
    case IBV_WR_RDMA_READ:
      return "RDMA_READ";
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return "ATOMIC_CMP_AND_SWP";
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return "ATOMIC_FETCH_AND_ADD";
    case IBV_WR_LOCAL_INV:
      return "LOCAL_INV";
    case IBV_WR_BIND_MW:
      return "BIND_MW";
    case IBV_WR_TSO:
      return "TSO";
    default:
      return "UNKNOWN_OPCODE";
  }
}

ibv_wc_opcode WcOpcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      return IBV_WC_FETCH_ADD;
    case IBV_WR_LOCAL_INV:
      return IBV_WC_LOCAL_INV;
    case IBV_WR_BIND_MW:
      return IBV_WC_BIND_MW;
    default:
      return IBV_WC_SEND;
  }
}

}  // namespace coverbs::transport
