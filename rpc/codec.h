// rpc::Codec<T>: how a typed method's argument or result travels as the
// payload of a byte method (rpc/typed.h uses it; rpc/README.md, "Typed
// methods", has the table).
//
// Chosen per type, first match wins:
//  - rpc::Payload: the bytes as they are (no codec).
//  - std::string_view, std::span<const std::byte>: a view of the payload,
//    no copy (as a handler's argument it is valid while the handler runs;
//    not as a client's result, which must own its bytes).
//  - std::string: the bytes.
//  - transport::RemoteRegion (a token from Expose): its 20-byte encoding,
//    validated on decode (inside a msgpack value, a struct's member or a
//    vector's element: a bin of those 20 bytes; see below).
//  - protobuf messages (anything with SerializeToString / ParseFromArray /
//    ByteSizeLong): the message's wire format. No protobuf dependency here:
//    the program that uses messages links libprotobuf. Before parsing, a
//    pass over the bytes estimates what the parse allocates and refuses
//    the payload past the decode bound (rpc/codec_protobuf.h).
//  - msgpack (msgpack-c++): structs with MSGPACK_DEFINE(...), and
//    std::vector / std::map / std::unordered_map / std::pair / std::tuple /
//    std::optional of such (or of strings and numbers). Other types opt in
//    by specializing rpc::UseMsgpack<T> (for msgpack adaptors). Decoded
//    straight into the value, no object tree, each allocation charged to
//    the decode bound before it is made (rpc/codec_msgpack.h); no
//    container may claim more elements than it has bytes, nesting stops at
//    64, and a struct (or tuple) must come as an array of exactly its
//    number of members.
//  - trivially copyable types (not pointers): their object bytes, in host
//    byte order, sent from the object itself (no copy on the client side)
//    and checked for exact size on decode. Padding bytes travel as they
//    are: zero-initialize structs with padding ({}) to send no stale bytes.
//  Anything else fails to compile naming rpc::Codec; a user specialization
//  `template <> struct rpc::Codec<MyType>` with the members below wins.
//
// A Codec<T> has:
//   static absl::StatusOr<T> Decode(std::span<const std::byte> bytes);
//   static void Encode(const T& value, std::string& out);  // appends
// and, for types whose bytes can be sent in place,
//   static std::span<const std::byte> View(const T& value);
// Codecs whose decode is at most a copy of the bytes declare
//   static constexpr bool kCopiesOnly = true;
// (typed methods decode the others off the reactor when large), and,
// where decoding may cost more memory than the bytes (msgpack,
// protobuf; a user codec may have it too),
//   static absl::StatusOr<T> Decode(std::span<const std::byte> bytes,
//                                   const DecodeOptions& options);
// which refuses, with RESOURCE_EXHAUSTED naming the bound and before
// allocating it, a payload whose decode would take more than
// options.MemoryLimit(bytes.size()) bytes (Decode(bytes) uses the default
// options). rpc/README.md, "Decode budget".
#ifndef COVERBS_RPC_CODEC_H_
#define COVERBS_RPC_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "msgpack.hpp"
#include "rpc/codec_msgpack.h"
#include "rpc/codec_protobuf.h"
#include "rpc/payload.h"
#include "transport/device.h"

// transport::RemoteRegion as a msgpack value (a member of a MSGPACK_DEFINE
// struct, an element of a vector or of a method's argument list): a bin of
// its 20-byte Encode(). Not a codec choice: a RemoteRegion that is the
// whole argument or result keeps its own Codec below (the 20 bytes, no
// msgpack header). Decoding goes through RemoteRegion::Decode, so a bin of
// another length, an empty or a wrapping range is refused like any other
// bad value; an empty region does not travel (std::optional<RemoteRegion>
// does: nil when absent). rpc's decoder reads it with In<RemoteRegion>
// below, without exceptions; msgpack-c's convert (reached through
// msgpack::unpack, or a type decoded by its own adaptor) throws
// msgpack::type_error, as its adaptors do, which rpc's decoder catches.
namespace msgpack {
MSGPACK_API_VERSION_NAMESPACE(MSGPACK_DEFAULT_API_NS) {
  namespace adaptor {

  template <>
  struct convert<coverbs::transport::RemoteRegion> {
    const msgpack::object& operator()(
        const msgpack::object& o, coverbs::transport::RemoteRegion& v) const {
      if (o.type != msgpack::type::BIN) throw msgpack::type_error();
      auto r = coverbs::transport::RemoteRegion::Decode(
          std::as_bytes(std::span<const char>(o.via.bin.ptr, o.via.bin.size)));
      if (!r.ok()) throw msgpack::type_error();
      v = *r;
      return o;
    }
  };

  template <>
  struct pack<coverbs::transport::RemoteRegion> {
    template <typename Stream>
    msgpack::packer<Stream>& operator()(
        msgpack::packer<Stream>& o,
        const coverbs::transport::RemoteRegion& v) const {
      const auto e = v.Encode();
      o.pack_bin(static_cast<uint32_t>(e.size()));
      o.pack_bin_body(reinterpret_cast<const char*>(e.data()),
                      static_cast<uint32_t>(e.size()));
      return o;
    }
  };

  template <>
  struct object_with_zone<coverbs::transport::RemoteRegion> {
    void operator()(msgpack::object::with_zone& o,
                    const coverbs::transport::RemoteRegion& v) const {
      const auto e = v.Encode();
      char* p = static_cast<char*>(
          o.zone.allocate_align(e.size(), MSGPACK_ZONE_ALIGNOF(char)));
      std::memcpy(p, e.data(), e.size());
      o.type = msgpack::type::BIN;
      o.via.bin.ptr = p;
      o.via.bin.size = static_cast<uint32_t>(e.size());
    }
  };

  }  // namespace adaptor
}  // MSGPACK_API_VERSION_NAMESPACE(MSGPACK_DEFAULT_API_NS)
}  // namespace msgpack

namespace coverbs::rpc::internal::mp {

// rpc's decoder: the bin, checked by RemoteRegion::Decode (see above).
template <>
struct In<transport::RemoteRegion> {
  static bool Read(Decoder& d, transport::RemoteRegion& out) {
    Head h;
    if (!d.ReadHead(h)) return false;
    if (h.kind != Kind::kBin) return d.TypeError(h, "a bin (a RemoteRegion)");
    absl::StatusOr<transport::RemoteRegion> r = transport::RemoteRegion::Decode(
        std::as_bytes(std::span<const char>(h.data, h.u)));
    if (!r.ok()) return d.Invalid(r.status().message());
    out = *r;
    return true;
  }
};

}  // namespace coverbs::rpc::internal::mp

namespace coverbs::rpc {

// What decoding a peer's payload may cost: the decode bound (per server,
// ServerOptions::decode, or per method, Server::Register's last argument;
// rpc/README.md, "Decode budget").
struct DecodeOptions {
  // Memory: a decode may allocate at most memory_factor x the payload's
  // bytes + memory_slack (protobuf: protobuf_memory_factor), an estimate
  // made before allocating (msgpack charges each allocation as it decodes;
  // protobuf is scanned before it is parsed); past that the call fails
  // with RESOURCE_EXHAUSTED naming the bound.
  //  - msgpack, 8x: admits vectors of floats, doubles and 32- or 64-bit
  //    integers (8x for int64 of one byte each on the wire), strings of 3
  //    characters or more, structs of such; refuses nils or empty strings
  //    as strings (32x), empty arrays as vectors (24x). Dense legitimate
  //    payloads (many short map entries, 1-2 character strings) cost
  //    10-20x: raise it for their method.
  //  - protobuf, 16x: libprotobuf itself spends 7-8x on a batch of small
  //    sub-messages with a few fields each (an object, a std::string per
  //    string field, an array per repeated one), 17x on one holding one
  //    small number each; an empty sub-message is 2 bytes for ~100 (50x),
  //    an unknown field 2 bytes for 48 (24x).
  // The bound is per decode; calls decode concurrently (up to
  // ServerOptions::max_concurrent_calls per connection).
  uint32_t memory_factor = 8;
  uint32_t protobuf_memory_factor = 16;
  size_t memory_slack = 64 << 10;
  // Time: a typed method's argument above this many bytes (msgpack,
  // protobuf, user codecs) is decoded on a pool thread (core/offload.h),
  // not on the connection's reactor; smaller ones decode inline. 0: every
  // one offloaded; SIZE_MAX: never.
  size_t offload_above = 64 << 10;

  // The most a decode of `payload` bytes may allocate.
  size_t MemoryLimit(size_t payload) const {
    return Limit(payload, memory_factor);
  }
  size_t ProtobufMemoryLimit(size_t payload) const {
    return Limit(payload, protobuf_memory_factor);
  }

 private:
  size_t Limit(size_t payload, uint32_t factor) const {
    const unsigned __int128 l =
        static_cast<unsigned __int128>(payload) * factor + memory_slack;
    return l > SIZE_MAX ? SIZE_MAX : static_cast<size_t>(l);
  }
};

// True for types that travel as msgpack (see above); specialize for a type
// with a msgpack adaptor of its own.
template <typename T>
    struct UseMsgpack
    : std::bool_constant <
      requires(const T& t, msgpack::packer<msgpack::sbuffer>& pk) {
  t.msgpack_pack(pk);
} > {};
template <typename T, typename A>
struct UseMsgpack<std::vector<T, A>>
    : std::bool_constant<!std::is_same_v<T, std::byte>> {};
template <typename K, typename V, typename C, typename A>
struct UseMsgpack<std::map<K, V, C, A>> : std::true_type {};
template <typename K, typename V, typename H, typename E, typename A>
struct UseMsgpack<std::unordered_map<K, V, H, E, A>> : std::true_type {};
template <typename A, typename B>
struct UseMsgpack<std::pair<A, B>> : std::true_type {};
template <typename... T>
struct UseMsgpack<std::tuple<T...>> : std::true_type {};
template <typename T>
struct UseMsgpack<std::optional<T>> : std::true_type {};

// The types an argument of a method with none or several arguments may
// have (rpc/typed.h, Method<R(A...)>): each travels as one msgpack value
// of the request's array. bool, integers, floating point, std::string,
// std::string_view (decoded as a view of the request), RemoteRegion (a
// 20-byte bin, above), and every UseMsgpack type.
template <typename T>
concept MsgpackArg = std::is_same_v<T, bool> || internal::mp::PlainInteger<T> ||
    std::is_floating_point_v<T> || std::is_same_v<T, std::string> ||
    std::is_same_v<T, std::string_view> ||
    std::is_same_v<T, transport::RemoteRegion> || UseMsgpack<T>::value;

template <typename T>
concept ProtobufMessage = requires(const T& t, T& m, std::string* s,
                                   const void* d, int n) {
  { t.SerializeToString(s) } -> std::same_as<bool>;
  { m.ParseFromArray(d, n) } -> std::same_as<bool>;
  t.ByteSizeLong();
};

template <typename T>
concept ByteView = std::is_same_v<T, std::string_view> ||
    std::is_same_v<T, std::span<const std::byte>>;

template <typename T>
concept TrivialMessage =
    std::is_trivially_copyable_v<T> && !std::is_pointer_v<T> &&
    !std::is_member_pointer_v<T> && !ByteView<T> && !UseMsgpack<T>::value &&
    !std::is_empty_v<T>;

template <typename T>
struct Codec;  // specialized below (or by the user)

template <typename T>
concept HasCodec = requires(std::span<const std::byte> b) {
  { Codec<T>::Decode(b) } -> std::same_as<absl::StatusOr<T>>;
};

// Codecs whose decode takes DecodeOptions (msgpack, protobuf, user codecs
// that declare it).
template <typename T>
concept HasBoundedDecode = requires(std::span<const std::byte> b,
                                    const DecodeOptions& o) {
  { Codec<T>::Decode(b, o) } -> std::same_as<absl::StatusOr<T>>;
};

template <typename T>
concept HasView = requires(const T& t) {
  { Codec<T>::View(t) } -> std::same_as<std::span<const std::byte>>;
};

template <>
struct Codec<std::string_view> {
  static constexpr bool kCopiesOnly = true;
  static absl::StatusOr<std::string_view> Decode(std::span<const std::byte> b) {
    return std::string_view(reinterpret_cast<const char*>(b.data()), b.size());
  }
  static std::span<const std::byte> View(std::string_view v) {
    return std::as_bytes(std::span(v));
  }
  static void Encode(std::string_view v, std::string& out) { out.append(v); }
};

template <>
struct Codec<std::span<const std::byte>> {
  static constexpr bool kCopiesOnly = true;
  static absl::StatusOr<std::span<const std::byte>> Decode(
      std::span<const std::byte> b) {
    return b;
  }
  static std::span<const std::byte> View(std::span<const std::byte> v) {
    return v;
  }
  static void Encode(std::span<const std::byte> v, std::string& out) {
    out.append(reinterpret_cast<const char*>(v.data()), v.size());
  }
};

template <>
struct Codec<std::string> {
  static constexpr bool kCopiesOnly = true;
  static absl::StatusOr<std::string> Decode(std::span<const std::byte> b) {
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  static std::span<const std::byte> View(const std::string& v) {
    return std::as_bytes(std::span(v));
  }
  static void Encode(const std::string& v, std::string& out) { out.append(v); }
};

template <>
struct Codec<transport::RemoteRegion> {
  static constexpr bool kCopiesOnly = true;
  static absl::StatusOr<transport::RemoteRegion> Decode(
      std::span<const std::byte> b) {
    return transport::RemoteRegion::Decode(b);
  }
  static void Encode(const transport::RemoteRegion& v, std::string& out) {
    auto e = v.Encode();
    out.append(reinterpret_cast<const char*>(e.data()), e.size());
  }
};

template <TrivialMessage T>
requires(!std::is_same_v<T, transport::RemoteRegion>) struct Codec<T> {
  static constexpr bool kCopiesOnly = true;
  static absl::StatusOr<T> Decode(std::span<const std::byte> b) {
    if (b.size() != sizeof(T)) {
      return absl::InvalidArgumentError(
          absl::StrCat("payload of ", b.size(), " bytes where a ", sizeof(T),
                       "-byte trivially copyable value was expected"));
    }
    T v;
    std::memcpy(static_cast<void*>(&v), b.data(), sizeof(T));  // alignment
    return v;
  }
  static std::span<const std::byte> View(const T& v) {
    return std::as_bytes(std::span<const T, 1>(&v, 1));
  }
  static void Encode(const T& v, std::string& out) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
};

template <ProtobufMessage T>
struct Codec<T> {
  static absl::StatusOr<T> Decode(std::span<const std::byte> b) {
    return Decode(b, DecodeOptions());
  }
  static absl::StatusOr<T> Decode(std::span<const std::byte> b,
                                  const DecodeOptions& o) {
    T m;
    if (b.size() > static_cast<size_t>(INT32_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "payload of ", b.size(), " bytes is not a valid protobuf ",
          std::string(m.GetTypeName()), ": above 2 GiB"));
    }
    // Nothing is allocated for a payload this refuses.
    absl::Status fits = internal::pb::Check<T>(
        b, std::string(m.GetTypeName()), o.ProtobufMemoryLimit(b.size()),
        o.protobuf_memory_factor, o.memory_slack);
    if (!fits.ok()) return fits;
    if (!m.ParseFromArray(b.data(), static_cast<int>(b.size()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "payload of ", b.size(), " bytes is not a valid protobuf ",
          std::string(m.GetTypeName())));
    }
    return m;
  }
  static void Encode(const T& v, std::string& out) {
    std::string s;
    v.SerializeToString(&s);
    if (out.empty()) {
      out = std::move(s);
    } else {
      out.append(s);
    }
  }
};

namespace internal {
// msgpack::pack's stream: appends to a string.
struct StringSink {
  std::string* out;
  void write(const char* d, size_t n) { out->append(d, n); }
};
}  // namespace internal

template <typename T>
requires(UseMsgpack<T>::value) struct Codec<T> {
  static absl::StatusOr<T> Decode(std::span<const std::byte> b) {
    return Decode(b, DecodeOptions());
  }
  static absl::StatusOr<T> Decode(std::span<const std::byte> b,
                                  const DecodeOptions& o) {
    T v{};
    absl::Status s = internal::mp::Decode(b, o.MemoryLimit(b.size()),
                                          o.memory_factor, o.memory_slack, v);
    if (!s.ok()) return s;
    return v;
  }
  static void Encode(const T& v, std::string& out) {
    internal::StringSink sink{&out};
    msgpack::pack(sink, v);
  }
};

namespace internal {

// A typed value as a payload to send: a view of the value itself where its
// codec has one, else its encoding (owned here).
template <typename T>
class EncodedArg {
 public:
  explicit EncodedArg(const T& v) {
    if constexpr (HasView<T>) {
      view_ = Codec<T>::View(v);
    } else {
      Codec<T>::Encode(v, owned_);
      view_ = std::as_bytes(std::span(owned_));
    }
  }
  EncodedArg(const EncodedArg&) = delete;
  std::span<const std::byte> view() const { return view_; }

 private:
  std::string owned_;
  std::span<const std::byte> view_;
};

// A typed method's none or several arguments (rpc/typed.h,
// Method<R(A...)>), decoded: one msgpack array of exactly sizeof...(A)
// elements (mp::In below; "an argument list of N element(s) came as an
// array of M" otherwise).
template <typename... A>
struct ArgList {
  std::tuple<A...> values;
};

// A typed result as a payload to return (owns its bytes).
template <typename T>
Payload ToPayload(T&& v) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, Payload>) {
    return std::move(v);
  } else if constexpr (std::is_same_v<U, std::string>) {
    return Payload(std::string(std::forward<T>(v)));
  } else if constexpr (HasView<U>) {
    return Payload::Copy(Codec<U>::View(v));
  } else {
    std::string s;
    Codec<U>::Encode(v, s);
    return Payload(std::move(s));
  }
}

}  // namespace internal

namespace internal::mp {

template <typename... A>
struct In<ArgList<A...>> {
  static bool Read(Decoder& d, ArgList<A...>& out) {
    if (!ReadArity(d, sizeof...(A), "an argument list") || !d.Enter()) {
      return false;
    }
    const bool ok = std::apply(
        [&d](A&... e) { return (In<A>::Read(d, e) && ...); }, out.values);
    if (!ok) return false;
    d.Leave();
    return true;
  }
};

}  // namespace internal::mp
}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_CODEC_H_
