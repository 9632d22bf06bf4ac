// Typed methods over the byte methods: a handler takes a typed argument and
// returns a typed result; rpc::Codec<T> (rpc/codec.h) turns each into the
// payload of the byte method of the same name.
//
//   struct PutArgs { std::string key, value; MSGPACK_DEFINE(key, value); };
//   inline constexpr rpc::Method<PutArgs, bool> kPut{"Put"};
//
//   server.Register(kPut, [&](rpc::Context& ctx, PutArgs a)
//                              -> Task<absl::StatusOr<bool>> { ... });
//   absl::StatusOr<bool> r = co_await client->Call(kPut, args);
//   // or by name: co_await client->Call<bool>("Put", args)
//
// Zero or several arguments: a function type names them.
//
//   inline constexpr rpc::Method<uint64_t(std::string, std::vector<float>)>
//       kPush{"Push"};
//   inline constexpr rpc::Method<Stats()> kStats{"Stats"};
//   server.Register(kPush, [](std::string name, std::vector<float> d)
//                              -> Task<absl::StatusOr<uint64_t>> { ... });
//   server.Register(kStats, [](rpc::Context& ctx)
//                               -> Task<absl::StatusOr<Stats>> { ... });
//   auto n = co_await client->Call(kPush, name, d);  // (..., d, options)
//   auto s = co_await client->Call(kStats);
//
// Contract:
//  - A handler is a function or lambda (not generic) taking (rpc::Context&,
//    Args) or (Args) -- by value or const reference -- and returning
//    Task<absl::StatusOr<R>>; for Method<R(A...)>, (rpc::Context&, A...)
//    or (A...). View arguments (std::string_view,
//    std::span<const std::byte>) point into the request and are valid while
//    the handler runs.
//  - Method<R(A...)>'s argument types count without references and const
//    (Method<R(const std::string&)> is Method<R(std::string)>). On the
//    wire, by arity:
//    - one: exactly Method<A, R>'s form (rpc::Codec<A>); the two spellings
//      are the same method to the peer.
//    - none: an empty payload; a non-empty one is INVALID_ARGUMENT.
//    - several: one msgpack array of exactly that many elements, each its
//      argument's msgpack value; an array of another length (or anything
//      else) is INVALID_ARGUMENT naming the method. So each argument must
//      be msgpack-encodable (MsgpackArg below: bool, numbers,
//      std::string, std::string_view, transport::RemoteRegion, and the
//      rpc::UseMsgpack types: MSGPACK_DEFINE structs, vectors, maps,
//      optionals, tuples). Not each argument's own codec: one array is
//      what a peer's MessagePack library decodes (a protobuf message or a
//      host-order struct inside it is not), and one decoder bounds it all
//      with one budget. A protobuf or raw-struct argument goes alone
//      (Method<A, R>) or as a msgpack struct's member.
//    The argument list is decoded as a one-argument msgpack value is: the
//    decode bound of the whole payload, off the reactor above
//    DecodeOptions::offload_above.
//  - Calls by a Method<R(A...)> take the method's arguments, each
//    converting to its type, then optionally rpc::CallOptions; another
//    count or type fails to compile (a static_assert says which). None or
//    several are encoded when Call is called, so they need not outlive
//    it; one of the method's own type whose codec sends in place (strings,
//    views, trivially copyable types) is sent from the object, as
//    Method<A, R> does, and must stay valid until the call completes.
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

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
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

// A typed method's name with its argument and result types:
// Method<Args, R> (one argument) or Method<R(A...)> (any number).
template <typename... T>
struct Method;

template <typename Args, typename Result>
struct Method<Args, Result> {
  using ArgsType = Args;
  using ResultType = Result;
  std::string_view name;
};

template <typename Result, typename... A>
struct Method<Result(A...)> {
  using ArgTypes = std::tuple<std::remove_cvref_t<A>...>;
  using ResultType = Result;
  std::string_view name;
};

namespace internal {

template <typename T>
struct TaskStatusOr : std::false_type {
  using Result = void;
};
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

// The parameters of a handler of any arity (Method<R(A...)>), after an
// optional leading rpc::Context&.
template <typename Sig>
struct HandlerSig {
  static constexpr bool kValid = false;
  static constexpr bool kWithContext = false;
  using Params = void;
  using Result = void;
};
template <typename Ret, typename... P>
struct HandlerSig<Ret(P...)> {
  static constexpr bool kValid = TaskStatusOr<Ret>::value;
  static constexpr bool kWithContext = false;
  using Params = std::tuple<std::remove_cvref_t<P>...>;
  using Result = typename TaskStatusOr<Ret>::Result;
};
template <typename Ret, typename... P>
struct HandlerSig<Ret(Context&, P...)> : HandlerSig<Ret(P...)> {
  static constexpr bool kWithContext = true;
};
template <typename Ret, typename... P>
struct HandlerSig<Ret(const Context&, P...)> : HandlerSig<Ret(P...)> {
  static constexpr bool kWithContext = true;
};

// The call signature of a function, function pointer or non-generic
// lambda, as Ret(P...) (void when it has none).
template <typename F, typename = void>
struct CallSignature {
  using type = void;
};
template <typename Ret, typename... P>
struct CallSignature<Ret (*)(P...)> {
  using type = Ret(P...);
};
template <typename Ret, typename... P>
struct CallSignature<Ret(P...)> {
  using type = Ret(P...);
};
template <typename M>
struct MemberSig;
template <typename Ret, typename Cl, typename... P>
struct MemberSig<Ret (Cl::*)(P...) const> {
  using type = Ret(P...);
};
template <typename Ret, typename Cl, typename... P>
struct MemberSig<Ret (Cl::*)(P...)> {
  using type = Ret(P...);
};
template <typename F>
struct CallSignature<F, std::void_t<decltype(&F::operator())>>
    : MemberSig<decltype(&F::operator())> {};

template <typename F>
using SignatureOf = typename CallSignature<std::decay_t<F>>::type;

// One argument (Register by name, Method<Args, R>).
template <typename F>
struct TypedTraits : TypedSig<SignatureOf<F>> {};
// Any number (Method<R(A...)>).
template <typename F>
struct HandlerTraits : HandlerSig<SignatureOf<F>> {};

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

// How a typed handler's arguments come out of a request: the payload
// decodes to a Value (Decode), Call starts the handler on it, and a Value
// whose decode may take time (kMayTakeTime) is decoded off the reactor
// when large.
//
// One argument (Method<Args, R>, Method<R(Args)>, Register by name).
template <typename Tr>
struct OneArg {
  using Value = typename Tr::Args;
  static constexpr bool kMayTakeTime = kDecodeMayTakeTime<Value>;
  static absl::StatusOr<Value> Decode(std::span<const std::byte> b,
                                      const DecodeOptions& o) {
    return DecodeWith<Value>(b, o);
  }
  template <typename F>
  static auto Call(const F& fn, Request& req, Value&& v) {
    if constexpr (Tr::kWithContext) {
      return fn(req, std::move(v));
    } else {
      return fn(std::move(v));
    }
  }
};

// None or several (Method<R(A...)>): an empty payload, or one msgpack
// array of exactly sizeof...(A) elements (ArgList, rpc/codec.h).
template <bool kWithContext, typename... A>
struct ArgsOf {
  using Value = std::tuple<A...>;
  static constexpr bool kMayTakeTime = sizeof...(A) > 0;
  static absl::StatusOr<Value> Decode(std::span<const std::byte> b,
                                      const DecodeOptions& o) {
    if constexpr (sizeof...(A) == 0) {
      if (!b.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("a method without arguments got a payload of ",
                         b.size(), " bytes"));
      }
      return Value();
    } else {
      ArgList<A...> list;
      absl::Status s = mp::Decode(b, o.MemoryLimit(b.size()), o.memory_factor,
                                  o.memory_slack, list);
      if (!s.ok()) return s;
      return std::move(list.values);
    }
  }
  template <typename F>
  static auto Call(const F& fn, Request& req, Value&& v) {
    return std::apply(
        [&fn, &req](A&&... a) {
          if constexpr (kWithContext) {
            return fn(req, std::move(a)...);
          } else {
            return fn(std::move(a)...);
          }
        },
        std::move(v));
  }
};

// The byte handler that runs a typed one: decode (Spec: OneArg, ArgsOf),
// call, encode. Its own coroutine around the user's (the user's Task is
// awaited in it).
template <typename Spec, typename R, typename F>
auto WrapDecoded(F fn, DecodeOptions options) {
  using Value = typename Spec::Value;
  return [fn = std::move(fn),
          options](Request&& req) -> Task<absl::StatusOr<Payload>> {
    absl::StatusOr<R> r = absl::UnknownError("");
    const std::span<const std::byte> bytes = req.payload.data();
    bool large = false;
    if constexpr (Spec::kMayTakeTime) {
      large = bytes.size() > options.offload_above;
    }
    // Decoded in place when small (no status to build and replace).
    absl::StatusOr<Value> a =
        large ? absl::StatusOr<Value>(absl::UnknownError(""))
              : Spec::Decode(bytes, options);
    if constexpr (Spec::kMayTakeTime) {
      if (large) {
        // The payload lives in the request, which outlives this wait (not
        // cancellable: it returns once the decode ran). Named, not a
        // temporary in the co_await (gcc 12: README, "Building").
        const DecodeOptions* o = &options;
        auto decode = [bytes, o] { return Spec::Decode(bytes, *o); };
        a = co_await OffloadUntilDone(decode);
      }
    }
    if (!a.ok()) {
      const absl::StatusCode code =
          a.status().code() == absl::StatusCode::kResourceExhausted
              ? absl::StatusCode::kResourceExhausted
              : absl::StatusCode::kInvalidArgument;
      co_return absl::Status(
          code, absl::StrCat(
                    "method ", std::string(req.method),
                    ": the request does not decode: ", a.status().message()));
    }
    if (!large) {
      r = co_await Spec::Call(fn, req, *std::move(a));
    }
    if constexpr (Spec::kMayTakeTime) {
      if (large) {
        // A large argument is released off the reactor too (freeing a
        // decoded batch of a million sub-messages takes as long as
        // decoding it): the handler's finished frame holds it (a by-value
        // parameter), or `a` does (a const reference); both go to a pool
        // thread once the handler returned.
        Task<absl::StatusOr<R>> t = Spec::Call(fn, req, *std::move(a));
        r = co_await t;
        auto release = [t = std::move(t), a = std::move(a)]() mutable {
          t = Task<absl::StatusOr<R>>();
          a = absl::UnknownError("");
        };
        OffloadPool::Default().Post(std::move(release));
      }
    }
    if (!r.ok()) co_return r.status();
    co_return ToPayload(*std::move(r));
  };
}

// A one-argument handler (Register by name, Method<Args, R>). An
// rpc::Payload argument is the request's payload itself, no decode.
template <typename F>
auto WrapTyped(F fn, DecodeOptions options = {}) {
  using Tr = TypedTraits<std::decay_t<F>>;
  using Args = typename Tr::Args;
  using R = typename Tr::Result;
  static_assert(HasCodec<Args>, "no rpc::Codec for the handler's argument");
  static_assert(HasCodec<R> || std::is_same_v<R, Payload>,
                "no rpc::Codec for the handler's result");
  if constexpr (std::is_same_v<Args, Payload>) {
    return
        [fn = std::move(fn)](Request&& req) -> Task<absl::StatusOr<Payload>> {
          absl::StatusOr<R> r = absl::UnknownError("");
          if constexpr (Tr::kWithContext) {
            r = co_await fn(req, std::move(req.payload));
          } else {
            r = co_await fn(std::move(req.payload));
          }
          if (!r.ok()) co_return r.status();
          co_return ToPayload(*std::move(r));
        };
  } else {
    return WrapDecoded<OneArg<Tr>, R>(std::move(fn), options);
  }
}

// A handler of Method<R(A...)>: the one-argument form's for one argument.
template <typename R, typename Args>
struct MethodHandler;
template <typename R, typename... A>
struct MethodHandler<R, std::tuple<A...>> {
  template <typename F>
  static auto Wrap(F fn, DecodeOptions options) {
    using Tr = HandlerTraits<F>;
    constexpr bool kHandler = Tr::kValid;
    constexpr bool kTypes =
        std::is_same_v<typename Tr::Params, std::tuple<A...>> &&
        std::is_same_v<typename Tr::Result, R>;
    constexpr bool kArgs = sizeof...(A) == 1 || (MsgpackArg<A> && ...);
    constexpr bool kResult = HasCodec<R> || std::is_same_v<R, Payload>;
    static_assert(kHandler,
                  "a typed handler is a function or non-generic lambda "
                  "returning Task<absl::StatusOr<R>>");
    static_assert(!kHandler || kTypes,
                  "the handler's argument and result types must be the "
                  "method's (after an optional rpc::Context&)");
    static_assert(kArgs,
                  "a method of none or several arguments takes "
                  "msgpack-encodable ones (rpc/typed.h; rpc::MsgpackArg)");
    static_assert(kResult, "no rpc::Codec for the method's result");
    if constexpr (!(kHandler && kTypes && kArgs && kResult)) {
      return [](Request&&) { return Task<absl::StatusOr<Payload>>(); };
    } else if constexpr (sizeof...(A) == 1) {
      return WrapTyped(std::move(fn), options);
    } else {
      return WrapDecoded<ArgsOf<Tr::kWithContext, A...>, R>(std::move(fn),
                                                            options);
    }
  }
};

// A typed call's request payload: a view of the caller's argument (sent
// in place), or bytes encoded when the call was made, owned here.
class CallPayload {
 public:
  static CallPayload View(std::span<const std::byte> v) {
    CallPayload p;
    p.view_ = v;
    return p;
  }
  static CallPayload Owned(std::string bytes) {
    CallPayload p;
    p.owned_ = std::move(bytes);
    p.is_owned_ = true;
    return p;
  }
  // Valid while this object (or, for a view, the argument) is.
  std::span<const std::byte> bytes() const {
    return is_owned_ ? std::as_bytes(std::span(owned_)) : view_;
  }

 private:
  std::string owned_;
  std::span<const std::byte> view_;
  bool is_owned_ = false;
};

// `v` as an A: itself when it is one, else converted (implicitly).
template <typename A>
A ConvertTo(A a) {
  return a;
}
template <typename A, typename V>
decltype(auto) AsArg(V&& v) {
  if constexpr (std::is_same_v<std::remove_cvref_t<V>, A>) {
    return static_cast<const A&>(v);
  } else {
    return ConvertTo<A>(std::forward<V>(v));
  }
}

// Whether the first elements of the tuple Given convert to the types of
// the tuple Args, one to one.
template <typename Args, typename Given,
          typename = std::make_index_sequence<std::tuple_size_v<Args>>>
struct ConvertsTo;
template <typename... A, typename Given, size_t... I>
struct ConvertsTo<std::tuple<A...>, Given, std::index_sequence<I...>>
    : std::bool_constant<(
          std::is_convertible_v<std::tuple_element_t<I, Given>, A> && ...)> {};

// Whether the last element of the (non-empty) tuple Given converts to T.
template <typename T, typename Given>
struct LastConvertsTo
    : std::is_convertible<
          std::tuple_element_t<std::tuple_size_v<Given> - 1, Given>, T> {};

// A call by Method<R(A...)> with the caller's arguments U...: the
// method's, each converting to its type, then optionally an Opt (the
// client's CallOptions). Instantiating it checks them.
template <typename Opt, typename Args, typename... U>
struct CallArgs;
template <typename Opt, typename... A, typename... U>
struct CallArgs<Opt, std::tuple<A...>, U...> {
  static constexpr size_t kN = sizeof...(A);
  static constexpr bool kWithOptions =
      std::conditional_t<sizeof...(U) == kN + 1,
                         LastConvertsTo<Opt, std::tuple<U...>>,
                         std::false_type>::value;
  static constexpr bool kCount = sizeof...(U) == kN + (kWithOptions ? 1 : 0);
  static constexpr bool kConvert =
      std::conditional_t<kCount, ConvertsTo<std::tuple<A...>, std::tuple<U...>>,
                         std::false_type>::value;
  static_assert(kCount,
                "rpc::Method<R(A...)> call: pass exactly the method's "
                "arguments, then optionally rpc::CallOptions");
  static_assert(!kCount || kConvert,
                "rpc::Method<R(A...)> call: an argument does not convert to "
                "the method's type for it");
  static constexpr bool kArgs = kN == 1 || (MsgpackArg<A> && ...);
  static_assert(kArgs,
                "a method of none or several arguments takes "
                "msgpack-encodable ones (rpc/typed.h; rpc::MsgpackArg)");
  static constexpr bool kValid = kCount && kConvert && kArgs;

  static Opt Options(const std::remove_reference_t<U>&... u) {
    if constexpr (kWithOptions) {
      return std::get<kN>(std::tie(u...));
    } else {
      return Opt();
    }
  }

  // The request payload (rpc/typed.h's contract says what is sent from
  // where).
  static CallPayload Encode(U&&... u) {
    auto all = std::forward_as_tuple(std::forward<U>(u)...);
    if constexpr (kN == 0) {
      return CallPayload::Owned(std::string());
    } else if constexpr (kN == 1) {
      using A0 = std::tuple_element_t<0, std::tuple<A...>>;
      using U0 = std::remove_cvref_t<std::tuple_element_t<0, std::tuple<U...>>>;
      if constexpr (std::is_same_v<U0, A0> && HasView<A0>) {
        return CallPayload::View(Codec<A0>::View(std::get<0>(all)));
      } else {
        std::string out;
        Codec<A0>::Encode(AsArg<A0>(std::get<0>(std::move(all))), out);
        return CallPayload::Owned(std::move(out));
      }
    } else {
      std::string out;
      StringSink sink{&out};
      msgpack::packer<StringSink> pk(sink);
      pk.pack_array(static_cast<uint32_t>(kN));
      PackEach(pk, std::move(all), std::make_index_sequence<kN>());
      return CallPayload::Owned(std::move(out));
    }
  }

 private:
  template <typename All, size_t... I>
  static void PackEach(msgpack::packer<StringSink>& pk, All&& all,
                       std::index_sequence<I...>) {
    (pk.pack(AsArg<A>(std::get<I>(std::move(all)))), ...);
  }
};

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
