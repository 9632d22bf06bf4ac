#include "rpc/metrics.h"

#include <algorithm>
#include <array>
#include <exception>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

#if defined(__SANITIZE_THREAD__)
// civetweb (Debian's libcivetweb, built without REENTRANT_TIME) formats the
// Date header with gmtime(), whose result is one static buffer in glibc:
// two worker threads answering in the same instant write it at once. With
// http_threads > 1 ThreadSanitizer's gmtime interceptor reports that (the
// slowloris test makes workers time out together). Both write the same
// second's fields, so at worst a Date header is off; nothing of ours is
// involved, and civetweb itself is not instrumented. Only that library's
// races are suppressed, in binaries that link this file.
extern "C" const char* __tsan_default_suppressions() {
  return "race:libcivetweb.so\n";
}
#endif

namespace coverbs::rpc {
namespace {

constexpr char kPrefix[] = "coverbs_rpc_server_";
constexpr size_t kCodes = 17;  // absl::StatusCode 0..16

prometheus::MetricFamily Family(std::string name, std::string help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily f;
  f.name = absl::StrCat(kPrefix, name);
  f.help = std::move(help);
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

}  // namespace

// Reads Server::stats() at every scrape: the server's own atomics stay the
// only copy of its counters.
class ServerMetrics::StatsCollectable : public prometheus::Collectable {
 public:
  void Watch(const Server* server) {
    std::lock_guard<std::mutex> lock(mu_);
    server_ = server;
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    // Held across stats(): Watch(nullptr) waits for a scrape in progress.
    std::lock_guard<std::mutex> lock(mu_);
    if (server_ == nullptr) return {};
    const Server::Stats s = server_->stats();
    using prometheus::MetricType;
    constexpr MetricType kCounter = MetricType::Counter;
    constexpr MetricType kGauge = MetricType::Gauge;
    auto d = [](uint64_t v) { return static_cast<double>(v); };
    return {
        Family("connections_total", "Connections accepted (or given to Serve).",
               kCounter, d(s.connections)),
        Family("open_connections", "Connections being served now.", kGauge,
               d(s.open_connections)),
        Family("rejected_connections_total",
               "Connection requests the listener refused (bad handshake, "
               "admission, handshake timeout, no resources).",
               kCounter, d(s.rejected_connections)),
        Family("accept_errors_total",
               "Failed accepts of a socket or cm event (EMFILE...).", kCounter,
               d(s.accept_errors)),
        Family("pending_handshakes", "Handshakes being read now.", kGauge,
               d(s.pending_handshakes)),
        Family("evicted_handshakes_total",
               "Pending handshakes dropped for newer connections or to free "
               "a descriptor.",
               kCounter, d(s.evicted_handshakes)),
        Family("calls_total", "Handlers started.", kCounter, d(s.calls)),
        Family("failed_calls_total", "Handlers that returned an error.",
               kCounter, d(s.failed_calls)),
        Family("request_bytes_total", "Request payload bytes received.",
               kCounter, d(s.request_bytes)),
        Family("response_bytes_total", "Response payload bytes sent.", kCounter,
               d(s.response_bytes)),
        Family("credit_stalls_total",
               "Sends that waited for a credit, on connections that ended.",
               kCounter, d(s.credit_stalls)),
        Family("rendezvous_total",
               "Messages that went by rendezvous (either way), on "
               "connections that ended.",
               kCounter, d(s.rendezvous)),
        Family("cancels_received_total", "Cancel frames received.", kCounter,
               d(s.cancels_received)),
        Family("cancelled_calls_total", "Calls stopped before they responded.",
               kCounter, d(s.cancelled_calls)),
        Family("unknown_method_total", "Requests naming no registered method.",
               kCounter, d(s.unknown_method)),
        Family("protocol_errors_total",
               "Connections closed for a malformed frame.", kCounter,
               d(s.protocol_errors)),
        Family("copied_requests_total",
               "Small request payloads copied to free receive buffers.",
               kCounter, d(s.copied_requests)),
        Family("rendezvous_held_bytes",
               "Rendezvous and landed receive memory held for peers now.",
               kGauge, d(s.rendezvous_held_bytes)),
        Family("rendezvous_deferred_total",
               "Rendezvous requests whose CTS waited for a budget.", kCounter,
               d(s.rendezvous_deferred)),
        Family("rendezvous_budget_violations_total",
               "Connections ended for asking beyond the rendezvous budget.",
               kCounter, d(s.rendezvous_budget_violations)),
        Family("rendezvous_done_timeouts_total",
               "Connections ended for withholding a rendezvous DONE.",
               kCounter, d(s.rendezvous_done_timeouts)),
        Family("exposures_refused_total",
               "Expose calls refused by a connection's exposure bounds.",
               kCounter, d(s.exposures_refused)),
        Family("reactor_stalls_total",
               "Tasks that ran past the stall threshold without yielding.",
               kCounter, d(s.reactor_stalls)),
    };
  }

 private:
  mutable std::mutex mu_;
  const Server* server_ = nullptr;
};

struct ServerMetrics::MethodMetrics {
  std::string name;
  prometheus::Histogram* latency = nullptr;
  // Created on a code's first call (only codes seen are exported).
  std::array<std::atomic<prometheus::Counter*>, kCodes> calls{};
};

struct ServerMetrics::Families {
  prometheus::Family<prometheus::Histogram>* latency = nullptr;
  prometheus::Family<prometheus::Counter>* calls = nullptr;
  // std (pthread) lock rather than absl::Mutex: the system's prebuilt absl is
  // not instrumented for ThreadSanitizer.
  std::shared_mutex mu;
  absl::flat_hash_map<uint32_t, std::unique_ptr<MethodMetrics>> methods;  // mu
};

ServerMetrics::ServerMetrics() : ServerMetrics(Options{}) {}

ServerMetrics::ServerMetrics(Options options)
    : options_(std::move(options)),
      registry_(std::make_shared<prometheus::Registry>()),
      stats_(std::make_shared<StatsCollectable>()),
      families_(std::make_unique<Families>()) {
  families_->latency =
      &prometheus::BuildHistogram()
           .Name(absl::StrCat(kPrefix, "call_duration_seconds"))
           .Help(
               "Time from a request's arrival to its response posted, per "
               "method (queueing for a handler slot included).")
           .Register(*registry_);
  families_->calls = &prometheus::BuildCounter()
                          .Name(absl::StrCat(kPrefix, "method_calls_total"))
                          .Help("Calls per method and status code.")
                          .Register(*registry_);
}

ServerMetrics::~ServerMetrics() {
  // The exposer first: no scrape runs while the rest goes.
  exposer_.reset();
}

CallObserver ServerMetrics::Observer() {
  return [this](const CallRecord& call) { Record(call); };
}

void ServerMetrics::Watch(const Server* server) { stats_->Watch(server); }

ServerMetrics::MethodMetrics& ServerMetrics::ForMethod(const CallRecord& call) {
  Families& f = *families_;
  {
    std::shared_lock lock(f.mu);
    auto it = f.methods.find(call.method_id);
    if (it != f.methods.end()) return *it->second;
  }
  std::unique_lock lock(f.mu);
  std::unique_ptr<MethodMetrics>& m = f.methods[call.method_id];
  if (m == nullptr) {
    m = std::make_unique<MethodMetrics>();
    m->name = std::string(call.method);
    m->latency =
        &f.latency->Add({{"method", m->name}}, options_.latency_buckets);
  }
  return *m;
}

void ServerMetrics::Record(const CallRecord& call) {
  MethodMetrics& m = ForMethod(call);
  m.latency->Observe(absl::ToDoubleSeconds(call.latency));
  const size_t code = static_cast<size_t>(call.code);
  if (code >= kCodes) return;  // not a canonical code: not counted
  prometheus::Counter* counter = m.calls[code].load(std::memory_order_acquire);
  if (counter == nullptr) {
    std::unique_lock lock(families_->mu);
    counter = m.calls[code].load(std::memory_order_relaxed);
    if (counter == nullptr) {
      counter = &families_->calls->Add(
          {{"method", m.name}, {"code", absl::StatusCodeToString(call.code)}});
      m.calls[code].store(counter, std::memory_order_release);
    }
  }
  counter->Increment();
}

absl::Status ServerMetrics::Listen(const std::string& address, uint16_t port) {
  if (exposer_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("metrics: already listening on port ", port_.load()));
  }
  // civetweb's form: host:port, an IPv6 host in brackets.
  const std::string where = address.find(':') != std::string::npos
                                ? absl::StrCat("[", address, "]:", port)
                                : absl::StrCat(address, ":", port);
  // civetweb's options (prometheus-cpp's Exposer passes them through): see
  // Options. No keep-alive, so each connection is one request; no linger,
  // so closing never waits on a peer that does not read.
  const int threads = std::max(1, options_.http_threads);
  const int64_t timeout_ms = std::max<int64_t>(
      1, absl::ToInt64Milliseconds(options_.http_request_timeout));
  std::vector<std::string> civetweb = {
      "listening_ports",    where,
      "num_threads",        absl::StrCat(threads),
      "request_timeout_ms", absl::StrCat(timeout_ms),
      "enable_keep_alive",  "no",
  };
  try {
    auto exposer = std::make_unique<prometheus::Exposer>(std::move(civetweb));
    exposer->RegisterCollectable(registry_);
    exposer->RegisterCollectable(stats_);
    std::vector<int> ports = exposer->GetListeningPorts();
    if (ports.empty()) {
      return absl::InternalError(
          absl::StrCat("metrics: listening on ", where, ": no port bound"));
    }
    port_.store(static_cast<uint16_t>(ports.front()));
    exposer_ = std::move(exposer);
  } catch (const std::exception& e) {
    // civetweb reports a bind failure (port in use, bad address) by
    // throwing.
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", where, ": ", e.what()));
  }
  return absl::OkStatus();
}

uint16_t ServerMetrics::port() const { return port_.load(); }

std::string ServerMetrics::Text() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> stats = stats_->Collect();
  families.insert(families.end(), std::make_move_iterator(stats.begin()),
                  std::make_move_iterator(stats.end()));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace coverbs::rpc
