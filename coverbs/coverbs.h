// coverbs: everything a service needs, in one include.
//
//   #include "coverbs/coverbs.h"
//
// Coroutines and reactors (Task, Reactor, Spawn/JoinHandle, WhenAll/WhenAny,
// ForEachBounded, CO_RETURN_IF_ERROR / CO_ASSIGN_OR_RETURN), the device
// (transport::Device, typed memory Access), connections (cm::Connect,
// cm::Listener, cm::Connection, cm::Worker, cm::WorkerPool), the RPC layer
// (rpc::Server, rpc::Client, rpc::ClientPool) and the two entry points of a
// program (coverbs/run.h: RunMain, Serve). README.md, "Writing a service",
// shows them in use.
// Internal headers (cm/wire.h, transport/soft/..., *_impl.h) are not part of
// it and not visible to targets outside coverbs.
#ifndef COVERBS_COVERBS_H_
#define COVERBS_COVERBS_H_

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "cm/connect.h"
#include "cm/connection.h"
#include "cm/listener.h"
#include "cm/worker.h"
#include "cm/worker_pool.h"
#include "core/bounded.h"
#include "core/join.h"
#include "core/offload.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "core/status_macros.h"
#include "core/task.h"
#include "core/timeout.h"
#include "core/when.h"
#include "coverbs/run.h"
#include "rpc/client.h"
#include "rpc/client_pool.h"
#include "rpc/server.h"
#include "transport/device.h"

namespace coverbs {
using transport::Access;
using transport::RemoteRegion;

// The bytes of a string: to register, Read into, Write or Send from.
inline std::span<std::byte> AsBytes(std::string& s) {
  return std::as_writable_bytes(std::span(s));
}
inline std::span<const std::byte> AsBytes(std::string_view s) {
  return std::as_bytes(std::span(s));
}
}  // namespace coverbs

#endif  // COVERBS_COVERBS_H_
