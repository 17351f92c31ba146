// gradavg internals: the words of error messages (variables, values, shapes, towers), built only
// when something is wrong, and the rethrow that names the variable in a traits function's error.
#pragma once

#include <concepts>
#include <cstddef>
#include <exception>
#include <sstream>
#include <string>

#include "access.hpp"
#include "../entry.hpp"
#include "../errors.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// What variable_traits<V>::print writes, or "" when it writes nothing or throws.
template <class V>
std::string printed(const V& v) noexcept {
  try {
    std::ostringstream os;
    variable_traits<V>::print(os, v);
    return os.str();
  } catch (...) {
    return {};
  }
}

/// "variable #3 'conv1/weights'", or "variable #3" when the variable cannot be printed.
template <class V>
std::string describe_variable(std::size_t i, const V& v) {
  const std::string p = printed(v);
  std::string s = "variable #" + std::to_string(i);
  if (!p.empty()) s.append(" '").append(p).append("'");
  return s;
}

template <class V>
std::string describe_value(const V& v) {
  const std::string p = printed(v);
  if (p.empty()) return "(unprintable)";
  return std::string("'").append(p).append("'");
}

/// describe_variable of tower 0's variable i.
template <class TG>
std::string describe_variable_at(const TG& tg, std::size_t i) {
  return with_entry(tg, 0, i, [i](const entry_t<TG>& e) {
    return describe_variable(i, entry_traits<entry_t<TG>>::variable(e));
  });
}

/// Throws, with message and variable index i, an exception of the first of Types that e is (most
/// derived types first), or a gradavg::error.
template <class Type, class... Types>
[[noreturn]] void throw_same_type(const error& e, const std::string& message, std::size_t i) {
  if (dynamic_cast<const Type*>(&e) != nullptr) throw Type(message, i);
  if constexpr (sizeof...(Types) > 0)
    throw_same_type<Types...>(e, message, i);
  else
    throw error(message, i);
}

/// Inside a catch block: rethrows the current exception, and a gradavg::error that names no
/// variable as one of the same type naming variable i and `what` (e.g. "gradient on tower 2").
template <class TG>
void rethrow_located(const TG& tg, std::size_t i, const std::string& what) {
  try {
    throw;
  } catch (const error& e) {
    if (e.variable_index() != error::npos) throw;
    std::string message = e.what();
    if (message.rfind("gradavg: ", 0) == 0) message.erase(0, 9);
    throw_same_type<weight_error, option_error, tower_error, shape_error, index_error, element_type_error, unsupported_tensor_error,
                    missing_gradient_error, variable_mismatch_error, output_error, aliasing_error>(
        e, describe_variable_at(tg, i) + ": " + what + ": " + message, i);
  }
}

inline std::string describe_shape(const shape& s) {
  std::string out = "[";
  for (std::size_t d = 0; d < s.rank; ++d) out += (d ? ", " : "") + std::to_string(s.dims[d]);
  out += "]";
  if (s.rank >= 2) out += s.order == storage_order::row_major ? " row-major" : " col-major";
  return out;
}

/// How a message names t's shape: the traits' describe(t) where they have one (the shape in the
/// words of t's own library), else describe_shape of gradavg's shape.
template <class T>
std::string describe_tensor(const T& t) {
  if constexpr (requires { { tensor_traits<T>::describe(t) } -> std::convertible_to<std::string>; })
    return tensor_traits<T>::describe(t);
  else
    return describe_shape(tensor_traits<T>::shape(t));
}

/// describe_tensor of tower k's gradient of variable i (present).
template <class TG>
std::string describe_gradient_at(const TG& tg, std::size_t k, std::size_t i) {
  return with_entry(tg, k, i, [](const entry_t<TG>& e) {
    auto&& s = entry_traits<entry_t<TG>>::gradient(e);
    return describe_tensor(slot_get(s));
  });
}

/// describe_tensor of output i of outputs (present).
template <class Outputs>
std::string describe_output_at(Outputs& outputs, std::size_t i) {
  auto&& s = at(outputs, i);
  return describe_tensor(slot_get(s));
}

/// "1, 3 and 4": the first `listed` of `total` towers; "0, 1, ..., 15, ... (40 in all)" when
/// not all are listed.
inline std::string describe_towers(const std::size_t* towers, std::size_t listed, std::size_t total) {
  std::string out;
  for (std::size_t n = 0; n < listed; ++n) {
    if (n > 0) out += (n + 1 == listed && listed == total) ? " and " : ", ";
    out += std::to_string(towers[n]);
  }
  if (total > listed) out += ", ... (" + std::to_string(total) + " in all)";
  return out;
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
