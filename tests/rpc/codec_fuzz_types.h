// The types codec_fuzzer.cc decodes its inputs as, shared with the driver
// that makes its seeds (codec_fuzz_driver.cc), and Same(): equality that
// holds for NaN (a float compared by its bits).
#ifndef COVERBS_TESTS_RPC_CODEC_FUZZ_TYPES_H_
#define COVERBS_TESTS_RPC_CODEC_FUZZ_TYPES_H_

#include <bit>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "msgpack.hpp"

namespace coverbs::rpc::fuzz {

// A struct with MSGPACK_DEFINE: an array of exactly its four members.
struct Record {
  std::string name;
  uint16_t port = 0;
  std::vector<int8_t> xs;
  std::optional<bool> flag;
  MSGPACK_DEFINE(name, port, xs, flag);
};

inline bool Same(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}
inline bool Same(double a, double b) {
  return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b);
}
template <typename T>
bool Same(const T& a, const T& b);
template <typename T>
bool Same(const std::optional<T>& a, const std::optional<T>& b) {
  if (a.has_value() != b.has_value()) return false;
  return !a.has_value() || Same(*a, *b);
}
template <typename T>
bool Same(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!Same(a[i], b[i])) return false;
  }
  return true;
}
template <typename A, typename B>
bool Same(const std::pair<A, B>& a, const std::pair<A, B>& b) {
  return Same(a.first, b.first) && Same(a.second, b.second);
}
template <typename... T>
bool Same(const std::tuple<T...>& a, const std::tuple<T...>& b) {
  return [&]<size_t... I>(std::index_sequence<I...>) {
    return (Same(std::get<I>(a), std::get<I>(b)) && ...);
  }(std::index_sequence_for<T...>());
}
inline bool Same(const Record& a, const Record& b) {
  return a.name == b.name && a.port == b.port && a.xs == b.xs &&
         a.flag == b.flag;
}
// Maps, strings, integers, bools: ==.
template <typename T>
bool Same(const T& a, const T& b) {
  return a == b;
}

}  // namespace coverbs::rpc::fuzz

#endif  // COVERBS_TESTS_RPC_CODEC_FUZZ_TYPES_H_
