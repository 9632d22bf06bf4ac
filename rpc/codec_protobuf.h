// The protobuf side of rpc::Codec's decode bound (rpc/codec.h; rpc/README.md,
// "Decode budget"): before ParseFromArray allocates anything, one pass over
// the wire format, led by the message's descriptor, adds up what the parse
// will allocate and refuses the payload when that passes the budget.
//
// Why: an empty sub-message is 2 bytes on the wire and a whole message in
// memory (its object, a pointer in the RepeatedPtrField, the allocator's
// header: ~100 bytes for a small one), so a 64 MiB batch of them parsed
// into 2.4 GiB (issue 36); unknown fields amplify too (a 2-byte unknown
// varint is a 16-byte UnknownField, an empty unknown length-delimited one
// also a new std::string).
//
// The estimate, per field occurrence (libprotobuf 3.21's layout, no arena):
//  - a singular scalar: nothing (it is in its message); a repeated one, 3x
//    its size (RepeatedField doubles: while it grows, the old array and
//    the new one twice its size are both held), packed ones counted
//    element by element (packed fixed-size ones are reserved at once); a
//    proto2 enum as an unknown field (an unknown value goes there);
//  - a string/bytes field: a std::string of its own (48) and its bytes
//    beyond 15; repeated, also 24 for the pointer (doubling, as above);
//  - a message or group: its object (estimated from its fields) and
//    what is in it; repeated, also 24; a map entry also its node (64);
//  - an unknown field (or a known one with another wire type): 48 (a
//    16-byte UnknownField in a doubling vector), and a length-delimited
//    one a std::string too; an unknown group its set; a message's first
//    unknown field also the message's unknown-field set (48).
// Extensions are charged as unknown fields. It also checks the wire
// structure the parse would refuse (varints, lengths, groups, field 0,
// wire types 6 and 7, nesting deeper than 100).
//
// No protobuf header here, as in rpc/codec.h: everything protobuf is
// reached through the message type's own members (dependent names), so only
// a program that uses messages needs libprotobuf. Messages without
// descriptors (the lite runtime) are scanned without a schema: every field
// costs what an unknown one does, and a length-delimited one whose bytes
// read as a message is also scanned as one (its fields charged the same
// way): a conservative estimate.
#ifndef COVERBS_RPC_CODEC_PROTOBUF_H_
#define COVERBS_RPC_CODEC_PROTOBUF_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "rpc/codec_msgpack.h"  // MallocCost, StringHeap

namespace coverbs::rpc::internal::pb {

using mp::MallocCost;
using mp::StringHeap;

enum class FieldKind : uint8_t {
  kVarint,
  kFixed32,
  kFixed64,
  kString,
  kMessage,
  kGroup,
  kMapEntry,
};

struct Plan;

struct Field {
  FieldKind kind = FieldKind::kVarint;
  bool repeated = false;
  bool packable = false;
  bool closed_enum = false;
  uint32_t elem = 0;          // a scalar's size in memory
  const Plan* sub = nullptr;  // kMessage, kGroup, kMapEntry
};

// One message type: its object's size and its fields by number.
struct Plan {
  size_t object_size = 0;
  std::vector<int32_t> dense;  // number -> index in fields, -1: none
  std::vector<std::pair<uint32_t, Field>> fields;  // sorted by number
  const Field* Find(uint32_t number) const {
    if (number < dense.size()) {
      const int32_t i = dense[number];
      return i < 0 ? nullptr : &fields[i].second;
    }
    auto it = std::lower_bound(
        fields.begin(), fields.end(), number,
        [](const std::pair<uint32_t, Field>& f, uint32_t n) { return f.first < n; });
    return it != fields.end() && it->first == number ? &it->second : nullptr;
  }
};

constexpr size_t kUnknownField = 48;   // UnknownField (16), vector doubling
// A message's first unknown field also makes its unknown-field set (the
// InternalMetadata container: the set's vector and an arena pointer).
constexpr size_t kUnknownSet = 48;
constexpr size_t kOwnString = 48;      // a new std::string (32 + header)
constexpr size_t kPointerSlot = 24;    // RepeatedPtrField's slot: 8, doubling
constexpr size_t kMapNode = 64;        // a Map node's links and hash
constexpr size_t kLiteMessage = 64;    // a nested message in a lite scan
constexpr int kMaxDepth = 100;         // protobuf's default recursion limit

// The plans of a message type and of every type it reaches (built once per
// top-level type, kept for the process's life).
template <typename Desc>
const Plan* BuildPlans(const Desc* root) {
  using FD = std::remove_cv_t<std::remove_pointer_t<decltype(root->field(0))>>;
  using FileD = std::remove_cv_t<std::remove_pointer_t<decltype(root->file())>>;
  std::map<const Desc*, Plan*> made;
  std::vector<const Desc*> work;
  auto plan_of = [&](const Desc* d) -> Plan* {
    auto it = made.find(d);
    if (it != made.end()) return it->second;
    Plan* p = new Plan();  // never freed: plans live as long as the process
    made.emplace(d, p);
    work.push_back(d);
    return p;
  };
  Plan* top = plan_of(root);
  while (!work.empty()) {
    const Desc* d = work.back();
    work.pop_back();
    Plan* p = made[d];
    // The object's size, from its fields (an upper bound of libprotobuf
    // 3.21's layout; SpaceUsedLong is no help: it crashes on a map field
    // in 3.21): the vtable, metadata, cached size and has-bits, 8 bytes a
    // singular field, a RepeatedField 16, a RepeatedPtrField 24, a map 128,
    // extensions 24.
    size_t object = 32 + 4 * ((static_cast<size_t>(d->field_count()) + 31) / 32);
    if (d->extension_range_count() > 0) object += 24;
    uint32_t max_number = 0;
    for (int i = 0; i < d->field_count(); ++i) {
      const FD* f = d->field(i);
      Field x;
      x.repeated = f->is_repeated();
      x.packable = f->is_packable();
      switch (f->type()) {
        case FD::TYPE_DOUBLE:
        case FD::TYPE_FIXED64:
        case FD::TYPE_SFIXED64:
          x.kind = FieldKind::kFixed64;
          x.elem = 8;
          break;
        case FD::TYPE_FLOAT:
        case FD::TYPE_FIXED32:
        case FD::TYPE_SFIXED32:
          x.kind = FieldKind::kFixed32;
          x.elem = 4;
          break;
        case FD::TYPE_INT64:
        case FD::TYPE_UINT64:
        case FD::TYPE_SINT64:
          x.elem = 8;
          break;
        case FD::TYPE_BOOL:
          x.elem = 1;
          break;
        case FD::TYPE_ENUM:
          x.elem = 4;
          x.closed_enum = f->file()->syntax() == FileD::SYNTAX_PROTO2;
          break;
        case FD::TYPE_STRING:
        case FD::TYPE_BYTES:
          x.kind = FieldKind::kString;
          break;
        case FD::TYPE_GROUP:
          x.kind = FieldKind::kGroup;
          x.sub = plan_of(f->message_type());
          break;
        case FD::TYPE_MESSAGE:
          x.kind = f->is_map() ? FieldKind::kMapEntry : FieldKind::kMessage;
          x.sub = plan_of(f->message_type());
          break;
        default:  // INT32, UINT32, SINT32
          x.elem = 4;
          break;
      }
      const uint32_t number = static_cast<uint32_t>(f->number());
      max_number = std::max(max_number, number);
      p->fields.emplace_back(number, x);
      object += f->is_map() ? 128
                : !x.repeated ? 8
                : x.kind == FieldKind::kString || x.kind == FieldKind::kMessage ||
                        x.kind == FieldKind::kGroup
                    ? 24
                    : 16;
    }
    p->object_size = (object + 7) & ~size_t{7};
    std::sort(p->fields.begin(), p->fields.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    if (max_number < 1024) {
      p->dense.assign(max_number + 1, -1);
      for (size_t i = 0; i < p->fields.size(); ++i) {
        p->dense[p->fields[i].first] = static_cast<int32_t>(i);
      }
    }
  }
  return top;
}

// The pass over the wire: charges, checks the structure. Errors are
// INVALID_ARGUMENT (not a valid message) or RESOURCE_EXHAUSTED (the bound).
class Scanner {
 public:
  Scanner(std::span<const std::byte> in, std::string type_name, size_t budget,
          size_t factor, size_t slack, bool lite)
      : begin_(reinterpret_cast<const uint8_t*>(in.data())),
        end_(begin_ + in.size()),
        type_(std::move(type_name)),
        budget_(budget),
        left_(budget),
        factor_(factor),
        slack_(slack),
        lite_(lite) {}

  // The whole payload as a message of `plan` (null: unknown) whose object
  // takes root_size bytes.
  absl::Status Run(const Plan* plan, size_t root_size) {
    const uint8_t* p = begin_;
    if (!Charge(root_size, p) || !Message(plan, p, end_, 0, 0)) return error_;
    return absl::OkStatus();
  }
  bool Charge(size_t bytes, const uint8_t* at) {
    if (bytes <= left_) {
      left_ -= bytes;
      return true;
    }
    return Fail(absl::ResourceExhaustedError(absl::StrCat(
        "protobuf ", type_, " of ", size(), " bytes would take more than ",
        budget_, " bytes to decode (the decode bound: ", factor_,
        "x the payload + ", slack_,
        " bytes, rpc::DecodeOptions::protobuf_memory_factor); refused at "
        "offset ", at - begin_,
        " before parsing")));
  }
  size_t charged() const { return budget_ - left_; }

 private:
  size_t size() const { return static_cast<size_t>(end_ - begin_); }
  bool Fail(absl::Status s) {
    if (error_.ok()) error_ = std::move(s);
    return false;
  }
  bool Invalid(absl::string_view why, const uint8_t* at) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("payload of ", size(), " bytes is not a valid protobuf ",
                     type_, ": ", why, " at offset ", at - begin_)));
  }
  bool Varint(const uint8_t*& p, const uint8_t* end, uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      if (p >= end) return Invalid("truncated varint", p);
      const uint8_t b = *p++;
      v |= static_cast<uint64_t>(b & 0x7f) << (shift < 64 ? shift : 63);
      if ((b & 0x80) == 0) return true;
    }
    return Invalid("varint longer than 10 bytes", p);
  }

  // A packed RepeatedField of n varints: up to 4 in its first array;
  // above, while it last grew, it held the old array and the new one twice
  // as large (each behind an 8-byte arena pointer; measured with 3.21: 3
  // MiB held to parse 1 MiB of int32).
  static size_t PackedCost(uint64_t n, size_t elem) {
    if (n == 0) return 0;
    if (n <= 4) return MallocCost(8 + 4 * elem);
    return MallocCost(8 + 2 * n * elem) + MallocCost(8 + n * elem);
  }

  // Packed scalars in [p, end): how many, or false when malformed.
  bool CountPacked(const Field& f, const uint8_t* p, const uint8_t* end,
                   uint64_t& n) {
    const size_t len = static_cast<size_t>(end - p);
    if (f.kind == FieldKind::kFixed32 || f.kind == FieldKind::kFixed64) {
      const size_t w = f.kind == FieldKind::kFixed32 ? 4 : 8;
      if (len % w != 0) return Invalid("packed fixed-size field of odd length", p);
      n = len / w;
      return true;
    }
    n = 0;
    for (const uint8_t* q = p; q < end; ++q) n += (*q & 0x80) == 0;
    if (len > 0 && (end[-1] & 0x80) != 0) {
      return Invalid("truncated varint in a packed field", end - 1);
    }
    return true;
  }

  // Whether [p, end) reads as a message (lite scans: is a length-delimited
  // field a nested message?). No charges, no errors.
  static bool LooksLikeMessage(const uint8_t* p, const uint8_t* end, int depth) {
    if (depth > kMaxDepth) return false;
    while (p < end) {
      uint64_t tag = 0;
      if (!QuietVarint(p, end, tag) || tag > 0xffffffffu || (tag >> 3) == 0) {
        return false;
      }
      uint64_t v = 0;
      switch (tag & 7) {
        case 0:
          if (!QuietVarint(p, end, v)) return false;
          break;
        case 1:
          if (end - p < 8) return false;
          p += 8;
          break;
        case 5:
          if (end - p < 4) return false;
          p += 4;
          break;
        case 2:
          if (!QuietVarint(p, end, v) || v > static_cast<uint64_t>(end - p)) {
            return false;
          }
          p += v;
          break;
        default:  // groups: not worth guessing; 6, 7 invalid
          return false;
      }
    }
    return true;
  }
  static bool QuietVarint(const uint8_t*& p, const uint8_t* end, uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 70 && p < end; shift += 7) {
      const uint8_t b = *p++;
      v |= static_cast<uint64_t>(b & 0x7f) << (shift < 64 ? shift : 63);
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // A message's fields from p up to end (or, for a group, up to its
  // END_GROUP of number `group`); plan null: every field is unknown.
  bool Message(const Plan* plan, const uint8_t*& p, const uint8_t* end,
               int depth, uint32_t group) {
    if (depth > kMaxDepth) {
      return Invalid(absl::StrCat("nested deeper than ", kMaxDepth), p);
    }
    bool unknowns = false;  // this message's unknown-field set made
    // What a field that goes to the unknown fields costs beyond `extra`.
    auto unknown = [&unknowns](size_t extra) {
      const size_t c = kUnknownField + extra + (unknowns ? 0 : kUnknownSet);
      unknowns = true;
      return c;
    };
    while (p < end) {
      const uint8_t* at = p;
      uint64_t tag;
      if (!Varint(p, end, tag)) return false;
      if (tag > 0xffffffffu) return Invalid("tag above 32 bits", at);
      const uint32_t number = static_cast<uint32_t>(tag >> 3);
      const uint32_t wt = static_cast<uint32_t>(tag & 7);
      if (wt == 4) {
        if (group != 0 && number == group) return true;
        return Invalid("END_GROUP without its START_GROUP", at);
      }
      if (number == 0) return Invalid("field number 0", at);
      const Field* f = plan != nullptr ? plan->Find(number) : nullptr;
      size_t cost = 0;
      bool known = false;  // the field's value goes into a field of its own
      switch (wt) {
        case 0: {
          uint64_t v = 0;
          if (!Varint(p, end, v)) return false;
          if (f != nullptr && f->kind == FieldKind::kVarint) {
            // (A closed enum's value outside it goes to the unknown fields.)
            known = !f->closed_enum;
            cost = f->closed_enum ? unknown(0) : f->repeated ? 3 * f->elem : 0;
          }
          break;
        }
        case 1:
        case 5: {
          const size_t w = wt == 1 ? 8 : 4;
          if (static_cast<size_t>(end - p) < w) return Invalid("truncated", at);
          p += w;
          const FieldKind k = wt == 1 ? FieldKind::kFixed64 : FieldKind::kFixed32;
          if (f != nullptr && f->kind == k) {
            known = true;
            cost = f->repeated ? 3 * f->elem : 0;
          }
          break;
        }
        case 2: {
          uint64_t len;
          if (!Varint(p, end, len)) return false;
          if (len > static_cast<uint64_t>(end - p)) {
            return Invalid(absl::StrCat("length ", len, " past the end"), at);
          }
          const uint8_t* body = p;
          const uint8_t* body_end = p + len;
          p = body_end;
          if (f == nullptr || f->kind == FieldKind::kGroup) {
            if (lite_ && plan == nullptr && LooksLikeMessage(body, body_end, depth + 1)) {
              if (!Charge(unknown(MallocCost(kLiteMessage)), at)) return false;
              const uint8_t* q = body;
              if (!Message(nullptr, q, body_end, depth + 1, 0)) return false;
              continue;
            }
            cost = unknown(kOwnString + StringHeap(len));
            break;
          }
          known = true;
          switch (f->kind) {
            case FieldKind::kString:
              cost = (f->repeated ? kPointerSlot : 0) + kOwnString + StringHeap(len);
              break;
            case FieldKind::kMessage:
            case FieldKind::kMapEntry: {
              cost = (f->repeated ? kPointerSlot : 0) +
                     MallocCost(f->sub->object_size) +
                     (f->kind == FieldKind::kMapEntry ? kMapNode : 0);
              if (!Charge(cost, at)) return false;
              const uint8_t* q = body;
              if (!Message(f->sub, q, body_end, depth + 1, 0)) return false;
              continue;
            }
            default: {  // a scalar: packed if repeated, else unknown
              if (!f->packable) {
                cost = unknown(kOwnString + StringHeap(len));
                break;
              }
              uint64_t n = 0;
              if (!CountPacked(*f, body, body_end, n)) return false;
              cost = f->closed_enum ? (n == 0 ? 0 : unknown(0) + (n - 1) * kUnknownField)
                     : f->kind == FieldKind::kVarint
                         ? PackedCost(n, f->elem)
                         : MallocCost(8 + n * f->elem);  // reserved at once
              break;
            }
          }
          break;
        }
        case 3: {
          known = f != nullptr && f->kind == FieldKind::kGroup;
          cost = known ? (f->repeated ? kPointerSlot : 0) + MallocCost(f->sub->object_size)
                       : unknown(MallocCost(40));  // and the group's own set
          if (!Charge(cost, at)) return false;
          if (!Message(known ? f->sub : nullptr, p, end, depth + 1, number)) {
            return false;
          }
          continue;
        }
        default:
          return Invalid(absl::StrCat("wire type ", wt), at);
      }
      // A field of the plan with another wire type is an unknown field.
      if (!known && cost == 0) cost = unknown(0);
      if (!Charge(cost, at)) return false;
    }
    if (group != 0) return Invalid("unterminated group", p);
    return true;
  }

  const uint8_t* begin_;
  const uint8_t* end_;
  std::string type_;
  const size_t budget_;
  size_t left_;
  const size_t factor_, slack_;
  const bool lite_;
  absl::Status error_;
};

// Messages whose type has a descriptor (the full runtime).
template <typename T>
concept HasDescriptor = requires { T::descriptor()->field_count(); };

template <typename T>
const Plan* PlanOf() {
  if constexpr (HasDescriptor<T>) {
    static const Plan* plan = BuildPlans(T::descriptor());
    return plan;
  } else {
    return nullptr;
  }
}

// Whether a payload may be parsed as T within `budget` bytes (sizeof(T)
// included).
// *charged (optional): the estimate (tests compare it with the heap the
// parse really took).
template <typename T>
absl::Status Check(std::span<const std::byte> b, std::string type_name,
                   size_t budget, size_t factor, size_t slack,
                   size_t* charged = nullptr) {
  Scanner s(b, std::move(type_name), budget, factor, slack, !HasDescriptor<T>);
  absl::Status st = s.Run(PlanOf<T>(), sizeof(T));
  if (charged != nullptr) *charged = s.charged();
  return st;
}

}  // namespace coverbs::rpc::internal::pb

#endif  // COVERBS_RPC_CODEC_PROTOBUF_H_
