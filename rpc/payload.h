// Payload: the bytes of a request or response, owned in whichever form they
// came: a received connection message (zero-copy view of the receive or
// rendezvous buffer), a std::string or a byte vector. Move-only.
#ifndef COVERBS_RPC_PAYLOAD_H_
#define COVERBS_RPC_PAYLOAD_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cm/connection.h"

namespace coverbs::rpc {

// A tagged union rather than a std::variant: a payload is moved some five
// times on its way through a call (request into the call and the handler,
// result out of it), and each move and each husk's destruction was a
// variant visit (an indirect jump, index checks). Here a move copies the
// view and the owner and marks the source empty, and the destructor of a
// husk just moved from folds away. The view is cached, so data() reads no
// tag. (64 B echo, framework Ir per call: server 2,029 -> 1,988.)
class Payload {
 public:
  Payload() noexcept {}  // (the union has no default member to build)
  explicit Payload(std::string s) : kind_(Kind::kString) {
    new (&str_) std::string(std::move(s));
    SetView(str_.data(), str_.size());
  }
  explicit Payload(std::vector<std::byte> v) : kind_(Kind::kBytes) {
    new (&bytes_) std::vector<std::byte>(std::move(v));
    data_ = bytes_.data();
    size_ = bytes_.size();
  }
  // The bytes of `m` from `offset` on; `lease` (may be null) is released
  // with the message (the server counts receive buffers held this way).
  Payload(cm::Message m, size_t offset, std::shared_ptr<void> lease = nullptr)
      : kind_(Kind::kHeld) {
    std::span<const std::byte> d = m.data().subspan(offset);
    data_ = d.data();
    size_ = d.size();
    new (&held_) Held{std::move(lease), std::move(m)};
  }
  static Payload Copy(std::span<const std::byte> b) {
    return Payload(std::vector<std::byte>(b.begin(), b.end()));
  }
  static Payload Copy(std::string_view s) { return Payload(std::string(s)); }

  // A moved-from payload is empty.
  [[gnu::always_inline]] Payload(Payload&& o) noexcept { MoveFrom(o); }
  Payload& operator=(Payload&& o) noexcept {
    if (this != &o) {
      Destroy();
      MoveFrom(o);  // sets every field
    }
    return *this;
  }
  [[gnu::always_inline]] ~Payload() { Destroy(); }

  // The bytes as text.
  std::string_view text() const {
    return {reinterpret_cast<const char*>(data_), size_};
  }
  std::span<const std::byte> data() const { return {data_, size_}; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::string_view view() const { return text(); }
  std::string ToString() const { return std::string(view()); }
  // True when the bytes are a view of a connection buffer (no copy made).
  bool zero_copy() const { return kind_ == Kind::kHeld; }

 private:
  enum class Kind : uint8_t { kNone, kString, kBytes, kHeld };
  struct Held {
    std::shared_ptr<void> lease;  // first: released after the message
    cm::Message msg;
  };

  void SetView(const char* p, size_t n) {
    data_ = reinterpret_cast<const std::byte*>(p);
    size_ = n;
  }
  // Held (the server's requests and large responses) and byte vectors (the
  // client's small responses) inline, so that a moved-from husk's
  // destructor folds away; strings, which need their view redone (a short
  // one's bytes live in the object), out of the way.
  [[gnu::always_inline]] void MoveFrom(Payload& o) noexcept {
    kind_ = o.kind_;
    data_ = o.data_;
    size_ = o.size_;
    if (kind_ == Kind::kHeld) {
      new (&held_) Held(std::move(o.held_));
      o.held_.~Held();
    } else if (kind_ == Kind::kBytes) {
      new (&bytes_) std::vector<std::byte>(std::move(o.bytes_));
      o.bytes_.~vector();
    } else if (kind_ == Kind::kString) {
      MoveString(o);
    }
    o.kind_ = Kind::kNone;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  [[gnu::noinline]] void MoveString(Payload& o) noexcept {
    new (&str_) std::string(std::move(o.str_));
    o.str_.~basic_string();
    SetView(str_.data(), str_.size());
  }
  [[gnu::always_inline]] void Destroy() noexcept {
    if (kind_ == Kind::kHeld) {
      held_.~Held();
    } else if (kind_ == Kind::kBytes) {
      bytes_.~vector();
    } else if (kind_ == Kind::kString) {
      DestroyString();
    }
  }
  [[gnu::noinline]] void DestroyString() noexcept { str_.~basic_string(); }

  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  Kind kind_ = Kind::kNone;
  union {
    std::string str_;
    std::vector<std::byte> bytes_;
    Held held_;
  };
};

using Response = Payload;

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_PAYLOAD_H_
