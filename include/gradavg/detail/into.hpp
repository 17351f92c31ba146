// gradavg internals: average_gradients_into from the user's towers to the pass — the element
// types, every check (or a plan's proof), then the pass over the proved layout — and the
// allocating calls, which take the same path into the results they make.
#pragma once

#include <cstddef>
#include <ranges>
#include <type_traits>

#include "access.hpp"
#include "check.hpp"
#include "choices.hpp"
#include "elements.hpp"
#include "isa.hpp"
#include "pass.hpp"
#include "plan_check.hpp"
#include "validate.hpp"
#include "../errors.hpp"
#include "../options.hpp"
#include "../plan.hpp"
#include "../results.hpp"
#include "../statistics.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// average_gradients_into with gradients read as S and outputs written as O (the traits'
/// value_types, or the run-time types validate_elements found), after every check. With a plan,
/// the checks keep their proof in it (signature: the call's types).
template <class S, class O, class TG, class Means, class Squares>
summary average_into_typed(const TG& tg, Means& means, Squares* squares, const options& opts,
                           plan* planned = nullptr, const void* signature = nullptr) {
  constexpr bool with_squares = outputs_passed<Squares>;
  const std::size_t towers = std::ranges::size(tg);
  check_scratch scratch;  // uninitialised arrays: costs nothing unless used
  layout_proof* const proof = planned != nullptr ? proving_into(*planned) : nullptr;
  const validated v = [&] {
    const shared_detail::traced_span span(opts.run.timeline, "checks");
    validated checked = validate_into<TG, Means, Squares, S, O>(tg, means, squares, opts, scratch, proof);
    validate_options(opts, towers, checked.variables, accumulator_max<S>(opts));
    check_weights_apart(tg, checked.layout, checked.variables, towers, sizeof(O), opts);
    if (planned != nullptr) keep_proof<S, O>(*planned, signature, tg, checked, opts.check.aliasing);
    return checked;
  }();
  log_choices<S, O>(opts, planned != nullptr ? log_level::info : log_level::debug,
                    planned != nullptr ? "plan proved" : "call", v.variables, v.averaged, v.skipped, v.elements, towers,
                    with_squares);
  return average_layout<S, O>(v.layout, v.variables, towers, with_squares, v.elements, v.averaged, v.skipped, opts);
}

/// The allocating calls' pass with gradients read as S (results of the same element type): their
/// results made from tower 0's shapes (allocate_results), then average_gradients_into's path
/// into them, whose checks report any error in its order (the results are then dropped).
template <class S, class TG, class R, class V>
void average_gradients_typed(const TG& tower_grads, std::size_t variable_count, element_type element,
                             averaged_gradients<R, V>& result, bool with_squares, const options& opts) {
  allocated_outputs<R> outputs = allocate_results(tower_grads, variable_count, element, with_squares, result);
  options into = opts;
  // New results overlap nothing; an aliasing value that is no alias_check is still refused by
  // validate_options, in the checks' order.
  if (opts.check.aliasing <= alias_check::none) into.check.aliasing = alias_check::none;
  if (with_squares)
    result.report = average_into_typed<S, S>(tower_grads, outputs.means, &outputs.squares, into);
  else
    result.report = average_into_typed<S, S>(tower_grads, outputs.means, no_squares, into);
}

/// A call over tg whose buffers p proved (matches_plan): the options' checks and the pass.
template <class S, class O, class TG>
summary average_planned(plan& p, const TG& tg, bool with_squares, const options& opts) {
  using A = plan_access;
  try {
    validate_options(opts, A::towers(p), A::variables(p), accumulator_max<S>(opts));
    check_weights_apart(tg, A::proof(p).table(), A::variables(p), A::towers(p), sizeof(O), opts);
  } catch (...) {
    A::ready(p) = false;  // a failed call empties the plan
    throw;
  }
  log_choices<S, O>(opts, log_level::debug, "call (plan holds)", A::variables(p), A::averaged(p), A::skipped(p),
                    A::elements(p), A::towers(p), with_squares);
  return average_layout<S, O>(A::proof(p).table(), A::variables(p), A::towers(p),
                              with_squares, A::elements(p), A::averaged(p), A::skipped(p), opts);
}

/// average_gradients_into, with p (may be null) holding the proof of an earlier call's checks.
/// SameElements: every output holds its gradients' element type by construction (the libtorch
/// calls' outputs are replica 0's gradients or made like them): see with_kernel_types.
template <bool SameElements = false, class TG, class Means, class Squares>
summary average_into_impl(const TG& tg, Means& means, Squares* squares, const options& opts, plan* p = nullptr) {
  using G = gradient_tensor_t<TG>;
  using OT = output_tensor_t<Means&>;
  constexpr bool with_squares = outputs_passed<Squares>;
  static_assert(gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);
  static_assert(outputs_outlive_reads<Means&>,
                "gradavg: means yields outputs by value that own their elements; yield references or views");
  if constexpr (with_squares) {
    static_assert(outputs_outlive_reads<Squares&>,
                  "gradavg: squares yields outputs by value that own their elements; yield references or views");
    static_assert(std::is_same_v<tensor_value_t<output_tensor_t<Squares&>>, tensor_value_t<OT>>,
                  "gradavg: the squares outputs must hold the same element type as the means outputs");
  }
  const void* const signature = &shared_detail::signature_of<TG, Means, Squares>;
  if constexpr (static_tensor<G> && static_tensor<OT>) {
    using S = tensor_value_t<G>;
    using O = tensor_value_t<OT>;
    static_assert(supported_scalar<S>, "gradavg: gradient elements must be " GRADAVG_ELEMENT_TYPES_MESSAGE_);
    static_assert(supported_output<S, O>,
                  "gradavg: the means outputs must hold the gradients' element type (or float for 16-bit gradients)");
    if (p != nullptr && matches_plan<S, O>(*p, signature, tg, means, squares, opts))
      return average_planned<S, O>(*p, tg, with_squares, opts);
    return average_into_typed<S, O>(tg, means, squares, opts, p, signature);
  } else {
    if (p != nullptr && plan_access::ready(*p) && plan_access::signature(*p) == signature) {
      // The element types the plan proved, confirmed buffer by buffer by matches_plan.
      const call_elements kept{plan_access::gradients(*p), plan_access::outputs(*p)};
      bool matched = false;
      const summary s = with_kernel_types<G, OT, false, SameElements>(kept, true, [&]<class S, class O>() -> summary {
        if (!matches_plan<S, O>(*p, signature, tg, means, squares, opts)) return {};
        matched = true;
        return average_planned<S, O>(*p, tg, with_squares, opts);
      });
      if (matched) return s;
    }
    // Run-time element types: found and checked first, then the kernel of those types.
    if (p != nullptr) plan_access::ready(*p) = false;
    const std::size_t variable_count = validate_tower_counts(tg);
    const call_elements e = validate_elements(tg, variable_count, &means, squares);
    return with_kernel_types<G, OT, false, SameElements>(e, true, [&]<class S, class O>() {
      return average_into_typed<S, O>(tg, means, squares, opts, p, signature);
    });
  }
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
