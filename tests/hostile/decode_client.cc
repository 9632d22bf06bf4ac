// decode_client: the clients of decode_test.sh (issue 36, point 2).
//
//   --mode=attack --attack=KIND --size=BYTES --connections=N
//     sends one call of KIND on each of N connections at once and prints
//     each outcome. Exit 0 when every call got what --expect says: "error"
//     (INVALID_ARGUMENT or RESOURCE_EXHAUSTED; the attacks) or "ok" (a
//     legitimate payload of the same size, which must be served).
//     Attacks (the payload as an attacker writes it, by hand):
//       nils_pair      msgpack array of nils to a two-field struct
//       nils_strings   msgpack array of nils to vector<string>
//       empty_strings  msgpack array of empty strings to vector<string>
//       empty_batch    protobuf Batch of empty Items (2 bytes each)
//     Legitimate ones (encoded by the codec): floats (vector<float>),
//     strings (vector<string> of 24-byte strings), batch (Items with a
//     name, an id and tags).
//   --mode=good --stop_file=F
//     small typed calls (Pair, Floats) and byte echoes, a fresh connection
//     every 20 calls, each within --bound, until F exists (at most
//     --max_seconds). Exit 0 when every call and connect succeeded in
//     time; prints the slowest of each.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coverbs/coverbs.h"
#include "examples/common.h"
#include "tests/hostile/decode.h"

ABSL_FLAG(std::string, provider, "soft", "verbs or soft");
ABSL_FLAG(std::string, device, "", "verbs: the device; empty: the first");
ABSL_FLAG(std::string, server, "127.0.0.1", "server address");
ABSL_FLAG(uint16_t, port, 0, "server port");
ABSL_FLAG(std::string, mode, "attack", "attack or good");
ABSL_FLAG(std::string, attack, "nils_strings", "what to send (see above)");
ABSL_FLAG(std::string, expect, "error", "error or ok");
ABSL_FLAG(size_t, size, 16 << 20, "attack: payload bytes");
ABSL_FLAG(size_t, connections, 4, "attack: connections, one call each");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(60), "attack: per call");
ABSL_FLAG(std::string, stop_file, "", "good: stop once this file exists");
ABSL_FLAG(absl::Duration, bound, absl::Seconds(1),
          "good: the longest a call or a connect may take");
ABSL_FLAG(absl::Duration, max_seconds, absl::Seconds(120),
          "good: stop after this long whatever the stop file says");

namespace coverbs::decode_test {
namespace {

using ::decode_methods::Pair;

void PutU32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>(v >> (8 * i)));
}

// msgpack array32 of `size` bytes in all, every element the byte `elem`.
std::string MsgpackArrayOf(size_t size, char elem) {
  std::string s;
  s.reserve(size);
  s.push_back(static_cast<char>(0xdd));
  PutU32(s, static_cast<uint32_t>(size - 5));
  s.append(size - 5, elem);
  return s;
}

struct Attack {
  std::string method;
  std::string payload;
};

absl::StatusOr<Attack> MakePayload(const std::string& kind, size_t size) {
  if (size < 16) return absl::InvalidArgumentError("--size below 16");
  if (kind == "nils_pair") {
    return Attack{"Pair", MsgpackArrayOf(size, static_cast<char>(0xc0))};
  }
  if (kind == "nils_strings") {
    return Attack{"Strings", MsgpackArrayOf(size, static_cast<char>(0xc0))};
  }
  if (kind == "empty_strings") {
    return Attack{"Strings", MsgpackArrayOf(size, static_cast<char>(0xa0))};
  }
  if (kind == "empty_batch") {
    std::string s;
    s.reserve(size);
    while (s.size() + 2 <= size) s.append("\x0a\x00", 2);  // items { }
    return Attack{"Batch", std::move(s)};
  }
  std::string s;
  if (kind == "floats") {
    std::vector<float> v(size / 5);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f + i;
    rpc::Codec<std::vector<float>>::Encode(v, s);
    return Attack{"Floats", std::move(s)};
  }
  if (kind == "strings") {
    std::vector<std::string> v(size / 26);
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = absl::StrCat("value-", i, "-", std::string(24, 'x')).substr(0, 24);
    }
    rpc::Codec<std::vector<std::string>>::Encode(v, s);
    return Attack{"Strings", std::move(s)};
  }
  if (kind == "batch") {
    rpc::test::Batch b;
    for (size_t i = 0; b.ByteSizeLong() + 64 < size; ++i) {
      for (int k = 0; k < 1000; ++k) {
        rpc::test::Item* it = b.add_items();
        it->set_name(absl::StrCat("item-", i, "-", k));
        it->set_id(i * 1000 + k);
        it->add_tags(k);
        it->add_tags(k + 1);
      }
    }
    s = b.SerializeAsString();
    return Attack{"Batch", std::move(s)};
  }
  return absl::InvalidArgumentError(absl::StrCat("no attack ", kind));
}

Task<absl::Status> RunAttack(cm::Worker& worker) {
  const std::string kind = absl::GetFlag(FLAGS_attack);
  const bool expect_ok = absl::GetFlag(FLAGS_expect) == "ok";
  CO_ASSIGN_OR_RETURN(Attack a, MakePayload(kind, absl::GetFlag(FLAGS_size)));
  const size_t n = absl::GetFlag(FLAGS_connections);
  std::vector<std::unique_ptr<rpc::Client>> clients;
  for (size_t i = 0; i < n; ++i) {
    CO_ASSIGN_OR_RETURN(auto c, co_await rpc::Client::Connect(
                                    worker, absl::GetFlag(FLAGS_server),
                                    absl::GetFlag(FLAGS_port)));
    clients.push_back(std::move(c));
  }
  const absl::Time t0 = absl::Now();
  std::vector<double> secs(n);
  auto results = co_await ForEachBounded(
      n, n, [&](size_t i) -> Task<absl::StatusOr<uint64_t>> {
        rpc::CallOptions o;
        o.deadline = absl::Now() + absl::GetFlag(FLAGS_deadline);
        auto r = co_await clients[i]->Call(a.method, AsBytes(a.payload), o);
        secs[i] = absl::ToDoubleSeconds(absl::Now() - t0);
        if (!r.ok()) co_return r.status();
        co_return r->size();
      });
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) {
    const absl::Status& st = results[i].status();
    std::string msg(st.message().substr(0, 240));
    std::printf("%s: %zu bytes to %s on connection %zu: %s after %.2f s%s%s\n",
                kind.c_str(), a.payload.size(), a.method.c_str(), i,
                absl::StatusCodeToString(st.code()).c_str(), secs[i],
                msg.empty() ? "" : ": ", msg.c_str());
    const bool refused = st.code() == absl::StatusCode::kInvalidArgument ||
                         st.code() == absl::StatusCode::kResourceExhausted;
    if (expect_ok ? !st.ok() : !refused) ++wrong;
  }
  std::fflush(stdout);
  for (auto& c : clients) (void)co_await c->Close();
  if (wrong > 0) {
    co_return absl::InternalError(absl::StrCat(
        wrong, " of ", n, " call(s) did not ", expect_ok ? "succeed" : "fail"));
  }
  co_return absl::OkStatus();
}

Task<absl::Status> RunGood(cm::Worker& worker) {
  const std::string stop_file = absl::GetFlag(FLAGS_stop_file);
  const absl::Duration bound = absl::GetFlag(FLAGS_bound);
  const absl::Time end = absl::Now() + absl::GetFlag(FLAGS_max_seconds);
  absl::Duration slowest_call, slowest_connect;
  size_t calls = 0, connects = 0;
  std::unique_ptr<rpc::Client> c;
  auto connect = [&]() -> Task<absl::Status> {
    if (c) (void)co_await c->Close();
    c.reset();
    const absl::Time t = absl::Now();
    rpc::ClientOptions o;
    auto r = co_await rpc::Client::Connect(worker, absl::GetFlag(FLAGS_server),
                                           absl::GetFlag(FLAGS_port), o);
    const absl::Duration took = absl::Now() - t;
    slowest_connect = std::max(slowest_connect, took);
    if (!r.ok()) co_return r.status();
    c = *std::move(r);
    ++connects;
    if (took > bound) {
      co_return absl::DeadlineExceededError(
          absl::StrCat("connect took ", absl::FormatDuration(took)));
    }
    co_return absl::OkStatus();
  };
  absl::Status result;
  const std::string echo(64, 'e');
  // Named: gcc 12 miscompiles an initializer list inside a co_await.
  const std::vector<float> three = {1, 2, 3};
  while (absl::Now() < end && (stop_file.empty() ||
                               access(stop_file.c_str(), F_OK) != 0)) {
    if (calls % 20 == 0) {
      result = co_await connect();
      if (!result.ok()) break;
    }
    rpc::CallOptions o;
    const absl::Time t = absl::Now();
    o.deadline = t + bound;
    absl::Status st;
    switch (calls % 3) {
      case 0: {
        const Pair p{"key", std::to_string(calls)};
        auto r = co_await c->Call(::decode_methods::kPair, p, o);
        st = r.status();
        break;
      }
      case 1: {
        auto r = co_await c->Call(::decode_methods::kFloats, three, o);
        if (r.ok() && *r != 3) st = absl::DataLossError("Floats: wrong count");
        else st = r.status();
        break;
      }
      default: {
        auto r = co_await c->Call("Echo", AsBytes(echo), o);
        if (r.ok() && r->size() != echo.size()) {
          st = absl::DataLossError("Echo: wrong size");
        } else {
          st = r.status();
        }
      }
    }
    slowest_call = std::max(slowest_call, absl::Now() - t);
    ++calls;
    if (!st.ok()) {
      result = absl::Status(st.code(), absl::StrCat("call ", calls, ": ",
                                                    st.message()));
      break;
    }
    (void)co_await Reactor::Current()->Sleep(absl::Milliseconds(2));
  }
  if (c) (void)co_await c->Close();
  std::printf("good: %zu call(s), %zu connect(s); slowest call %s, slowest "
              "connect %s (bound %s)\n",
              calls, connects, absl::FormatDuration(slowest_call).c_str(),
              absl::FormatDuration(slowest_connect).c_str(),
              absl::FormatDuration(bound).c_str());
  std::fflush(stdout);
  co_return result;
}

}  // namespace
}  // namespace coverbs::decode_test

int main(int argc, char** argv) {
  using namespace coverbs;
  absl::SetProgramUsageMessage(
      "tests/hostile/decode_test.sh's clients: --mode=attack|good");
  examples::ParseFlagsOrExit(argc, argv);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "attack" && mode != "good") {
    std::fprintf(stderr, "decode_client: --mode must be attack or good\n");
    return 2;
  }
  auto device = examples::OpenDevice(absl::GetFlag(FLAGS_provider),
                                     absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "decode_client: %s\n",
                 device.status().ToString().c_str());
    return 1;
  }
  RunOptions options;
  options.device = device->get();
  absl::Status result;
  auto main_fn = [&](cm::Worker& w) -> Task<absl::Status> {
    // Not a conditional expression: gcc 12 miscompiles co_await in one.
    if (mode == "attack") {
      result = co_await decode_test::RunAttack(w);
    } else {
      result = co_await decode_test::RunGood(w);
    }
    co_return absl::OkStatus();
  };
  if (RunMain(main_fn, options) != 0) return 1;
  if (!result.ok()) {
    std::printf("%s: FAILED: %s\n", mode.c_str(), result.ToString().c_str());
    return 1;
  }
  return 0;
}
