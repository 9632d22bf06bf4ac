// The msgpack decoder of rpc::Codec (rpc/codec.h): decodes a payload
// straight into the C++ value, without msgpack-c's object tree, and charges
// every allocation it makes to the decode budget before making it
// (rpc::DecodeOptions; rpc/README.md, "Decode budget").
//
// Why not msgpack::unpack + convert: the object tree costs 24 bytes per
// element (sizeof(msgpack::object)), 48 per map entry, so a payload of
// 1-byte nils or empty strings became a tree 24x its size before the
// conversion even looked at it (issue 36: a 64 MiB array of nils, 1.6 GiB).
//
// Decoded directly, with msgpack-c's conversion rules (same accepted
// input, same values): bool; integers (range checked); float, double (also
// from integers); std::string (str or bin); std::vector (std::vector of
// char / unsigned char / std::byte from bin or str, std::vector<bool>);
// std::map, std::unordered_map (a repeated key: the last value wins);
// std::pair; std::tuple; std::optional (nil is nullopt); and structs with
// MSGPACK_DEFINE (MSGPACK_DEFINE_ARRAY), whose members are found through
// their own msgpack_pack (FieldProbe below). Differences from msgpack-c:
// a struct or tuple must come as an array of exactly its arity (msgpack-c
// took fewer elements, leaving the rest default, and more, ignoring them).
//
// Any other type (a user adaptor, MSGPACK_DEFINE_MAP, enums with
// MSGPACK_ADD_ENUM, std::array...) goes through msgpack-c for that one
// value: a scalar through a msgpack::object on the stack, a container
// through msgpack::unpack of its bytes, charged the object tree's size
// (24 bytes per element) as the estimate of what it becomes.
#ifndef COVERBS_RPC_CODEC_MSGPACK_H_
#define COVERBS_RPC_CODEC_MSGPACK_H_

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "msgpack.hpp"

namespace coverbs::rpc::internal::mp {

// What the allocator takes for a block of n bytes (glibc: an 8-byte
// header, 16-byte granules, 32 bytes at least; a large block is mapped
// on its own, in whole pages).
constexpr size_t MallocCost(size_t n) {
  if (n == 0) return 0;
  if (n >= (size_t{128} << 10)) return (n + 16 + 4095) & ~size_t{4095};
  return std::max<size_t>(32, (n + 8 + 15) & ~size_t{15});
}
// std::string keeps up to 15 characters in place (libstdc++).
constexpr size_t StringHeap(size_t len) {
  return len <= 15 ? 0 : MallocCost(len + 1);
}

enum class Kind : uint8_t {
  kNil, kBool, kPos, kNeg, kFloat32, kFloat64, kStr, kBin, kExt, kArray, kMap
};

inline const char* KindName(Kind k) {
  switch (k) {
    case Kind::kNil: return "nil";
    case Kind::kBool: return "bool";
    case Kind::kPos: return "non-negative integer";
    case Kind::kNeg: return "negative integer";
    case Kind::kFloat32: return "float32";
    case Kind::kFloat64: return "float64";
    case Kind::kStr: return "str";
    case Kind::kBin: return "bin";
    case Kind::kExt: return "ext";
    case Kind::kArray: return "array";
    case Kind::kMap: return "map";
  }
  return "?";
}

// One value's header. Integers as msgpack-c keeps them: a non-negative
// value (of any encoding) is kPos with u, a negative one kNeg with i.
struct Head {
  Kind kind = Kind::kNil;
  bool b = false;
  uint64_t u = 0;      // kPos; kStr/kBin/kExt: length; kArray/kMap: count
  int64_t i = 0;       // kNeg
  double f = 0;        // kFloat32 / kFloat64
  const char* data = nullptr;  // kStr/kBin/kExt: the bytes (ext: after type)
  int8_t ext_type = 0;
};

// The decoding state: the input, the budget, the nesting, the first error.
// Read functions return false once an error is set.
class Decoder {
 public:
  static constexpr int kMaxDepth = 64;

  Decoder(std::span<const std::byte> in, size_t budget, size_t factor,
          size_t slack)
      : begin_(reinterpret_cast<const char*>(in.data())),
        p_(begin_),
        end_(begin_ + in.size()),
        budget_(budget),
        left_(budget),
        factor_(factor),
        slack_(slack) {}

  size_t size() const { return static_cast<size_t>(end_ - begin_); }
  size_t offset() const { return static_cast<size_t>(p_ - begin_); }
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  bool at_end() const { return p_ == end_; }
  const char* pos() const { return p_; }
  void set_pos(const char* p) { p_ = p; }
  const absl::Status& status() const { return error_; }
  size_t charged() const { return budget_ - left_; }

  // Charges `bytes` the decode is about to allocate; false (and the
  // RESOURCE_EXHAUSTED error naming the bound) when it exceeds the budget.
  bool Charge(size_t bytes) {
    if (bytes <= left_) {
      left_ -= bytes;
      return true;
    }
    return Fail(absl::ResourceExhaustedError(absl::StrCat(
        "msgpack payload of ", size(), " bytes would take more than ",
        budget_, " bytes to decode (the decode bound: ", factor_,
        "x the payload + ", slack_,
        " bytes, rpc::DecodeOptions::memory_factor); refused at offset ",
        offset(),
        " before allocating")));
  }

  bool Fail(absl::Status s) {
    if (error_.ok()) error_ = std::move(s);
    return false;
  }
  bool Invalid(absl::string_view what) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("msgpack payload of ", size(), " bytes does not decode: ",
                     what, " (at offset ", offset(), ")")));
  }
  bool TypeError(const Head& h, absl::string_view want) {
    return Invalid(absl::StrCat("expected ", want, ", found ", KindName(h.kind)));
  }

  bool Enter() {
    if (++depth_ > kMaxDepth) {
      return Invalid(absl::StrCat("nested deeper than ", kMaxDepth));
    }
    return true;
  }
  void Leave() { --depth_; }
  int depth() const { return depth_; }

  // The next value's header; consumes it (and a str/bin/ext's bytes).
  // A container's count is checked against the bytes left: every element
  // takes at least one byte (a map entry two).
  bool ReadHead(Head& h) {
    if (p_ >= end_) return Invalid("truncated");
    const uint8_t c = static_cast<uint8_t>(*p_++);
    if (c <= 0x7f) {
      h.kind = Kind::kPos;
      h.u = c;
      return true;
    }
    if (c >= 0xe0) {
      h.kind = Kind::kNeg;
      h.i = static_cast<int8_t>(c);
      return true;
    }
    if (c <= 0x8f) return Container(h, Kind::kMap, c & 0x0f);
    if (c <= 0x9f) return Container(h, Kind::kArray, c & 0x0f);
    if (c <= 0xbf) return Bytes(h, Kind::kStr, c & 0x1f);
    switch (c) {
      case 0xc0: h.kind = Kind::kNil; return true;
      case 0xc2: h.kind = Kind::kBool; h.b = false; return true;
      case 0xc3: h.kind = Kind::kBool; h.b = true; return true;
      case 0xc4: return SizedBytes<1>(h, Kind::kBin);
      case 0xc5: return SizedBytes<2>(h, Kind::kBin);
      case 0xc6: return SizedBytes<4>(h, Kind::kBin);
      case 0xc7: return SizedExt<1>(h);
      case 0xc8: return SizedExt<2>(h);
      case 0xc9: return SizedExt<4>(h);
      case 0xca: {
        uint32_t v = 0;
        if (!Fixed(v)) return false;
        float fl;
        std::memcpy(&fl, &v, 4);
        h.kind = Kind::kFloat32;
        h.f = fl;
        return true;
      }
      case 0xcb: {
        uint64_t v = 0;
        if (!Fixed(v)) return false;
        std::memcpy(&h.f, &v, 8);
        h.kind = Kind::kFloat64;
        return true;
      }
      case 0xcc: return Unsigned<uint8_t>(h);
      case 0xcd: return Unsigned<uint16_t>(h);
      case 0xce: return Unsigned<uint32_t>(h);
      case 0xcf: return Unsigned<uint64_t>(h);
      case 0xd0: return Signed<uint8_t, int8_t>(h);
      case 0xd1: return Signed<uint16_t, int16_t>(h);
      case 0xd2: return Signed<uint32_t, int32_t>(h);
      case 0xd3: return Signed<uint64_t, int64_t>(h);
      case 0xd4: return FixExt(h, 1);
      case 0xd5: return FixExt(h, 2);
      case 0xd6: return FixExt(h, 4);
      case 0xd7: return FixExt(h, 8);
      case 0xd8: return FixExt(h, 16);
      case 0xd9: return SizedBytes<1>(h, Kind::kStr);
      case 0xda: return SizedBytes<2>(h, Kind::kStr);
      case 0xdb: return SizedBytes<4>(h, Kind::kStr);
      case 0xdc: { uint16_t n = 0; return Fixed(n) && Container(h, Kind::kArray, n); }
      case 0xdd: { uint32_t n = 0; return Fixed(n) && Container(h, Kind::kArray, n); }
      case 0xde: { uint16_t n = 0; return Fixed(n) && Container(h, Kind::kMap, n); }
      case 0xdf: { uint32_t n = 0; return Fixed(n) && Container(h, Kind::kMap, n); }
      default:
        --p_;
        return Invalid("byte 0xc1 (never used) where a value starts");
    }
  }

  // Skips one value; *objects counts it and everything in it (a map entry
  // as two), what msgpack-c's tree would hold.
  bool Skip(uint64_t* objects) {
    Head h;
    if (!ReadHead(h)) return false;
    ++*objects;
    if (h.kind != Kind::kArray && h.kind != Kind::kMap) return true;
    if (!Enter()) return false;
    const uint64_t n = h.kind == Kind::kMap ? 2 * h.u : h.u;
    for (uint64_t k = 0; k < n; ++k) {
      if (!Skip(objects)) return false;
    }
    Leave();
    return true;
  }

 private:
  template <typename U>
  bool Fixed(U& v) {
    if (remaining() < sizeof(U)) return Invalid("truncated");
    U x;
    std::memcpy(&x, p_, sizeof(U));  // big endian on the wire
    if constexpr (std::endian::native == std::endian::little) {
      if constexpr (sizeof(U) == 2) x = __builtin_bswap16(x);
      if constexpr (sizeof(U) == 4) x = __builtin_bswap32(x);
      if constexpr (sizeof(U) == 8) x = __builtin_bswap64(x);
    }
    p_ += sizeof(U);
    v = x;
    return true;
  }
  template <typename U>
  bool Unsigned(Head& h) {
    U v = 0;
    if (!Fixed(v)) return false;
    h.kind = Kind::kPos;
    h.u = v;
    return true;
  }
  template <typename U, typename S>
  bool Signed(Head& h) {
    U v = 0;
    if (!Fixed(v)) return false;
    const S s = static_cast<S>(v);
    if (s < 0) {
      h.kind = Kind::kNeg;
      h.i = s;
    } else {
      h.kind = Kind::kPos;
      h.u = static_cast<uint64_t>(s);
    }
    return true;
  }
  bool Container(Head& h, Kind k, uint64_t n) {
    const uint64_t min_bytes = k == Kind::kMap ? 2 * n : n;
    if (min_bytes > remaining()) {
      return Invalid(absl::StrCat(KindName(k), " claims ", n, " elements in ",
                                  remaining(), " bytes"));
    }
    h.kind = k;
    h.u = n;
    return true;
  }
  bool Bytes(Head& h, Kind k, uint64_t n) {
    if (n > remaining()) {
      return Invalid(absl::StrCat(KindName(k), " claims ", n, " bytes, ",
                                  remaining(), " are left"));
    }
    h.kind = k;
    h.u = n;
    h.data = p_;
    p_ += n;
    return true;
  }
  template <int N>
  bool SizedBytes(Head& h, Kind k) {
    using U = std::conditional_t<N == 1, uint8_t,
                                 std::conditional_t<N == 2, uint16_t, uint32_t>>;
    U n = 0;
    return Fixed(n) && Bytes(h, k, n);
  }
  template <int N>
  bool SizedExt(Head& h) {
    using U = std::conditional_t<N == 1, uint8_t,
                                 std::conditional_t<N == 2, uint16_t, uint32_t>>;
    U n = 0;
    if (!Fixed(n)) return false;
    return FixExt(h, n);
  }
  bool FixExt(Head& h, uint64_t n) {
    if (remaining() < 1) return Invalid("truncated");
    h.ext_type = static_cast<int8_t>(*p_++);
    return Bytes(h, Kind::kExt, n);
  }

  const char* begin_;
  const char* p_;
  const char* end_;
  const size_t budget_;
  size_t left_;
  const size_t factor_, slack_;
  int depth_ = 0;
  absl::Status error_;
};

// In<T>::Read(d, out): decodes the next value into `out`, replacing what
// it held. The primary template: through msgpack-c (see the top).
template <typename T, typename = void>
struct In;

// Types the decoder can put a value into: what a struct's member may be.
template <typename T>
concept Decodable =
    !std::is_array_v<T> && !std::is_pointer_v<T> && !std::is_reference_v<T> &&
    std::is_default_constructible_v<T> && std::is_move_assignable_v<T>;

inline bool ReferenceAll(msgpack::type::object_type, size_t, void*) {
  return true;  // str/bin/ext point into the payload (it outlives the decode)
}

// A value of a type without a direct decoder: msgpack-c converts it.
template <typename T>
bool ReadViaMsgpack(Decoder& d, T& out) {
  const char* start = d.pos();
  Head h;
  if (!d.ReadHead(h)) return false;
  try {
    if (h.kind != Kind::kArray && h.kind != Kind::kMap && h.kind != Kind::kExt) {
      msgpack::object o;  // a scalar: no tree, no zone
      switch (h.kind) {
        case Kind::kNil: o.type = msgpack::type::NIL; break;
        case Kind::kBool: o.type = msgpack::type::BOOLEAN; o.via.boolean = h.b; break;
        case Kind::kPos: o.type = msgpack::type::POSITIVE_INTEGER; o.via.u64 = h.u; break;
        case Kind::kNeg: o.type = msgpack::type::NEGATIVE_INTEGER; o.via.i64 = h.i; break;
        case Kind::kFloat32: o.type = msgpack::type::FLOAT32; o.via.f64 = h.f; break;
        case Kind::kFloat64: o.type = msgpack::type::FLOAT64; o.via.f64 = h.f; break;
        case Kind::kStr:
          o.type = msgpack::type::STR;
          o.via.str.size = static_cast<uint32_t>(h.u);
          o.via.str.ptr = h.data;
          break;
        default:  // kBin
          o.type = msgpack::type::BIN;
          o.via.bin.size = static_cast<uint32_t>(h.u);
          o.via.bin.ptr = h.data;
          break;
      }
      o.convert(out);
      return true;
    }
    // A container (or ext): msgpack-c's tree for its bytes, charged.
    d.set_pos(start);
    uint64_t objects = 0;
    if (!d.Skip(&objects)) return false;
    if (!d.Charge(objects * sizeof(msgpack::object))) return false;
    const size_t len = static_cast<size_t>(d.pos() - start);
    size_t off = 0;
    msgpack::unpack_limit limit(len, len / 2, len, len, len,
                                Decoder::kMaxDepth);
    msgpack::object_handle oh =
        msgpack::unpack(start, len, off, &ReferenceAll, nullptr, limit);
    oh.get().convert(out);
    return true;
  } catch (const std::exception& e) {
    return d.Invalid(absl::StrCat("converting a ", KindName(h.kind), ": ",
                                  e.what()));
  }
}

template <typename T, typename>
struct In {
  static bool Read(Decoder& d, T& out) { return ReadViaMsgpack(d, out); }
};

template <>
struct In<bool> {
  static bool Read(Decoder& d, bool& out) {
    Head h;
    if (!d.ReadHead(h)) return false;
    if (h.kind != Kind::kBool) return d.TypeError(h, "a bool");
    out = h.b;
    return true;
  }
};

template <typename T>
concept PlainInteger =
    std::is_integral_v<T> && !std::is_same_v<T, bool> &&
    !std::is_same_v<T, wchar_t> && !std::is_same_v<T, char8_t> &&
    !std::is_same_v<T, char16_t> && !std::is_same_v<T, char32_t>;

template <PlainInteger T>
struct In<T> {
  static bool Read(Decoder& d, T& out) {
    Head h;
    if (!d.ReadHead(h)) return false;
    if (h.kind == Kind::kPos) {
      if (h.u > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
        return d.Invalid(absl::StrCat(h.u, " is out of range"));
      }
      out = static_cast<T>(h.u);
      return true;
    }
    if (h.kind == Kind::kNeg && std::is_signed_v<T>) {
      if (h.i < static_cast<int64_t>(std::numeric_limits<T>::min())) {
        return d.Invalid(absl::StrCat(h.i, " is out of range"));
      }
      out = static_cast<T>(h.i);
      return true;
    }
    return d.TypeError(h, std::is_signed_v<T> ? "an integer"
                                              : "a non-negative integer");
  }
};

template <std::floating_point T>
struct In<T> {
  static bool Read(Decoder& d, T& out) {
    Head h;
    if (!d.ReadHead(h)) return false;
    switch (h.kind) {
      case Kind::kFloat32:
      case Kind::kFloat64: out = static_cast<T>(h.f); return true;
      case Kind::kPos: out = static_cast<T>(h.u); return true;
      case Kind::kNeg: out = static_cast<T>(h.i); return true;
      default: return d.TypeError(h, "a number");
    }
  }
};

template <>
struct In<std::string> {
  static bool Read(Decoder& d, std::string& out) {
    Head h;
    if (!d.ReadHead(h)) return false;
    if (h.kind != Kind::kStr && h.kind != Kind::kBin) {
      return d.TypeError(h, "a str or bin");
    }
    if (!d.Charge(StringHeap(h.u))) return false;
    out.assign(h.data, h.u);
    return true;
  }
};

// Reads an array header for a container of `what`.
inline bool ReadArray(Decoder& d, uint64_t& n, absl::string_view what) {
  Head h;
  if (!d.ReadHead(h)) return false;
  if (h.kind != Kind::kArray) return d.TypeError(h, what);
  n = h.u;
  return true;
}

template <typename E, typename A>
struct In<std::vector<E, A>> {
  static bool Read(Decoder& d, std::vector<E, A>& out) {
    uint64_t n = 0;
    if (!ReadArray(d, n, "an array")) return false;
    // n <= the bytes left (ReadHead), so this cannot overflow.
    if (!d.Charge(MallocCost(n * sizeof(E))) || !d.Enter()) return false;
    out.clear();
    out.resize(n);
    for (E& e : out) {
      if (!In<E>::Read(d, e)) return false;
    }
    d.Leave();
    return true;
  }
};

template <typename A>
struct In<std::vector<bool, A>> {
  static bool Read(Decoder& d, std::vector<bool, A>& out) {
    uint64_t n = 0;
    if (!ReadArray(d, n, "an array")) return false;
    if (!d.Charge(MallocCost((n + 7) / 8)) || !d.Enter()) return false;
    out.assign(n, false);
    for (uint64_t k = 0; k < n; ++k) {
      bool b;
      if (!In<bool>::Read(d, b)) return false;
      out[k] = b;
    }
    d.Leave();
    return true;
  }
};

// std::vector of char, unsigned char, std::byte: bin or str (msgpack-c's
// adaptors for them).
template <typename B>
concept ByteLike = std::is_same_v<B, char> || std::is_same_v<B, unsigned char> ||
                   std::is_same_v<B, std::byte>;

template <ByteLike B, typename A>
struct In<std::vector<B, A>> {
  static bool Read(Decoder& d, std::vector<B, A>& out) {
    Head h;
    if (!d.ReadHead(h)) return false;
    if (h.kind != Kind::kBin && h.kind != Kind::kStr) {
      return d.TypeError(h, "a bin or str");
    }
    if (!d.Charge(MallocCost(h.u))) return false;
    out.resize(h.u);
    if (h.u > 0) std::memcpy(out.data(), h.data, h.u);
    return true;
  }
};

// std::map / std::unordered_map: per entry a node (the tree's links or the
// hash chain's, the key and the value) and, for the hash map, its bucket.
template <typename M, size_t kNodeLinks, size_t kPerEntry>
bool ReadMap(Decoder& d, M& out) {
  using K = typename M::key_type;
  using V = typename M::mapped_type;
  Head h;
  if (!d.ReadHead(h)) return false;
  if (h.kind != Kind::kMap) return d.TypeError(h, "a map");
  const uint64_t n = h.u;
  constexpr size_t kNode =
      MallocCost(kNodeLinks + sizeof(typename M::value_type)) + kPerEntry;
  if (!d.Charge(n * kNode) || !d.Enter()) return false;
  M tmp;
  for (uint64_t k = 0; k < n; ++k) {
    K key{};
    if (!In<K>::Read(d, key)) return false;
    V& slot = tmp[std::move(key)];
    if (!In<V>::Read(d, slot)) return false;
  }
  d.Leave();
  out = std::move(tmp);
  return true;
}

template <typename K, typename V, typename C, typename A>
struct In<std::map<K, V, C, A>> {
  static bool Read(Decoder& d, std::map<K, V, C, A>& out) {
    return ReadMap<std::map<K, V, C, A>, 32, 0>(d, out);
  }
};

template <typename K, typename V, typename H, typename E, typename A>
struct In<std::unordered_map<K, V, H, E, A>> {
  static bool Read(Decoder& d, std::unordered_map<K, V, H, E, A>& out) {
    return ReadMap<std::unordered_map<K, V, H, E, A>, 16, 16>(d, out);
  }
};

template <typename T>
struct In<std::optional<T>> {
  static bool Read(Decoder& d, std::optional<T>& out) {
    if (d.remaining() > 0 && static_cast<uint8_t>(*d.pos()) == 0xc0) {
      d.set_pos(d.pos() + 1);
      out.reset();
      return true;
    }
    if (!out.has_value()) out.emplace();
    return In<T>::Read(d, *out);
  }
};

// An array of exactly `arity` elements (structs, tuples, pairs).
inline bool ReadArity(Decoder& d, uint64_t arity, absl::string_view what) {
  Head h;
  if (!d.ReadHead(h)) return false;
  if (h.kind != Kind::kArray) {
    return d.TypeError(h, absl::StrCat("an array (", what, ")"));
  }
  const uint64_t n = h.u;
  if (n != arity) {
    return d.Invalid(absl::StrCat(what, " of ", arity,
                                  " element(s) came as an array of ", n));
  }
  return true;
}

template <typename A, typename B>
struct In<std::pair<A, B>> {
  static bool Read(Decoder& d, std::pair<A, B>& out) {
    if (!ReadArity(d, 2, "a pair") || !d.Enter()) return false;
    if (!In<A>::Read(d, out.first) || !In<B>::Read(d, out.second)) return false;
    d.Leave();
    return true;
  }
};

template <typename... T>
struct In<std::tuple<T...>> {
  static bool Read(Decoder& d, std::tuple<T...>& out) {
    if (!ReadArity(d, sizeof...(T), "a tuple") || !d.Enter()) return false;
    const bool ok = std::apply(
        [&d](T&... e) { return (In<T>::Read(d, e) && ...); }, out);
    if (!ok) return false;
    d.Leave();
    return true;
  }
};

// --- Structs with MSGPACK_DEFINE: their members through msgpack_pack.
//
// MSGPACK_DEFINE(a, b) defines msgpack_pack(Packer&) as
// `pk.pack_array(2); pk.pack(a); pk.pack(b);`, each a reference to the
// member itself. FieldProbe is such a Packer (a msgpack::packer over a
// stream that only notes that something was written, for every other
// packer call): pack_array checks the arity against the wire, and each
// pack(member) decodes the next value into that member, which is checked
// to lie inside the object being decoded (the value is not const: only
// msgpack_pack's view of it is). A msgpack_pack of another shape
// (MSGPACK_DEFINE_MAP, hand-written ones that pack temporaries or write
// anything else) is found by a dry run on a default-constructed object,
// once per type, and that type goes through msgpack-c instead.

struct NullStream {
  bool* wrote;
  void write(const char*, size_t) { *wrote = true; }
};

struct ProbeStream {
  bool wrote = false;
  NullStream stream{&wrote};
};

template <typename Owner>
class FieldProbe : private ProbeStream, public msgpack::packer<NullStream> {
 public:
  // d == null: the dry run (no input; only the shape is checked).
  FieldProbe(const Owner* owner, Decoder* d)
      : msgpack::packer<NullStream>(ProbeStream::stream),
        lo_(reinterpret_cast<const char*>(owner)),
        hi_(lo_ + sizeof(Owner)),
        d_(d) {}

  FieldProbe& pack_array(uint32_t n) {
    if (arrays_++ != 0 || fields_ != 0) {
      plain_ = false;
      return *this;
    }
    declared_ = n;
    if (d_ != nullptr && ok_) {
      ok_ = mp::ReadArity(*d_, n, "a struct") && d_->Enter();
    }
    return *this;
  }
  template <typename F>
  FieldProbe& pack(const F& f) {
    ++fields_;
    if constexpr (!Decodable<F>) {
      plain_ = false;
    } else {
      const char* a = reinterpret_cast<const char*>(std::addressof(f));
      if (arrays_ != 1 || a < lo_ || a + sizeof(F) > hi_) plain_ = false;
      if (d_ != nullptr && ok_ && plain_) {
        ok_ = In<F>::Read(*d_, const_cast<F&>(f));
      }
    }
    return *this;
  }

  // The shape was one pack_array(n) and then n members, nothing else.
  bool plain() const {
    return plain_ && !wrote && arrays_ == 1 && fields_ == declared_;
  }
  bool ok() const { return ok_; }

 private:
  const char* lo_;
  const char* hi_;
  Decoder* d_;
  uint32_t arrays_ = 0, fields_ = 0, declared_ = 0;
  bool plain_ = true;
  bool ok_ = true;
};

template <typename T>
concept DefinedStruct = std::is_class_v<T> && Decodable<T> &&
    requires(const T& t, T& m, FieldProbe<T>& p, const msgpack::object& o,
             msgpack::object* po, msgpack::zone& z) {
  t.msgpack_pack(p);
  m.msgpack_unpack(o);
  t.msgpack_object(po, z);
};

// Whether T's msgpack_pack is MSGPACK_DEFINE's plain shape (dry run, once).
template <DefinedStruct T>
bool PlainStruct() {
  static const bool plain = [] {
    T t{};
    FieldProbe<T> probe(&t, nullptr);
    t.msgpack_pack(probe);
    return probe.plain();
  }();
  return plain;
}

template <DefinedStruct T>
struct In<T> {
  static bool Read(Decoder& d, T& out) {
    if (!PlainStruct<T>()) return ReadViaMsgpack(d, out);
    FieldProbe<T> probe(&out, &d);
    out.msgpack_pack(probe);
    if (!probe.ok()) return false;
    if (!probe.plain()) {  // a shape the dry run did not see
      return d.Fail(absl::InternalError(
          "a MSGPACK_DEFINE struct's msgpack_pack changed its shape"));
    }
    d.Leave();
    return true;
  }
};

// The whole payload as one T. `budget` bounds what the decode allocates
// (including sizeof(T)); factor and slack only name it in errors.
// *charged (optional): what was charged (tests compare it with the heap
// the decode really took).
template <typename T>
absl::Status Decode(std::span<const std::byte> b, size_t budget, size_t factor,
                    size_t slack, T& out, size_t* charged = nullptr) {
  Decoder d(b, budget, factor, slack);
  const bool ok = d.Charge(sizeof(T)) && In<T>::Read(d, out);
  if (charged != nullptr) *charged = d.charged();
  if (!ok) return d.status();
  if (!d.at_end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("msgpack payload of ", d.size(), " bytes has ",
                     d.remaining(), " bytes after its value"));
  }
  return absl::OkStatus();
}

}  // namespace coverbs::rpc::internal::mp

#endif  // COVERBS_RPC_CODEC_MSGPACK_H_
