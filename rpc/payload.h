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
#include "core/frame_pool.h"

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
    // The client copies every small response: from the frame pool's
    // per-thread lists, malloc and free were ~200 instructions a call.
    if (!b.empty() && b.size() <= coverbs::internal::kMaxPooledFrame) {
      return Payload(Pooled(b));
    }
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
      case 4:
        return std::get<4>(v_).data();
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
  // A copy of 1..kMaxPooledFrame bytes in frame-pool memory (which may be
  // freed on any thread, as a Payload may be destroyed on any).
  class Pooled {
   public:
    explicit Pooled(std::span<const std::byte> b)
        : p_(static_cast<std::byte*>(coverbs::internal::AllocFrame(b.size()))),
          n_(b.size()) {
      std::memcpy(p_, b.data(), n_);
    }
    Pooled(Pooled&& o) noexcept
        : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
    Pooled& operator=(Pooled&& o) noexcept {
      if (this != &o) {
        Free();
        p_ = std::exchange(o.p_, nullptr);
        n_ = std::exchange(o.n_, 0);
      }
      return *this;
    }
    ~Pooled() { Free(); }
    std::span<const std::byte> data() const { return {p_, n_}; }

   private:
    void Free() {
      if (p_ != nullptr) coverbs::internal::FreeFrame(p_, n_);
    }
    std::byte* p_;
    size_t n_;
  };
  explicit Payload(Pooled p) : v_(std::move(p)) {}
  std::variant<std::monostate, std::string, std::vector<std::byte>, Held,
               Pooled>
      v_;
};

using Response = Payload;

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_PAYLOAD_H_
