// Payload: the bytes of a request or response, owned in whichever form they
// came: a received connection message (zero-copy view of the receive or
// rendezvous buffer), a std::string or a byte vector. Move-only.
#ifndef COVERBS_RPC_PAYLOAD_H_
#define COVERBS_RPC_PAYLOAD_H_

#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "cm/connection.h"

namespace coverbs::rpc {

class Payload {
 public:
  Payload() = default;
  explicit Payload(std::string s) : v_(std::move(s)) {}
  explicit Payload(std::vector<std::byte> v) : v_(std::move(v)) {}
  // The bytes of `m` from `offset` on; `lease` (may be null) is released
  // with the message (the server counts receive buffers held this way).
  Payload(cm::Message m, size_t offset, std::shared_ptr<void> lease = nullptr)
      : v_(Held{std::move(lease), std::move(m), offset}) {}
  static Payload Copy(std::span<const std::byte> b) {
    return Payload(std::vector<std::byte>(b.begin(), b.end()));
  }
  static Payload Copy(std::string_view s) { return Payload(std::string(s)); }

  Payload(Payload&&) noexcept = default;
  Payload& operator=(Payload&&) noexcept = default;

  // The bytes as text.
  std::string_view text() const {
    auto d = data();
    return {reinterpret_cast<const char*>(d.data()), d.size()};
  }
  std::span<const std::byte> data() const {
    switch (v_.index()) {
      case 1: {
        const std::string& s = std::get<1>(v_);
        return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
      }
      case 2:
        return std::get<2>(v_);
      case 3: {
        const Held& h = std::get<3>(v_);
        return h.msg.data().subspan(h.offset);
      }
      default:
        return {};
    }
  }
  size_t size() const { return data().size(); }
  bool empty() const { return size() == 0; }
  std::string_view view() const {
    auto d = data();
    return {reinterpret_cast<const char*>(d.data()), d.size()};
  }
  std::string ToString() const { return std::string(view()); }
  // True when the bytes are a view of a connection buffer (no copy made).
  bool zero_copy() const { return v_.index() == 3; }

 private:
  struct Held {
    std::shared_ptr<void> lease;  // first: released after the message
    cm::Message msg;
    size_t offset = 0;
  };
  std::variant<std::monostate, std::string, std::vector<std::byte>, Held> v_;
};

using Response = Payload;

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_PAYLOAD_H_
