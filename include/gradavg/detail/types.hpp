// gradavg internals: the element types — one list, and each type's traits. Everything that depends
// on the set of types derives from here: the run-time codes and their dispatch (with_element), the
// checks (supported_scalar, supported_output, output_element_allowed), the accumulator, the
// kernel's instances and the words of the messages that name the types.
//
// Adding an element type: its element_traits and its place in element_types and in
// GRADAVG_KERNEL_INSTANCES_ here, its element_type enumerator and name (tensor.hpp), and, for
// torch::Tensor, its dtype (torch_tensor.hpp). The kernel loads and stores a type it has no
// instructions for through static_cast to and from the accumulator (storage_level.hpp), which is
// exact or rounds to nearest where the type's conversions do.
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "isa.hpp"
#include "../tensor.hpp"

/// The words of the static_asserts that name the element types.
#define GRADAVG_ELEMENT_TYPES_MESSAGE_ "float, double, Eigen::half or Eigen::bfloat16"

/// Every (gradients, accumulator, outputs) element-type combination the library instantiates the
/// kernel for: X(S, Acc, O) for each (the passes of average.hpp, the buffers across processes).
/// Every type's own (S, accumulator_t<S>, S); (S, float, float) where its means may go to float
/// outputs; (float, double, float) for accumulate::in_double.
#define GRADAVG_KERNEL_INSTANCES_(X)                                                            \
  X(float, float, float) X(float, double, float) X(double, double, double)                      \
  X(Eigen::half, float, Eigen::half) X(Eigen::half, float, float)                               \
  X(Eigen::bfloat16, float, Eigen::bfloat16) X(Eigen::bfloat16, float, float)

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// What gradavg knows of an element type S: its run-time code, the type it is summed in (never 16
/// bits), and whether its means may be written to float outputs (the float master gradients of
/// mixed-precision training). Not defined for other types.
template <class S>
struct element_traits;

template <>
struct element_traits<float> {
  static constexpr element_type code = element_type::float32;
  using accumulator = float;
  static constexpr bool float_outputs = false;
};
template <>
struct element_traits<double> {
  static constexpr element_type code = element_type::float64;
  using accumulator = double;
  static constexpr bool float_outputs = false;
};
template <>
struct element_traits<Eigen::half> {
  static constexpr element_type code = element_type::float16;
  using accumulator = float;
  static constexpr bool float_outputs = true;
};
template <>
struct element_traits<Eigen::bfloat16> {
  static constexpr element_type code = element_type::bfloat16;
  using accumulator = float;
  static constexpr bool float_outputs = true;
};

template <class... T>
struct type_list {};

/// The element types, in element_type's order.
using element_types = type_list<float, double, Eigen::half, Eigen::bfloat16>;

template <class S, class List>
inline constexpr bool in_type_list = false;
template <class S, class... T>
inline constexpr bool in_type_list<S, type_list<T...>> = (std::is_same_v<S, T> || ...);

/// Element types the kernel reads.
template <class S>
inline constexpr bool supported_scalar = in_type_list<S, element_types>;

/// Type in which values stored as S are summed.
template <class S>
using accumulator_t = typename element_traits<S>::accumulator;

/// Output element types allowed for gradients of type S: S itself, or float where
/// element_traits<S>::float_outputs.
template <class S, class O>
inline constexpr bool supported_output = [] {
  if constexpr (supported_scalar<S>)
    return std::is_same_v<O, S> || (std::is_same_v<O, float> && element_traits<S>::float_outputs);
  else
    return false;
}();

/// The element_type of a supported scalar type.
template <class S>
constexpr element_type element_of_type() noexcept {
  return element_traits<S>::code;
}

/// Calls f.template operator()<S>() with the element type whose code is e (float for a code no
/// type has: element_type's values are checked where they enter).
template <class F>
decltype(auto) with_element(element_type e, F&& f) {
  return [&]<class... T>(type_list<T...>) -> decltype(auto) {
    using R = decltype(f.template operator()<float>());
    if constexpr (std::is_void_v<R>) {
      if (!((e == element_traits<T>::code ? (f.template operator()<T>(), true) : false) || ...))
        f.template operator()<float>();
    } else {
      R result{};
      if (!((e == element_traits<T>::code ? (result = f.template operator()<T>(), true) : false) || ...))
        result = f.template operator()<float>();
      return result;
    }
  }(element_types{});
}

/// Whether gradients of element type g may be averaged into outputs of element type o: the same
/// type, or float32 where g's traits allow it.
constexpr bool output_element_allowed(element_type g, element_type o) noexcept {
  return [&]<class... T>(type_list<T...>) {
    return o == g || (o == element_type::float32 && ((g == element_traits<T>::code && element_traits<T>::float_outputs) || ...));
  }(element_types{});
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
