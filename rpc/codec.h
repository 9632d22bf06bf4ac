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
//    validated on decode.
//  - protobuf messages (anything with SerializeToString / ParseFromArray /
//    ByteSizeLong): the message's wire format. No protobuf dependency here:
//    the program that uses messages links libprotobuf.
//  - msgpack (msgpack-c++): structs with MSGPACK_DEFINE(...), and
//    std::vector / std::map / std::unordered_map / std::pair / std::tuple /
//    std::optional of such (or of strings and numbers). Other types opt in
//    by specializing rpc::UseMsgpack<T> (for msgpack adaptors). Decoding
//    is bounded by the payload: no container may claim more elements than
//    it has bytes, nesting stops at 64.
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
#include "rpc/payload.h"
#include "transport/device.h"

namespace coverbs::rpc {

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

template <typename T>
concept HasView = requires(const T& t) {
  { Codec<T>::View(t) } -> std::same_as<std::span<const std::byte>>;
};

template <>
struct Codec<std::string_view> {
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
    T m;
    if (b.size() > static_cast<size_t>(INT32_MAX) ||
        !m.ParseFromArray(b.data(), static_cast<int>(b.size()))) {
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
    const char* d = reinterpret_cast<const char*>(b.data());
    const size_t n = b.size();
    // Every element takes at least one byte (a map entry two): a count
    // above the payload's size is a lie, refused before msgpack allocates
    // for it.
    msgpack::unpack_limit limit(n, n / 2, n, n, n, 64);
    size_t off = 0;
    try {
      msgpack::object_handle oh =
          msgpack::unpack(d, n, off, nullptr, nullptr, limit);
      if (off != n) {
        return absl::InvalidArgumentError(
            absl::StrCat("msgpack payload of ", n, " bytes has ", n - off,
                         " bytes after its value"));
      }
      T v;
      oh.get().convert(v);
      return v;
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "msgpack payload of ", n, " bytes does not decode: ", e.what()));
    }
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
}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_CODEC_H_
