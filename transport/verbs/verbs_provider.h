// The verbs provider: transport/provider.h implemented directly over
// libibverbs + librdmacm (rdma-core). Real NICs, Soft-RoCE (rxe), SoftiWARP
// (siw). See transport/verbs/README.md for the device, port and GID selection
// rules and the iWARP notes.
//
// Everything here is a thin pass-through: PostSend/PostRecv/Poll call
// ibv_post_send/ibv_post_recv/ibv_poll_cq and add nothing on the data path
// except turning a non-zero return into an absl::Status that names the QP, the
// opcode and the error.
//
// Device contexts come from librdmacm (rdma_get_devices), never from a
// separate ibv_open_device, so PDs, CQs, MRs and SRQs of this provider can be
// used with QPs created on rdma_cm ids (which always use librdmacm's contexts).
//
// Object lifetimes: every object keeps what it depends on alive (an MR its PD,
// a QP its PD/CQs/SRQ and its rdma_cm ids, everything the device list), so
// destroying the C++ wrappers in any order never fails with EBUSY and never
// leaks. The usual rules still hold for the application: drain a QP before
// destroying it, and do not destroy a CQ that a live QP still completes into
// while a reactor watches its fd.
#ifndef COVERBS_TRANSPORT_VERBS_VERBS_PROVIDER_H_
#define COVERBS_TRANSPORT_VERBS_VERBS_PROVIDER_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/provider.h"

struct rdma_cm_id;

namespace coverbs::transport {

// True when libibverbs lists at least one RDMA device (ibv_get_device_list),
// whether or not it is usable. Cheap; opens nothing.
bool VerbsDevicesPresent();

// Opens the verbs provider on one device.
//
// Device: options.device, else $COVERBS_DEVICE, else the first device (in
// librdmacm's order) with an ACTIVE port. Port: options.port, else the first
// ACTIVE port. RoCE GID: options.gid_index (>= 0), else $COVERBS_GID_INDEX,
// else the first RoCEv2 IPv4-mapped GID (then any RoCEv2, then any IPv4-mapped,
// then the first valid one).
//
// Errors (never a crash, never a hang):
//  - NotFound: no RDMA device at all (the usual case on hosts without RDMA),
//    or the named device does not exist (the message lists those that do);
//  - Unavailable: devices exist but librdmacm cannot open them (rdma_ucm not
//    loaded), or no port is ACTIVE (the message lists the port states);
//  - InvalidArgument: a bad port, GID index or $COVERBS_GID_INDEX.
// options.kind is ignored (selection between providers happens above).
absl::StatusOr<std::unique_ptr<Provider>> OpenVerbsProvider(
    const ProviderOptions& options);

// ---------------------------------------------------------------------------
// Verbs-only extensions, for the cm layer (which drives rdma_cm itself) and for
// tests. They fail with InvalidArgument when handed objects of another
// provider.

// The librdmacm device context the provider uses (the one rdma_cm ids bound to
// this device carry in id->verbs), or nullptr if `provider` is not a verbs
// provider.
ibv_context* VerbsContext(const Provider& provider);

// The underlying ibv_pd / ibv_cq / ibv_qp, or nullptr for objects of another
// provider.
ibv_pd* VerbsPdHandle(ProviderPd* pd);
ibv_cq* VerbsCqHandle(ProviderCq* cq);
ibv_qp* VerbsQpHandle(ProviderQp* qp);

// Creates an RC QP on `id` with rdma_create_qp (the QP starts in INIT;
// rdma_accept / rdma_connect take it to RTS). `pd`, `init.send_cq`,
// `init.recv_cq` (and `init.srq`) must be verbs objects on id->verbs. The
// returned QP's destructor calls rdma_destroy_qp(id): `id` must outlive it;
// `keepalive` (optional) is held until then, e.g. the object owning `id`.
// init.rnr_retry / retry_cnt / timeout / min_rnr_timer are NOT applied here.
// On InfiniBand/RoCE (IB CM), as seen on rxe: timeout is per id via
// rdma_set_option(RDMA_OPTION_ID_ACK_TIMEOUT) before connect/accept;
// rdma_conn_param.retry_count of the *connect* goes to both QPs;
// rnr_retry_count of the connect lands in the passive QP and that of the
// accept in the active QP (each side's rnr_retry travels in the peer's
// parameters); min_rnr_timer needs FinishEstablishedQp.
absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQpOnCmId(
    rdma_cm_id* id, ProviderPd* pd, const QpInit& init,
    std::shared_ptr<void> keepalive = nullptr);

// To call once RDMA_CM_EVENT_ESTABLISHED arrived for the QP's id:
//  - IB CM (InfiniBand, RoCE) connects QPs with min_rnr_timer 0 (655 ms):
//    this sets init.min_rnr_timer with an RTS->RTS modify (not on iWARP);
//  - it records that the QP is connected, for devices whose ibv_query_qp does
//    not report the state (siw before Linux 6.x always says RESET), so that
//    ProviderQp::state() can still answer.
absl::Status FinishEstablishedQp(ProviderQp* qp, const QpInit& init);

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_VERBS_VERBS_PROVIDER_H_
