// gradavg internals: run-time element types (tensor.hpp, "Run-time element types"). One call
// reads all its gradients as one element type and writes all its outputs as one; these checks
// find them, before anything is written, and the call then runs the kernel of those types.
#pragma once

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "isa.hpp"
#include "kernel.hpp"
#include "types.hpp"
#include "validate.hpp"
#include "../errors.hpp"
#include "../statistics.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// t's element type: the traits' element(t), or value_type's.
template <class T>
element_type element_of(const T& t) {
  if constexpr (dynamic_tensor<T>)
    return tensor_traits<T>::element(t);
  else
    return element_of_type<tensor_value_t<T>>();
}

/// The element types one call reads its gradients and writes its outputs as.
struct call_elements {
  element_type gradients = element_type::float32;
  element_type outputs = element_type::float32;
};

/// The element type of every present gradient of tg (tensors of run-time element type); nullopt
/// when none is present. Two that differ: element_type_error naming both.
template <class TG>
std::optional<element_type> gradients_element(const TG& tg, std::size_t variable_count) {
  using E = entry_t<TG>;
  const std::size_t tower_count = std::ranges::size(tg);
  std::optional<element_type> first;  // the first present gradient's type, at first_variable / first_tower
  std::size_t first_variable = 0, first_tower = 0;
  for (std::size_t i = 0; i < variable_count; ++i) {
    std::optional<element_type> own;  // this variable's first present gradient's type
    std::size_t own_tower = 0;
    for (std::size_t k = 0; k < tower_count; ++k) {
      const std::optional<element_type> t = with_entry(tg, k, i, [&](const E& e) -> std::optional<element_type> {
        try {
          auto&& s = entry_traits<E>::gradient(e);
          if (!slot_present(s)) return std::nullopt;
          return element_of(slot_get(s));
        } catch (const error&) {
          rethrow_located(tg, i, "gradient on tower " + std::to_string(k));
        }
      });
      if (!t) continue;
      if (!own) {
        own = t;
        own_tower = k;
      }
      if (!first) {
        first = t;
        first_variable = i;
        first_tower = k;
      } else if (*t != *first) {
        std::string message = describe_variable_at(tg, i) + ": gradient on tower " + std::to_string(k) + " is " +
                              std::string(element_name(*t)) + " but ";
        if (*own != *t)
          message += "on tower " + std::to_string(own_tower) + " is " + std::string(element_name(*own));
        else
          message += describe_variable_at(tg, first_variable) + "'s gradient on tower " + std::to_string(first_tower) +
                     " is " + std::string(element_name(*first));
        message +=
            "; every gradient of one call must have the same element type (convert, or average each element type "
            "in a call of its own)";
        throw element_type_error(message, i);
      }
    }
  }
  return first;
}

/// The outputs' element type as far as check_output_elements has seen them.
struct output_elements {
  std::optional<element_type> type;
  std::size_t variable = 0;      // where type was first seen
  const char* what = "means";
};

/// Checks the element type of every output of `outputs` ("means" or "squares") that will be
/// written (its variable's gradient on tower 0 present): allowed for gradients of type
/// `gradients`, and the same as every output seen before (output_error). Nothing when the range
/// does not hold one output per variable (validate_into reports the count).
template <class TG, class Outputs>
void check_output_elements(const TG& tg, std::size_t variable_count, Outputs& outputs, const char* what,
                           element_type gradients, output_elements& seen) {
  using E = entry_t<TG>;
  using O = output_tensor_t<Outputs&>;
  if (std::ranges::size(outputs) != variable_count) return;
  for (std::size_t i = 0; i < variable_count; ++i) {
    std::optional<element_type> o;
    try {
      if (!with_entry(tg, 0, i, [](const E& e) { return slot_present(entry_traits<E>::gradient(e)); })) continue;
      auto&& s = at(outputs, i);
      if (!slot_present(s)) continue;  // validate_into reports the null output
      o = element_of(slot_get(s));
    } catch (const error&) {
      rethrow_located(tg, i, std::string("the ") + what + " output");
    }
    if (!output_element_allowed(gradients, *o))
      throw output_error(describe_variable_at(tg, i) + ": the " + what + " output is " + std::string(element_name(*o)) +
                             " but the gradients are " + std::string(element_name(gradients)) +
                             "; outputs hold the gradients' element type (or float32 for 16-bit gradients)",
                         i);
    if (!seen.type) {
      seen = {o, i, what};
    } else if (*o != *seen.type) {
      throw output_error(describe_variable_at(tg, i) + ": the " + what + " output is " + std::string(element_name(*o)) +
                             " but the " + seen.what + " output of " + describe_variable_at(tg, seen.variable) +
                             " is " + std::string(element_name(*seen.type)) +
                             "; all outputs of one call must have the same element type",
                         i);
    }
  }
  // A static output type is the call's output type even where nothing is written.
  if constexpr (!dynamic_tensor<O>)
    if (!seen.type) seen.type = element_of_type<tensor_value_t<O>>();
}

/// Finds the call's element types and checks that every present gradient has the same one
/// (element_type_error) and every output that will be written holds it or float32 for 16-bit
/// gradients, all outputs the same (output_error). Outputs are checked only when each range
/// holds one per variable (validate_into reports the count otherwise). Means / Squares may be
/// no_outputs (no_means, no_squares: the allocating API). Needs validated tower counts.
template <class TG, class Means, class Squares>
call_elements validate_elements(const TG& tg, std::size_t variable_count, Means* means, Squares* squares) {
  using G = gradient_tensor_t<TG>;
  std::optional<element_type> gradients;
  if constexpr (dynamic_tensor<G>)
    gradients = gradients_element(tg, variable_count);
  else
    gradients = element_of_type<tensor_value_t<G>>();
  // Until a gradient is found, outputs are checked as float32 ones are (the default).
  call_elements result;
  if (gradients) result.gradients = *gradients;
  output_elements outputs;
  if constexpr (outputs_passed<Means>)
    check_output_elements(tg, variable_count, *means, "means", result.gradients, outputs);
  if constexpr (outputs_passed<Squares>)
    check_output_elements(tg, variable_count, *squares, "squares", result.gradients, outputs);
  result.outputs = outputs.type ? *outputs.type : result.gradients;
  // Nothing is read: any gradient type the outputs accept.
  if (!gradients) result.gradients = result.outputs;
  return result;
}

[[noreturn]] inline void throw_output_element(element_type gradients, element_type outputs) {
  throw output_error("gradavg: the outputs are " + std::string(element_name(outputs)) + " but the gradients are " +
                     std::string(element_name(gradients)) +
                     "; outputs hold the gradients' element type (or float32 for 16-bit gradients)");
}

/// Calls f.template operator()<S, O>() (returning a summary) with the gradients' element type S
/// and the outputs' O of a call over tensor types G and OT, from e for dynamic tensors (e: what
/// validate_elements found; types_known false when it threw, so e holds nothing). A pair the
/// kernel does not have (validate_elements rejects each first): throws output_error, or, where
/// every process must still take part in the call (Agree), runs the outputs' type's kernel.
/// SameElements: the caller made every output of its gradients' element type, so the kernels that
/// write float for 16-bit gradients are not compiled (other outputs: output_error).
template <class G, class OT, bool Agree, bool SameElements = false, class F>
summary with_kernel_types(const call_elements& e, bool types_known, F&& f) {
  auto with_gradients = [&]<class S>() -> summary {
    if constexpr (dynamic_tensor<OT>) {
      if (types_known && e.outputs != e.gradients) {
        if constexpr (!SameElements && element_traits<S>::float_outputs)
          return f.template operator()<S, float>();
        else if constexpr (!Agree)
          throw_output_element(e.gradients, e.outputs);
      }
      return f.template operator()<S, S>();
    } else {
      using O = tensor_value_t<OT>;
      if constexpr (supported_output<S, O>)
        return f.template operator()<S, O>();
      else if constexpr (Agree)
        return f.template operator()<O, O>();
      else
        throw_output_element(e.gradients, e.outputs);
    }
  };
  if constexpr (dynamic_tensor<G>)
    return with_element(e.gradients, with_gradients);
  else
    return with_gradients.template operator()<tensor_value_t<G>>();
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
