// The typed methods of decode_test.sh (issue 36, point 2), shared by
// decode_server.cc and decode_client.cc: one per shape of the decode
// attacks, and the small calls of the good client.
#ifndef COVERBS_TESTS_HOSTILE_DECODE_H_
#define COVERBS_TESTS_HOSTILE_DECODE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "rpc/typed.h"
#include "tests/rpc/typed_test.pb.h"

namespace decode_methods {

// A two-field struct (msgpack array of 2): an array of nils must be
// refused at its header (arity), not decoded into a tree first.
struct Pair {
  std::string key, value;
  MSGPACK_DEFINE(key, value);
};

// Each returns how many elements it got.
inline constexpr coverbs::rpc::Method<Pair, uint64_t> kPair{"Pair"};
inline constexpr coverbs::rpc::Method<std::vector<std::string>, uint64_t>
    kStrings{"Strings"};
inline constexpr coverbs::rpc::Method<std::vector<float>, uint64_t> kFloats{
    "Floats"};
inline constexpr coverbs::rpc::Method<coverbs::rpc::test::Batch, uint64_t>
    kBatch{"Batch"};

}  // namespace decode_methods

#endif  // COVERBS_TESTS_HOSTILE_DECODE_H_
