// Typed methods over the byte methods: a handler takes a typed argument and
// returns a typed result; rpc::Codec<T> (rpc/codec.h) turns each into the
// payload of the byte method of the same name.
//
//   struct PutArgs { std::string key, value; MSGPACK_DEFINE(key, value); };
//   inline constexpr rpc::Method<PutArgs, bool> kPut{"Put"};
//
//   server.Register(kPut, [&](rpc::Context& ctx, PutArgs a)
//                              -> Task<absl::StatusOr<bool>> { ... });
//   absl::StatusOr<bool> r = co_await client->Call(kPut, PutArgs{"k", "v"});
//   // or by name: co_await client->Call<bool>("Put", args)
//
// Contract:
//  - A handler is a function or lambda (not generic) taking (rpc::Context&,
//    Args) or (Args) -- by value or const reference -- and returning
//    Task<absl::StatusOr<R>>. View arguments (std::string_view,
//    std::span<const std::byte>) point into the request and are valid while
//    the handler runs.
//  - A request that does not decode as Args fails the call with
//    INVALID_ARGUMENT naming the method (the handler does not run), or
//    RESOURCE_EXHAUSTED when its decode would pass the decode bound
//    (rpc::DecodeOptions: the server's ServerOptions::decode, or the
//    method's own given to Register); a response that does not decode as R
//    fails it on the client with INTERNAL naming the method (the default
//    bound applies there too). The handler's error Status travels as it
//    does for byte methods.
//  - An argument above DecodeOptions::offload_above bytes whose codec does
//    more than copy (msgpack, protobuf, user codecs) is decoded on a pool
//    thread (core/offload.h: OffloadUntilDone), so that the connection's
//    reactor serves its other calls meanwhile; the handler then runs on
//    the reactor as usual, and once it returned the argument is released
//    on a pool thread too (OffloadPool::Post: the handler's finished frame,
//    which holds a by-value argument, is destroyed there). Smaller ones
//    decode inline.
//  - Both ends must agree on Args and R: only the method name (its id) and
//    the payload bytes travel. A Method descriptor shared by both ends'
//    code makes the compiler check it.
#ifndef COVERBS_RPC_TYPED_H_
#define COVERBS_RPC_TYPED_H_

#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/offload.h"
#include "core/task.h"
#include "rpc/codec.h"
#include "rpc/context.h"
#include "rpc/payload.h"

namespace coverbs::rpc {

// A typed method's name with its argument and result types.
template <typename Args, typename Result>
struct Method {
  using ArgsType = Args;
  using ResultType = Result;
  std::string_view name;
};

namespace internal {

template <typename T>
struct TaskStatusOr : std::false_type {};
template <typename R>
struct TaskStatusOr<Task<absl::StatusOr<R>>> : std::true_type {
  using Result = R;
};

// The argument and result types of a typed handler's call operator.
template <typename Sig>
struct TypedSig {
  static constexpr bool kValid = false;
};
template <typename Ret, typename A>
struct TypedSig<Ret(A)> {
  static constexpr bool kValid =
      TaskStatusOr<Ret>::value &&
      !std::is_same_v<std::remove_cvref_t<A>, Request>;
  static constexpr bool kWithContext = false;
  using Args = std::remove_cvref_t<A>;
  using Result = typename TaskStatusOr<Ret>::Result;
};
template <typename Ret, typename C, typename A>
struct TypedSig<Ret(C, A)> : TypedSig<Ret(A)> {
  static constexpr bool kValid =
      TypedSig<Ret(A)>::kValid &&
      (std::is_same_v<C, Context&> || std::is_same_v<C, const Context&>);
  static constexpr bool kWithContext = true;
};

template <typename F, typename = void>
struct TypedTraits : TypedSig<void> {};
template <typename Ret, typename... P>
struct TypedTraits<Ret (*)(P...)> : TypedSig<Ret(P...)> {};
template <typename Ret, typename... P>
struct TypedTraits<Ret(P...)> : TypedSig<Ret(P...)> {};
template <typename M>
struct MemberSig;
template <typename Ret, typename Cl, typename... P>
struct MemberSig<Ret (Cl::*)(P...) const> : TypedSig<Ret(P...)> {};
template <typename Ret, typename Cl, typename... P>
struct MemberSig<Ret (Cl::*)(P...)> : TypedSig<Ret(P...)> {};
template <typename F>
struct TypedTraits<F, std::void_t<decltype(&F::operator())>>
    : MemberSig<decltype(&F::operator())> {};

template <typename F>
inline constexpr bool kIsTypedHandler = TypedTraits<std::decay_t<F>>::kValid;

// Codecs whose decode does more than copy the bytes: a large argument of
// such a type is decoded off the reactor.
template <typename T>
inline constexpr bool kDecodeMayTakeTime = !requires {
  requires Codec<T>::kCopiesOnly;
};

template <typename T>
absl::StatusOr<T> DecodeWith(std::span<const std::byte> b,
                             const DecodeOptions& o) {
  if constexpr (HasBoundedDecode<T>) {
    return Codec<T>::Decode(b, o);
  } else {
    return Codec<T>::Decode(b);
  }
}

// The byte handler that runs a typed one: decode, call, encode. Its own
// coroutine around the user's (the user's Task is awaited in it).
template <typename F>
auto WrapTyped(F fn, DecodeOptions options = {}) {
  using Tr = TypedTraits<std::decay_t<F>>;
  using Args = typename Tr::Args;
  using R = typename Tr::Result;
  static_assert(HasCodec<Args>, "no rpc::Codec for the handler's argument");
  static_assert(HasCodec<R> || std::is_same_v<R, Payload>,
                "no rpc::Codec for the handler's result");
  return [fn = std::move(fn), options](
             Request&& req) -> Task<absl::StatusOr<Payload>> {
    absl::StatusOr<R> r = absl::UnknownError("");
    if constexpr (std::is_same_v<Args, Payload>) {
      if constexpr (Tr::kWithContext) {
        r = co_await fn(req, std::move(req.payload));
      } else {
        r = co_await fn(std::move(req.payload));
      }
    } else {
      const std::span<const std::byte> bytes = req.payload.data();
      bool large = false;
      if constexpr (kDecodeMayTakeTime<Args>) {
        large = bytes.size() > options.offload_above;
      }
      // Decoded in place when small (no status to build and replace).
      absl::StatusOr<Args> a =
          large ? absl::StatusOr<Args>(absl::UnknownError(""))
                : DecodeWith<Args>(bytes, options);
      if constexpr (kDecodeMayTakeTime<Args>) {
        if (large) {
          // The payload lives in the request, which outlives this wait (not
          // cancellable: it returns once the decode ran). Named, not a
          // temporary in the co_await (gcc 12: README, "Building").
          const DecodeOptions* o = &options;
          auto decode = [bytes, o] { return DecodeWith<Args>(bytes, *o); };
          a = co_await OffloadUntilDone(decode);
        }
      }
      if (!a.ok()) {
        const absl::StatusCode code =
            a.status().code() == absl::StatusCode::kResourceExhausted
                ? absl::StatusCode::kResourceExhausted
                : absl::StatusCode::kInvalidArgument;
        co_return absl::Status(
            code, absl::StrCat("method ", std::string(req.method),
                               ": the request does not decode: ",
                               a.status().message()));
      }
      if (!large) {
        if constexpr (Tr::kWithContext) {
          r = co_await fn(req, *std::move(a));
        } else {
          r = co_await fn(*std::move(a));
        }
      }
      if constexpr (kDecodeMayTakeTime<Args>) {
        if (large) {
          // A large argument is released off the reactor too (freeing a
          // decoded batch of a million sub-messages takes as long as
          // decoding it): the handler's finished frame holds it (a
          // by-value parameter), or `a` does (a const reference); both go
          // to a pool thread once the handler returned.
          Task<absl::StatusOr<R>> t = [&] {
            if constexpr (Tr::kWithContext) {
              return fn(req, *std::move(a));
            } else {
              return fn(*std::move(a));
            }
          }();
          r = co_await t;
          auto release = [t = std::move(t), a = std::move(a)]() mutable {
            t = Task<absl::StatusOr<R>>();
            a = absl::UnknownError("");
          };
          OffloadPool::Default().Post(std::move(release));
        }
      }
    }
    if (!r.ok()) co_return r.status();
    co_return ToPayload(*std::move(r));
  };
}

// The client's side: a response payload as R.
template <typename R>
absl::StatusOr<R> FromResponse(std::string_view method, Payload&& p) {
  if constexpr (std::is_same_v<R, Payload>) {
    return std::move(p);
  } else {
    static_assert(!ByteView<R>,
                  "a call's result must own its bytes: use std::string or "
                  "rpc::Payload instead of a view");
    absl::StatusOr<R> r = Codec<R>::Decode(p.data());
    if (!r.ok()) {
      return absl::InternalError(absl::StrCat(
          "method ", std::string(method),
          ": the response does not decode: ", r.status().message()));
    }
    return r;
  }
}

}  // namespace internal
}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_TYPED_H_
