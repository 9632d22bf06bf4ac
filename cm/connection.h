// Connection: an established RC connection with messaging (SEND/RECV with
// credits, rendezvous for large messages) and one-sided access.
//
//   absl::Status s = co_await conn->Send(bytes);
//   absl::StatusOr<cm::Message> m = co_await conn->Recv();
//   co_await conn->Read(local, remote);   // RDMA READ of an exposed region
//
// Contract (see cm/README.md for the wire protocol):
//  - Messages keep their boundaries and arrive in Send order, small and large
//    alike. Several coroutines may Send (and Recv) concurrently; each Send's
//    message is ordered by the time the Send started.
//  - Small messages (payload <= rendezvous_threshold) are SENT into receive
//    buffers the peer pre-posted; the sender spends one credit per SEND and
//    never sends without one (a correct peer never causes RNR). Credits
//    return on every message header and by an explicit credit message when
//    there is no reverse traffic.
//  - Large messages use rendezvous: the sender announces the size, the
//    receiver provides a registered buffer and answers with (addr, rkey),
//    the sender RDMA WRITEs and then signals completion (WRITE_WITH_IMM
//    where both sides support it, else a small SEND). The receiver's rkey is
//    valid only for that transfer. Messages above max_message_size (ours or
//    the peer's) fail with InvalidArgument before anything is sent.
//  - Send completes when the caller's bytes are free and the message is on
//    its way: a small message whose frame fits the device's inline limit
//    (ConnectionOptions::qp.max_inline_data, 128 by default: 112 bytes of
//    payload) is copied into the work request and completes at its post,
//    while fewer than 16 such are unacknowledged; any other once the peer
//    placed it. A message that fails after its post takes the connection
//    down with the reason (status(), and every later call). Close()
//    delivers every message sent before it; destroying a Connection
//    without Close may drop ones not yet acknowledged.
//  - When the connection goes down (Close, peer disconnect, peer death, QP
//    error) every waiting Send/Recv/one-sided operation resumes with an
//    error (Unavailable; the message says whether the peer closed or the
//    connection was lost and why), and later calls fail at once.
//  - iWARP (active side must send first) is handled inside: the passive
//    side's first send waits for the active side's hello.
//  - Single reactor: a Connection is used on its Worker's reactor thread.
#ifndef COVERBS_CM_CONNECTION_H_
#define COVERBS_CM_CONNECTION_H_

#include <array>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/handshake.h"
#include "cm/worker.h"
#include "core/sync.h"
#include "core/task.h"
#include "transport/device.h"
#include "transport/queue_pair.h"

namespace coverbs::cm {

struct ConnectionOptions {
  // Receives posted for this connection = credits the peer gets. With
  // use_srq: the most the peer may hold (its window grows toward this).
  uint32_t recv_credits = 64;
  // Payloads up to this size go eagerly (SEND/RECV); above, by RDMA WRITE.
  // Also the size of this side's receive buffers (16 bytes more). A peer
  // whose receive buffers are smaller gets only what fits them eagerly.
  size_t rendezvous_threshold = 8 * 1024;
  // Medium messages (above rendezvous_threshold, up to landing_buffer_size)
  // skip the rendezvous round trip once the peer has sent one: the receiver
  // then keeps landing_buffers buffers of landing_buffer_size registered and
  // granted to the sender ahead of time (in credit messages), each for one
  // message -- its registration, and so its rkey, ends when that message
  // arrives, and a fresh one is granted. The sender WRITEs straight in and
  // posts a header behind it. With no grant free (yet, or all in flight) a
  // medium message takes the rendezvous. Costs landing_buffers x
  // landing_buffer_size of registered memory (4 MiB by default) per
  // connection, and only once its peer sends medium messages; 0 buffers:
  // always the rendezvous. Match landing_buffers to the medium messages the
  // peer keeps in flight.
  uint32_t landing_buffers = 32;
  size_t landing_buffer_size = 128 * 1024;
  // On a device with memory windows (rxe, most RDMA NICs; not siw or the
  // soft provider), a grant is a window bound over memory that stays
  // registered, and the peer's header invalidates it (SEND_WITH_INV): a
  // medium message then costs no registration on either side. false: each
  // grant is a registration of its own, as on other devices.
  bool landing_windows = true;
  // Largest message accepted or sent (announced in the handshake).
  uint64_t max_message_size = 64ull << 20;
  // Rendezvous receive budget (cm/README.md, "Memory per connection"): the
  // memory of the peer's large messages this side holds before its
  // application takes them with Recv -- buffers granted and awaiting their
  // DONE, finished ones waiting behind an earlier one, and ones queued for
  // Recv -- each counted as its block (the message's size rounded up to a
  // power of two, at least 4 KiB: what it maps). Messages the application
  // took are its own. A rendezvous request (RTS) that would go beyond it
  // is answered later: its CTS is deferred until enough was received and
  // taken, and the message keeps its place in the arrival order. A
  // conforming sender just waits (it has at most 4 requests waiting for
  // their CTS; its further Sends wait in their turn, as for a credit). A
  // peer with more deferred requests than that breaks the protocol: the
  // connection ends ("protocol violation by the peer: rendezvous budget:
  // ..."). With nothing held ahead of it a request is always granted
  // (messages that arrived after it wait for it and are not weighed), so every
  // message up to max_message_size goes whatever the budget. Default
  // 256 MiB: four messages of the default max_message_size, as many as a
  // sender's 4 requests ask for, so such a sender's pipeline stays full
  // while the application keeps up; fixed rather than a multiple of
  // max_message_size, so that raising the largest message does not raise
  // what every connection may pin. Landing buffers are counted apart
  // (landing_buffers x landing_buffer_size).
  uint64_t rendezvous_budget = 256ull << 20;
  // A peer that got a CTS must finish that transfer (the WRITEs and DONE,
  // or WRITE_WITH_IMM) within this long, or the connection ends
  // ("protocol violation by the peer: peer sent no DONE for rendezvous N
  // within 30s of its CTS"): its buffer would stay pinned, and every
  // message after it undeliverable, for as long as the peer likes. A
  // conforming sender posts the WRITEs and DONE as soon as the CTS
  // arrives, so only the transfer itself (at most rendezvous_budget bytes
  // queued ahead of it) and the transport's retries count. Zero or
  // infinite: no deadline.
  absl::Duration rendezvous_done_timeout = absl::Seconds(30);
  // Exposures this connection holds at once (Expose with
  // ExposeScope::kConnection, until Revoke or the connection's end): at
  // most max_exposures of them and max_exposed_bytes of memory in all.
  // Past either bound Expose fails with ResourceExhausted naming it -- the
  // handler's error, not the connection's -- so a peer that asks for
  // exposure after exposure and never lets one go costs a bounded amount of
  // pinned memory and windows. 0: no bound.
  uint32_t max_exposures = 1024;
  uint64_t max_exposed_bytes = 1ull << 30;
  // Send-queue depth: work requests posted at once (more wait, FIFO).
  // Each connection reserves send_depth + 10 + recv_credits + 6 entries of
  // its Worker's CQ (WorkerOptions::cq_entries). 0: 64, or 16 with use_srq
  // -- every send-queue entry costs memory per connection even when idle
  // (~1.2 KiB on rxe, measured: queue, CQ share and our own state), which a
  // server with thousands of mostly idle connections should not pay 64 times.
  uint32_t send_depth = 0;
  // Receive through the Worker's shared receive queue instead of a
  // per-connection ring (servers with many mostly idle connections; needs
  // WorkerOptions::srq_depth > 0). The connection starts with
  // srq_initial_credits receives promised in the SRQ (plus 6 reserve
  // receives); while the peer keeps running out of credits its window grows
  // toward recv_credits from receives nobody was promised, and it shrinks
  // back once the peer stops running out. Connecting or accepting fails
  // with ResourceExhausted when srq_depth cannot promise the initial grant.
  // srq_initial_credits is at least 2 (a rendezvous needs two credits).
  // Payloads above the Worker's srq_buffer_size - 16 (2 KiB by default)
  // reach such a connection by RDMA WRITE, whatever the peer's
  // rendezvous_threshold.
  bool use_srq = false;
  uint32_t srq_initial_credits = 2;
  // Bound on Close()'s drain and disconnect.
  absl::Duration close_timeout = absl::Seconds(5);
  // Keepalive (zero: off). A connection that received nothing for this long
  // sends a probe -- a credit message, into the peer's reserve receives, so
  // it needs no credit -- which the peer answers at once; after
  // keepalive_probes probes in a row went unanswered the connection fails
  // with DeadlineExceeded. It catches a peer that froze, hung or lost its
  // host on every provider, also where the transport cannot (a stopped
  // process's kernel or NIC still acknowledges RC traffic). Each side
  // decides for itself; a peer answers probes either way.
  absl::Duration keepalive_interval = absl::ZeroDuration();
  int keepalive_probes = 3;
  // QP tuning passed through (depths above are applied on top).
  transport::QpOptions qp;
};

// What the peer announced, plus where it is.
struct PeerInfo {
  std::string address;  // numeric host
  uint16_t port = 0;
  Handshake handshake;
};

// Who may use the token Connection::Expose returns.
enum class ExposeScope {
  kConnection,        // this connection alone (a memory window); default
  kProtectionDomain,  // every connection of the Worker (the region's rkey)
};

namespace internal {
class ConnectionImpl;
class ConnectionSetup;
class ConnectionTestPeer;
class MessageBuffer;  // owner of a received message's memory
struct LandedSend;    // a landed Send's work requests and staging buffer
struct LandedSendDeleter {
  void operator()(LandedSend* l) const;
};
}  // namespace internal

// A received message. Owns its registered receive buffer (or rendezvous
// buffer) until destroyed; then the buffer goes back to be reposted. May
// outlive its Connection. Move-only.
class Message {
 public:
  Message() = default;
  // Inline: a message is moved and its husks destroyed about ten times on
  // its way from the receive completion to an rpc handler (StatusOr,
  // Payload, coroutine results); out of line each was a call.
  Message(Message&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        owner_(std::exchange(o.owner_, nullptr)) {}
  Message& operator=(Message&& o) noexcept {
    if (this != &o) {
      if (owner_ != nullptr) ReleaseOwner();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      owner_ = std::exchange(o.owner_, nullptr);
    }
    return *this;
  }
  ~Message() {
    if (owner_ != nullptr) ReleaseOwner();
  }

  std::span<const std::byte> data() const { return {data_, size_}; }
  std::span<std::byte> mutable_data() { return {data_, size_}; }
  // The bytes as text (what Send(std::string_view) sent).
  std::string_view text() const {
    return {reinterpret_cast<const char*>(data_), size_};
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  friend class internal::ConnectionImpl;
  void ReleaseOwner();  // gives the buffer back (repost or free)
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  internal::MessageBuffer* owner_ = nullptr;
};

// Why a connection ended: the words a down connection's status() starts
// with (CloseCauseName), its verbs status and details following. The same
// scenario always gives the same cause.
enum class CloseCause : uint8_t {
  kNone,               // still up
  kPeerClosed,         // "closed by the peer": its Close(), orderly
  kLocalClose,         // "closed locally": this side's Close() or destructor
  kPeerGone,           // "peer gone": the link ended without the peer
                       // closing (its process died, its host went away)
  kPeerUnreachable,    // "peer unreachable (transport retries exhausted)"
  kKeepalive,          // "keepalive unanswered" (ConnectionOptions)
  kProtectionError,    // "protection error on this connection": a bad key,
                       // range or access right, either side
  kProtocolViolation,  // "protocol violation by the peer"
  kTransportError,     // "transport error": any other failed work request
  kLocalError,         // "local error": a resource this side could not get
};
inline constexpr size_t kCloseCauses = 10;
const char* CloseCauseName(CloseCause c);

class Connection {
 public:
  ~Connection();  // closes abruptly if Close() was not awaited (bounded)
  Connection(const Connection&) = delete;

  // --- Messaging.
  // co_await conn.Send(bytes): OK once the message is on its way and the
  // bytes are free -- at once for a small message that goes inline (see
  // the contract above), else once the peer placed it. Copies into the
  // work request (small, inline), a pooled registered buffer (small) or
  // sends from the caller's memory (large; registered through the
  // Worker's cache). The bytes must stay valid until the co_await
  // completes.
  // Cancelling (the awaiting coroutine's stop token) a Send still waiting
  // for its turn, a credit or a buffer ends it with Cancelled, nothing
  // sent. Once a message is posted (eager, landed, or a rendezvous's
  // request) it goes anyway -- a NIC cannot take a work request back, and
  // failing the QP to withdraw it would end the connection for every
  // caller -- so the Send waits for its completion and reports it. A
  // rendezvous cancelled while it waits for the receiver's answer tells
  // the receiver to drop it (cm/README.md); once answered, it runs to its
  // end.
  // Each Send returns a SendAwaiter (below), not a Task: a small message
  // whose send turn, credit and buffer are free at once is posted from the
  // awaiting coroutine's frame, without a coroutine frame of its own (its
  // set-up and teardown were about half of what sending a small message
  // cost, bench/RESULTS.md). Nothing happens until it is co_awaited.
  class SendAwaiter;
  SendAwaiter Send(std::span<const std::byte> payload);
  // The same for text. (Pass a named string, not a temporary, inside a
  // co_await expression: gcc 12 destroys such temporaries twice.)
  SendAwaiter Send(std::string_view text);
  // Gather: the message is the concatenation of `parts` (which, like the
  // bytes, must stay valid until the co_await completes).
  SendAwaiter SendV(std::span<const std::span<const std::byte>> parts);
  // A small message posted inline now, when it goes at once without
  // waiting for anything (the send turn and a credit free, the frame
  // within the QP's inline limit): the outcome co_await SendV(parts) would
  // give; nullopt when it cannot (nothing was taken: send it with SendV).
  // For the rpc layer's requests and responses: no awaiter to build.
  std::optional<absl::Status> TrySendNow(
      std::span<const std::span<const std::byte>> parts);
  // SendV under its earlier name (when SendV still had a frame).
  SendAwaiter SendVDirect(std::span<const std::span<const std::byte>> parts);
  // Zero-copy from memory the caller registered (LOCAL_WRITE not needed).
  // A small payload that fits the QP's inline data is copied at post time.
  SendAwaiter Send(transport::LocalBuffer registered);
  // The next message in arrival order: co_await conn.Recv(). Several
  // coroutines may wait; they are served in the order they began to wait.
  // Cancelling the awaiting coroutine's stop token while it waits ends it
  // with Cancelled (no message taken). No coroutine frame of its own: a
  // message already deliverable completes the co_await without suspending,
  // else the awaiting coroutine waits itself (RecvAwaiter below).
  class RecvAwaiter;
  RecvAwaiter Recv();
  // The message Recv would return at once, taken without suspending; none
  // when Recv would wait (nothing deliverable yet, another Recv waits
  // ahead) or report the connection's end (Recv then says why). For
  // receive loops that must not suspend (poll several connections, batch
  // what is there).
  std::optional<Message> TryRecv();

  // --- One-sided.
  // The token for `mr` (or a slice) with remote `access`
  // (IBV_ACCESS_REMOTE_READ / _WRITE / _ATOMIC), for this connection only
  // (ExposeScope::kConnection, the default): the token's rkey is a type-2
  // memory window bound to this connection's QP over a registration of its
  // own, so the peer of any other connection -- one that got or guessed the
  // token -- fails with a remote access error on its own connection, and
  // the rkey of each exposure is fresh and unpredictable. Revoke(token),
  // Close() or destroying the connection ends it; later accesses fail with
  // a remote access error. Deregistering `mr` does not (the window has a
  // registration of its own): the memory must stay valid until the
  // exposure ended. `mr` itself needs no remote access flags (and
  // should have none when only exposures may reach it: a region registered
  // with remote access has its own PD-wide rkey, which every connection of
  // the Worker could use if a peer learnt it); REMOTE_WRITE and
  // REMOTE_ATOMIC need it registered with LOCAL_WRITE.
  // Errors: InvalidArgument (bad access, offset, region); FailedPrecondition
  // on a device without memory windows (siw: it cannot limit a key to one
  // connection; the message names the device -- there, opt in to
  // ExposeScope::kProtectionDomain explicitly); ResourceExhausted while the
  // send queue has no free slot for the bind (retry after a send
  // completes); the connection's status once it is down.
  //
  // ExposeScope::kProtectionDomain hands out `mr`'s own rkey instead: valid
  // from every connection of the Worker (its PD) until `mr` is
  // deregistered, for data that any peer may reach; `mr` must have been
  // registered with the asked remote access. Revoke does not apply.
  absl::StatusOr<transport::RemoteRegion> Expose(
      const transport::MemoryRegion& mr, int access, size_t offset = 0,
      size_t length = transport::MemoryRegion::npos,
      ExposeScope scope = ExposeScope::kConnection);
  // All of `mr` with the remote access it was registered with
  // (InvalidArgument if it has none), for this connection only.
  absl::StatusOr<transport::RemoteRegion> Expose(
      const transport::MemoryRegion& mr);
  // With typed flags (transport::Access::kRemoteRead, ...).
  absl::StatusOr<transport::RemoteRegion> Expose(
      const transport::MemoryRegion& mr, transport::Access access,
      size_t offset = 0, size_t length = transport::MemoryRegion::npos,
      ExposeScope scope = ExposeScope::kConnection) {
    return Expose(mr, static_cast<int>(access), offset, length, scope);
  }
  // Ends an exposure of this connection (its window): once this returns,
  // no access with the token is in progress and every later one fails with
  // a remote access error. NotFound for a token this connection did not
  // expose (or already revoked).
  absl::Status Revoke(const transport::RemoteRegion& token);
  // Expose (this connection only) that also keeps `owner` -- what owns
  // the memory and `mr`, e.g. a shared_ptr to a struct holding both --
  // alive until the exposure ends (Revoke, Close, the connection's end),
  // released only after the window is gone: memory handed to one peer
  // that lives exactly as long as that peer may reach it.
  absl::StatusOr<transport::RemoteRegion> ExposeOwned(
      std::shared_ptr<void> owner, const transport::MemoryRegion& mr,
      transport::Access access);
  // RDMA READ / WRITE between `local` and a peer's token. These and the
  // atomics below run to their completion whatever the awaiting
  // coroutine's stop token says: a NIC cannot take a posted work request
  // back, and withdrawing it would fail the QP and end the connection for
  // every caller (the transport's retry timer bounds the wait).
  Task<absl::Status> Read(transport::LocalBuffer local,
                          transport::RemoteRegion remote);
  Task<absl::Status> Write(transport::LocalBuffer local,
                           transport::RemoteRegion remote);
  // The same on plain memory, registered through the Worker's registration
  // cache (a hit costs nothing; memory that is freed or unmapped must be
  // dropped from the cache first: worker().registrations().Invalidate).
  // The memory must stay valid until the Task completes.
  Task<absl::Status> Read(std::span<std::byte> local,
                          transport::RemoteRegion remote);
  Task<absl::Status> Write(std::span<const std::byte> local,
                           transport::RemoteRegion remote);
  // 8-byte atomics (FailedPrecondition when the device has none); yield the
  // remote value before the operation.
  Task<absl::StatusOr<uint64_t>> FetchAdd(transport::RemoteRegion remote,
                                          uint64_t add);
  Task<absl::StatusOr<uint64_t>> CompareSwap(transport::RemoteRegion remote,
                                             uint64_t compare, uint64_t swap);

  // --- Teardown.
  // Stops new sends, waits for in-flight operations (bounded by
  // close_timeout), tells the peer, disconnects, waits for the link to go
  // down, destroys the QP. Idempotent.
  Task<absl::Status> Close();

  // OK while usable; else why it went down. An operation whose own work
  // completion failed (a remote access error on a WRITE, say) takes the
  // connection down before it returns: the QP is in the error state.
  absl::Status status() const;
  // Why it went down (kNone while up). kPeerClosed from the peer's goodbye
  // on, while the messages it sent before are still being received.
  CloseCause close_cause() const;
  const PeerInfo& peer() const;
  // What this side announced in its handshake (credits, receive buffer
  // size, largest message; on the connecting side, the app data).
  const Handshake& local_handshake() const;
  Worker& worker() const;
  transport::QueuePair& qp() const;
  // "conn 7 (10.0.0.1:4791 -> 10.0.0.2:7471, qp 17)".
  const std::string& name() const;

  // Statistics.
  struct Stats {
    uint64_t messages_sent = 0, messages_received = 0;
    uint64_t bytes_sent = 0, bytes_received = 0;  // message payloads
    uint64_t rendezvous_sent = 0, rendezvous_received = 0;
    // Medium messages written into landing buffers (no rendezvous).
    uint64_t landed_sent = 0, landed_received = 0;
    uint64_t credit_messages_sent = 0;
    uint64_t credit_waits = 0;  // sends that waited for a credit
    // Credits the peer may hold now (announced or owed, not yet spent), and
    // the most it ever could. Fixed at recv_credits without an SRQ (less
    // what Messages hold); with use_srq it starts at srq_initial_credits
    // and follows the peer's demand.
    uint32_t recv_window = 0;
    uint32_t recv_window_peak = 0;
    // The rendezvous budget (ConnectionOptions::rendezvous_budget),
    // receiver side. Bytes of the peer's large messages held now (granted
    // and awaiting DONE, or received and not yet taken by Recv; each as
    // its buffer's block), and the most ever held.
    uint64_t rendezvous_bytes_held = 0;
    uint64_t rendezvous_bytes_held_peak = 0;
    // Requests whose CTS was deferred because the budget was spent (a
    // conforming sender waited); requests refused because no memory or
    // registration could be had (the sender's Send failed).
    uint64_t rendezvous_deferred = 0;
    uint64_t rendezvous_refused = 0;
    // 1 when the connection ended because the peer broke the budget (more
    // unanswered requests than a sender may have) or sent no DONE within
    // rendezvous_done_timeout; summed over connections they count such
    // peers.
    uint64_t rendezvous_budget_violations = 0;
    uint64_t rendezvous_done_timeouts = 0;
    // Connection-scope exposures live now, their bytes, and the Expose
    // calls refused by max_exposures / max_exposed_bytes.
    uint64_t exposures = 0;
    uint64_t exposed_bytes = 0;
    uint64_t exposures_refused = 0;
  };
  Stats stats() const;

 private:
  friend class internal::ConnectionSetup;  // creates and starts Connections
  friend class internal::ConnectionTestPeer;
  explicit Connection(std::shared_ptr<internal::ConnectionImpl> impl);
  std::shared_ptr<internal::ConnectionImpl> impl_;
};

// Connection::Send's awaitable (cm/send.cc). co_await it once: as the
// temporary Send returns, or as a named variable (moved only before it is
// used: `auto s = conn.Send(b); co_await std::move(s);`). While a message
// posted from it is in flight it holds the message's buffer and work
// request.
class Connection::SendAwaiter {
 public:
  // Before co_await or PostNow only (nothing is posted yet).
  SendAwaiter(SendAwaiter&& o) noexcept
      : impl_(o.impl_),
        one_{o.one_[0]},
        parts_(o.parts_.data() == o.one_
                   ? std::span<const std::span<const std::byte>>(one_)
                   : o.parts_),
        registered_(o.registered_),
        reg_(o.reg_) {}
  SendAwaiter& operator=(SendAwaiter&&) = delete;

  // Optional, before co_await: posts the message now when it goes eagerly
  // at once, and co_await then only waits for its completion (not at all
  // when it came meanwhile) -- for a caller with something else to await
  // first (an rpc call's response, which usually comes with the send's
  // completion: one resume instead of two). False: nothing is left to
  // wait for on the wire -- the message went inline and is complete, or it
  // takes the slow path, or failed; co_await returns at once or does it
  // all, and says which. Once it returned true, co_await this awaiter before it
  // is destroyed, or its destruction waits for the completion.
  bool PostNow() {
    step_ = Start(std::coroutine_handle<>());
    return step_ == Step::kPosted;
  }

  bool await_ready() const noexcept {
    return step_ == Step::kDone || (step_ == Step::kPosted && op_->completed());
  }
  template <typename P>
  std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) {
    if (step_ == Step::kPosted) {  // PostNow() posted it: wait
      op_->Wait(h);
      return std::noop_coroutine();
    }
    if (step_ == Step::kNone) step_ = Start(h);
    switch (step_) {
      case Step::kPosted:
        return std::noop_coroutine();
      case Step::kDone:
        return h;
      default:
        break;
    }
    // The slow path's Task, awaited as any Task (it inherits h's stop
    // token).
    return
        typename Task<absl::Status>::Awaiter{slow_.handle()}.await_suspend(h);
  }
  // The inline outcome here (once per small message; out of line it was a
  // call).
  absl::Status await_resume() {
    if (inline_.has_value()) return *std::move(inline_);
    return ResumeNotInline();
  }

 private:
  friend class Connection;
  absl::Status ResumeNotInline();
  SendAwaiter(internal::ConnectionImpl* impl,
              std::span<const std::span<const std::byte>> parts)
      : impl_(impl), parts_(parts) {}
  SendAwaiter(internal::ConnectionImpl* impl, std::span<const std::byte> one)
      : impl_(impl), one_{one}, parts_(one_) {}
  SendAwaiter(internal::ConnectionImpl* impl, transport::LocalBuffer reg)
      : impl_(impl), registered_(true), reg_(reg) {}

  enum class Step { kNone, kPosted, kDone, kSlow };
  // Posts the message with `h` (may be null: PostNow) as the waiter when it
  // goes at once, eagerly or into a landing grant (kPosted, or kDone when
  // the post failed at once); else starts the slow path's Task in slow_
  // (kSlow): SendParts or SendRegistered, which wait for the turn, a credit
  // or a buffer, or take the rendezvous.
  Step Start(std::coroutine_handle<> h);

  internal::ConnectionImpl* impl_;
  std::span<const std::byte> one_[1];  // Send(span)'s one part
  std::span<const std::span<const std::byte>> parts_;
  bool registered_ = false;  // Send(LocalBuffer): reg_ is the payload
  transport::LocalBuffer reg_;
  uint32_t total_ = 0;
  Step step_ = Step::kNone;
  Task<absl::Status> slow_;
  std::optional<absl::Status> inline_;  // posted inline: the outcome
  // Declared before op_: destroyed after it, so the buffer stays ours until
  // the operation completed (~OpBase waits for that).
  std::optional<transport::BufferPool::Buffer> buf_;
  // A message posted at once into a landing buffer the peer granted: its
  // WRITE and header (the op posts them, maybe later under back-pressure)
  // and the staging buffer the WRITE reads; also destroyed after op_.
  std::unique_ptr<internal::LandedSend, internal::LandedSendDeleter> landed_;
  std::optional<transport::QueuePair::Op> op_;
};

inline Connection::SendAwaiter Connection::Send(
    std::span<const std::byte> payload) {
  return SendAwaiter(impl_.get(), payload);
}
inline Connection::SendAwaiter Connection::Send(std::string_view text) {
  return SendAwaiter(impl_.get(),
                     std::as_bytes(std::span(text.data(), text.size())));
}
inline Connection::SendAwaiter Connection::SendV(
    std::span<const std::span<const std::byte>> parts) {
  return SendAwaiter(impl_.get(), parts);
}
inline Connection::SendAwaiter Connection::SendVDirect(
    std::span<const std::span<const std::byte>> parts) {
  return SendAwaiter(impl_.get(), parts);
}
inline Connection::SendAwaiter Connection::Send(
    transport::LocalBuffer registered) {
  return SendAwaiter(impl_.get(), registered);
}

// Connection::Recv's awaitable (cm/receive.cc). co_await it once: as the
// temporary Recv returns, or as a named variable (moved only before it is
// awaited: `auto r = conn.Recv(); co_await std::move(r);`). A message
// deliverable at once, with no Recv waiting ahead, completes the co_await
// without suspending (await_ready); else the awaiting coroutine parks in
// the connection's FIFO of receivers and is resumed with the next message,
// with Cancelled (its stop token), or with the error that ended the
// connection (Fail wakes every receiver).
class Connection::RecvAwaiter {
 public:
  // Before co_await only (nothing is taken or waiting yet).
  RecvAwaiter(RecvAwaiter&& o) noexcept : impl_(o.impl_) {}
  RecvAwaiter& operator=(RecvAwaiter&&) = delete;

  bool await_ready() { return TakeNow(); }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) {
    wait_.emplace(ReadyCount(), 1);
    return wait_->await_suspend(h);  // false: resume at once
  }
  absl::StatusOr<Message> await_resume() {
    if (got_) return std::move(msg_);
    return Finish();
  }

 private:
  friend class Connection;
  explicit RecvAwaiter(internal::ConnectionImpl* impl) : impl_(impl) {}
  // Takes a deliverable message (true, got_), or says that the Recv ends
  // at once with an error (true); false: it must wait.
  bool TakeNow();
  Semaphore* ReadyCount() const;  // the connection's deliverable messages
  // After a wait (or TakeNow's error): the message, or why there is none.
  absl::StatusOr<Message> Finish();

  internal::ConnectionImpl* impl_;
  bool got_ = false;
  Message msg_;
  // Engaged only when the co_await waits (most Recvs on a busy connection
  // do not).
  std::optional<Semaphore::Awaiter> wait_;
};

inline Connection::RecvAwaiter Connection::Recv() {
  return RecvAwaiter(impl_.get());
}

}  // namespace coverbs::cm

#endif  // COVERBS_CM_CONNECTION_H_
