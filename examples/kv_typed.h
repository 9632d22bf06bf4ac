// The typed key-value service's methods, shared by kv_typed_server.cc and
// kv_typed_client.cc: the compiler checks that both ends agree on each
// method's argument and result types.
#ifndef COVERBS_EXAMPLES_KV_TYPED_H_
#define COVERBS_EXAMPLES_KV_TYPED_H_

#include <map>
#include <string>

#include "coverbs/coverbs.h"

struct PutArgs {
  std::string key, value;
  MSGPACK_DEFINE(key, value);
};
using KvMap = std::map<std::string, std::string>;

// Put -> the number of keys stored; Get -> the value (NOT_FOUND when
// absent); Snapshot -> a region holding the whole store (a msgpack KvMap)
// that only the calling connection may read, until Release(its token) or
// the connection's end (a connection holds at most
// cm::ConnectionOptions::max_exposures snapshots at once).
inline constexpr coverbs::rpc::Method<PutArgs, uint64_t> kPut{"Put"};
inline constexpr coverbs::rpc::Method<std::string, std::string> kGet{"Get"};
inline constexpr coverbs::rpc::Method<coverbs::RemoteRegion()> kSnapshot{
    "Snapshot"};
inline constexpr coverbs::rpc::Method<coverbs::RemoteRegion, bool> kRelease{
    "Release"};

#endif  // COVERBS_EXAMPLES_KV_TYPED_H_
