// libFuzzer entry point for typed decoding (rpc/codec.h): the msgpack
// decoder of rpc/codec_msgpack.h and the protobuf scan of
// rpc/codec_protobuf.h, both reached by any peer that calls a typed method
// (or answers one).
//
// Built with gcc and tests/rpc/codec_fuzz_driver.cc (gcc has no
// libFuzzer): with --config=asan it runs under ASan + UBSan.
//
// Every input is decoded as each of the types below, under several decode
// budgets, and these properties are checked (abort on a violation):
//  - no crash, out-of-bounds read, leak or hang (sanitizers);
//  - the budget holds: the heap the decode holds at its peak
//    (heap_counter.h) is at most DecodeOptions::MemoryLimit (msgpack) /
//    ProtobufMemoryLimit (protobuf) of the payload, plus the refusal's own
//    Status when it fails;
//  - a refusal says why (a non-empty INVALID_ARGUMENT or
//    RESOURCE_EXHAUSTED);
//  - msgpack: a value accepted is what msgpack-c makes of the same bytes
//    (msgpack::unpack + convert: rpc/codec_msgpack.h promises its
//    conversion rules) for the types where the two agree by design (not
//    structs and tuples, whose arity coverbs checks and msgpack-c does
//    not), and re-encoding it decodes to the same value;
//  - protobuf: a message accepted re-serializes and parses back to an equal
//    message (equal deterministic serializations).
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "msgpack.hpp"
#include "rpc/codec.h"
#include "tests/rpc/codec_fuzz_types.h"
#include "tests/rpc/heap_counter.h"
#include "tests/rpc/typed_test.pb.h"

namespace {

using coverbs::rpc::Codec;
using coverbs::rpc::DecodeOptions;
using coverbs::rpc::testing::PeakHeapDuring;
namespace fuzz = coverbs::rpc::fuzz;

// The input under test, for the report of a violated property.
thread_local std::span<const std::byte> t_input;

[[noreturn]] void Violated(const char* what, int line, const char* where) {
  std::fprintf(stderr, "codec_fuzzer: %s (line %d, in %s)\ninput (%zu bytes):",
               what, line, where, t_input.size());
  for (std::byte b : t_input) {
    std::fprintf(stderr, " %02x", static_cast<unsigned>(b));
  }
  std::fprintf(stderr, "\n");
  std::abort();
}

#define CHECK_PROPERTY(cond)                                     \
  do {                                                          \
    if (!(cond)) Violated(#cond, __LINE__, __PRETTY_FUNCTION__); \
  } while (0)

// The peak heap of a decode against its bound.
void CheckPeak(size_t peak, size_t limit, const char* where) {
  if (peak <= limit) return;
  std::fprintf(stderr, "codec_fuzzer: peak heap %zu bytes over the bound %zu\n",
               peak, limit);
  Violated("peak <= bound", __LINE__, where);
}

// The budgets each input is decoded under: the default, and tight ones
// (little slack) where the bound is what decides.
std::vector<DecodeOptions> Budgets() {
  std::vector<DecodeOptions> out;
  out.push_back(DecodeOptions());
  for (uint32_t factor : {1u, 4u, 8u, 32u}) {
    DecodeOptions o;
    o.memory_factor = factor;
    o.protobuf_memory_factor = factor * 2;
    o.memory_slack = 64;
    out.push_back(o);
  }
  return out;
}

// What a refusal itself allocates beyond the decode's budget: its Status
// and message (a decode refused at its bound has spent up to the bound).
constexpr size_t kRefusalHeap = 1024;

void CheckRefusal(const absl::Status& s) {
  CHECK_PROPERTY(!s.ok());
  CHECK_PROPERTY(!s.message().empty());
  CHECK_PROPERTY(s.code() == absl::StatusCode::kInvalidArgument ||
        s.code() == absl::StatusCode::kResourceExhausted);
}

// A message's deterministic serialization (map entries in key order,
// unknown fields kept, floats bit for bit): equal for equal messages.
std::string Canonical(const google::protobuf::Message& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&coded);
  }
  return out;
}

// msgpack-c's value for the same bytes, when it takes them whole.
template <typename T>
std::optional<T> MsgpackC(std::span<const std::byte> in) {
  try {
    size_t off = 0;
    msgpack::object_handle oh = msgpack::unpack(
        reinterpret_cast<const char*>(in.data()), in.size(), off);
    if (off != in.size()) return std::nullopt;
    T v{};
    oh.get().convert(v);
    return v;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

template <typename T, bool kCompareWithMsgpackC>
void Msgpack(std::span<const std::byte> in) {
  for (const DecodeOptions& o : Budgets()) {
    std::optional<absl::StatusOr<T>> got;
    const size_t peak = static_cast<size_t>(
        PeakHeapDuring([&] { got.emplace(Codec<T>::Decode(in, o)); }));
    if (!got->ok()) {
      CheckPeak(peak, o.MemoryLimit(in.size()) + kRefusalHeap, __PRETTY_FUNCTION__);
      CheckRefusal(got->status());
      continue;
    }
    CheckPeak(peak, o.MemoryLimit(in.size()), __PRETTY_FUNCTION__);
    const T& v = **got;
    if constexpr (kCompareWithMsgpackC) {
      std::optional<T> theirs = MsgpackC<T>(in);
      CHECK_PROPERTY(theirs.has_value());
      CHECK_PROPERTY(fuzz::Same(v, *theirs));
    }
    std::string again;
    Codec<T>::Encode(v, again);
    DecodeOptions roomy;
    roomy.memory_factor = 1 << 12;
    roomy.memory_slack = 1 << 20;
    absl::StatusOr<T> back = Codec<T>::Decode(std::as_bytes(std::span(again)),
                                              roomy);
    CHECK_PROPERTY(back.ok());
    CHECK_PROPERTY(fuzz::Same(v, *back));
  }
}

template <typename M>
void Protobuf(std::span<const std::byte> in) {
  for (const DecodeOptions& o : Budgets()) {
    std::optional<absl::StatusOr<M>> got;
    const size_t peak = static_cast<size_t>(
        PeakHeapDuring([&] { got.emplace(Codec<M>::Decode(in, o)); }));
    if (!got->ok()) {
      CheckPeak(peak, o.ProtobufMemoryLimit(in.size()) + kRefusalHeap,
                __PRETTY_FUNCTION__);
      CheckRefusal(got->status());
      continue;
    }
    CheckPeak(peak, o.ProtobufMemoryLimit(in.size()), __PRETTY_FUNCTION__);
    std::string again;
    Codec<M>::Encode(**got, again);
    M back;
    CHECK_PROPERTY(back.ParseFromString(again));
    CHECK_PROPERTY(Canonical(**got) == Canonical(back));
  }
}

// What is made once per process (the types' scan plans, libprotobuf's
// descriptors and default instances) is not a decode's: made before
// anything is counted.
void WarmUp() {
  static const bool done = [] {
    // libprotobuf logs each string field that is not UTF-8 (proto3 refuses
    // it): the refusal is what is checked, not the log.
    google::protobuf::SetLogHandler(nullptr);
    coverbs::rpc::test::Batch b;
    b.add_items()->set_name("warm");
    (*b.mutable_counts())["k"] = 1;
    std::string s = b.SerializeAsString();
    s.append("\x78\x01", 2);  // an unknown field
    const auto bytes = std::as_bytes(std::span(s));
    CHECK_PROPERTY(Codec<coverbs::rpc::test::Batch>::Decode(bytes).ok());
    (void)Codec<coverbs::rpc::test::KvPut>::Decode(bytes);
    return true;
  }();
  (void)done;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  WarmUp();
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data),
                                size);
  t_input = in;
  Msgpack<std::vector<bool>, true>(in);
  Msgpack<std::map<std::string, std::vector<std::string>>, true>(in);
  Msgpack<std::vector<std::string>, true>(in);
  Msgpack<std::map<std::string, int64_t>, true>(in);
  Msgpack<std::unordered_map<int32_t, std::vector<uint8_t>>, true>(in);
  Msgpack<std::vector<std::optional<double>>, true>(in);
  Msgpack<std::vector<std::vector<float>>, true>(in);
  Msgpack<std::pair<uint16_t, std::string>, true>(in);
  Msgpack<fuzz::Record, false>(in);
  Msgpack<std::vector<fuzz::Record>, false>(in);
  Msgpack<std::tuple<int8_t, std::optional<std::string>, bool>, false>(in);
  Protobuf<coverbs::rpc::test::Batch>(in);
  Protobuf<coverbs::rpc::test::KvPut>(in);
  return 0;
}
