// gradavg: what a tower holds for one variable — a (gradient, variable) entry — and how the
// library reads it. Three customisation points, each with defaults that cover common types:
//
//   entry_traits<E>     gradient(e) and variable(e) of an entry. Default: std::pair / std::tuple of
//                       two (get<0>, get<1>), or any type with members .gradient and .variable.
//   slot access         a gradient slot is a tensor, a std::reference_wrapper to one, or a
//                       pointer-like holder of one — raw or smart pointer, std::optional — which
//                       is absent when it converts to false (the seed's None); a tensor itself is
//                       absent when its tensor_traits define present() and it returns false.
//   variable_traits<V>  same(a, b) to check that towers agree, print(os, v) for messages.
//                       Default: operator== when it exists (strcmp for C strings), operator<< when
//                       it exists (through the pointer for pointers to printable objects).
//                       print is called only to build an error message; if it throws, the
//                       message names the variable by position.
//
// Lifetimes: a tower, an entry or a gradient may be yielded by value (a views::transform making
// pairs, a gradient() returning a span). gradavg holds each such value while it reads it, and keeps
// only pointers to the elements, so a gradient yielded by value must be a view whose elements
// outlive it: a raw pointer, std::reference_wrapper, a tensor whose tensor_traits has
// `static constexpr bool view = true;` (std::span, Eigen::Map, Eigen::TensorMap, a non-const
// Eigen::Ref), or a std::optional of one. An owning gradient yielded by value (std::vector,
// Eigen::Matrix, Eigen::Ref<const ...>, a smart pointer) is rejected at compile time. Gradients held
// by the caller and yielded by reference may be anything.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstring>
#include <functional>
#include <ostream>
#include <tuple>
#include <type_traits>
#include <utility>

#include "detail/isa.hpp"
#include "tensor.hpp"

// The entry vocabulary, shared by every instruction-set level (detail/isa.hpp).
namespace gradavg {

namespace shared_detail {

template <class V>
concept printable = requires(std::ostream& os, const V& v) { os << v; };

}  // namespace shared_detail

/// A named (gradient, variable) entry; std::pair works just as well.
template <class Gradient, class Variable>
struct grad_and_var {
  Gradient gradient;
  Variable variable;
};

/// Primary template: tuple-like entries of two, or types with .gradient and .variable.
template <class E>
struct entry_traits {
  static constexpr decltype(auto) gradient(const E& e) noexcept {
    if constexpr (requires { e.gradient; })
      return (e.gradient);
    else
      return std::get<0>(e);
  }
  static constexpr decltype(auto) variable(const E& e) noexcept {
    if constexpr (requires { e.variable; })
      return (e.variable);
    else
      return std::get<1>(e);
  }
};

/// How variables are compared across towers and shown in messages. Specialise for your
/// variable type; a missing same() turns the cross-tower check off for that type.
template <class V>
struct variable_traits {
  static bool same(const V& a, const V& b)
    requires std::equality_comparable<V>
  {
    if constexpr (std::is_same_v<std::remove_cv_t<V>, const char*> || std::is_same_v<std::remove_cv_t<V>, char*>)
      return a == b || (a != nullptr && b != nullptr && std::strcmp(a, b) == 0);
    else
      return a == b;
  }

  /// Prints v, or nothing when it cannot be printed (messages then name the position only).
  /// Pointers print what they point to when that is printable, else the address.
  static void print(std::ostream& os, const V& v) {
    if constexpr (std::is_pointer_v<V>) {
      using pointee = std::remove_cv_t<std::remove_pointer_t<V>>;
      if constexpr (std::is_function_v<pointee>) {
        return;
      } else {
        if (v == nullptr)
          os << "null";
        else if constexpr (std::is_same_v<pointee, char>)
          os << v;
        else if constexpr (!std::is_void_v<pointee> && shared_detail::printable<pointee>)
          os << *v;
        else
          os << static_cast<const void*>(v);
      }
    } else if constexpr (shared_detail::printable<V>) {
      os << v;
    }
  }
};

}  // namespace gradavg

// How the library reads slots: per level, with the library's internals.
namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE

namespace detail {

template <class T>
struct is_reference_wrapper : std::false_type {};
template <class T>
struct is_reference_wrapper<std::reference_wrapper<T>> : std::true_type {};

/// x itself, or the object x refers to when x is a std::reference_wrapper.
template <class T>
constexpr decltype(auto) unwrap_ref(T& x) noexcept {
  if constexpr (is_reference_wrapper<std::remove_cv_t<T>>::value)
    return x.get();
  else
    return (x);
}

/// The object a slot refers to once reference_wrappers are seen through.
template <class S>
using unwrapped_t = std::remove_cvref_t<decltype(unwrap_ref(std::declval<S&>()))>;

/// A slot that is itself a tensor (or a reference_wrapper to one): always present.
template <class S>
concept direct_slot = tensor<unwrapped_t<S>>;

/// A pointer-like slot (pointer, smart pointer, optional) to a tensor: may be absent.
template <class S>
concept nullable_slot = !direct_slot<S> && requires(S& s) {
  static_cast<bool>(s);
  *s;
  requires tensor<unwrapped_t<std::remove_reference_t<decltype(*s)>>>;
};

template <class S>
concept slot = direct_slot<S> || nullable_slot<S>;

/// Whether a tensor holds a value: tensor_traits<T>::present(t) where T defines it (a framework
/// tensor that can be undefined, the seed's None), else true.
template <class T>
constexpr bool tensor_present(const T& t) {
  if constexpr (requires { { tensor_traits<T>::present(t) } -> std::convertible_to<bool>; })
    return static_cast<bool>(tensor_traits<T>::present(t));
  else
    return true;
}

/// A slot is absent when it is null (pointer-like) or when its tensor says it holds no value.
template <slot S>
constexpr bool slot_present(const S& s) {
  if constexpr (direct_slot<S>)
    return tensor_present(unwrap_ref(s));
  else
    return static_cast<bool>(s) && tensor_present(unwrap_ref(*s));
}

/// The tensor in a present slot, with the constness the slot gives it.
template <class S>
  requires slot<std::remove_cvref_t<S>>
constexpr decltype(auto) slot_get(S& s) noexcept {
  if constexpr (direct_slot<std::remove_cvref_t<S>>)
    return unwrap_ref(s);
  else
    return unwrap_ref(*s);
}

template <slot S>
using slot_tensor_t = std::remove_cvref_t<decltype(slot_get(std::declval<const S&>()))>;

template <class V>
concept comparable_variable = requires(const V& a, const V& b) {
  { variable_traits<V>::same(a, b) } -> std::convertible_to<bool>;
};

}  // namespace detail

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
