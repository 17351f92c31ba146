// gradavg: averaging gradients over towers (data-parallel replicas).
//
// tower_grads is a random-access range over towers; tower k is a random-access range of
// (gradient, variable) entries, one per variable, in the same variable order on every tower
// (std::vector<std::vector<std::pair<G, V>>>, spans of spans, ...). See entry.hpp for what an
// entry and a gradient slot may be, and tensor.hpp for the tensor customisation point.
//
// For each variable i:
//   mean[i]   = (sum over towers k of g_k[i]) / T              element-wise, summed in tower order
//   square[i] = (sum over towers k of g_k[i] * g_k[i]) / T      mean of squares (not square of mean)
// A gradient absent on every tower skips the variable (reported, nothing written); absent on some
// towers only is an error. options add, in the same pass: 16-bit gradients and double
// accumulation, tower weights, a scale, non-finite detection, statistics (global norm, noise),
// per-variable results and element ranges (options.hpp, statistics.hpp, docs/fused-step.md).
// Everything is validated before anything is written: after an exception, the caller's outputs
// are unchanged.
#pragma once

#include <concepts>
#include <cstddef>
#include <exception>
#include <ranges>
#include <type_traits>
#include <utility>
#include <vector>

#include "detail/into.hpp"
#include "detail/isa.hpp"
#include "detail/pass.hpp"
#include "entry.hpp"
#include "errors.hpp"
#include "executor.hpp"
#include "options.hpp"
#include "plan.hpp"
#include "results.hpp"
#include "statistics.hpp"
#include "tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE

/// A range of towers, each a range of (gradient, variable) entries that gradavg can read.
template <class TG>
concept tower_gradients =
    std::ranges::random_access_range<const TG> && std::ranges::sized_range<const TG> &&
    std::ranges::random_access_range<std::remove_reference_t<detail::tower_ref_t<TG>>> &&
    std::ranges::sized_range<std::remove_reference_t<detail::tower_ref_t<TG>>> &&
    detail::slot<detail::gradient_slot_t<TG>> && tensor<detail::gradient_tensor_t<TG>>;

/// Averages into outputs the caller owns: means[i] receives variable i's mean gradient.
/// means is a random-access range with one output per variable: a writable tensor, a
/// reference_wrapper to one, or a pointer-like to one (null allowed only where the variable is
/// skipped). Outputs of skipped variables are left untouched; a variable is skipped exactly when
/// its gradient is absent on tower 0 (and so, validly, on every tower).
///
/// Aliasing: means[i] may be tower 0's gradient i itself (same data, same shape): averaging in
/// place. No other overlap between an output and any gradient or other output is allowed;
/// options.check.aliasing says how much of that is checked (aliasing_error): by default everything,
/// O(N log N) in the N = V*(T+2) buffers (with a plan, below, nothing while the buffers are the
/// proved ones).
///
/// Allocates nothing, except the call's table of buffers (gradients and outputs) when more than
/// 256 are passed without a plan (and a plan's own memory the first time it holds a table that
/// large). Throws a gradavg::error before writing anything.
template <tower_gradients TG, class Means>
  requires detail::output_range<Means&>
summary average_gradients_into(const TG& tower_grads, Means&& means, const options& opts = {}) {
  return detail::average_into_impl(tower_grads, means, detail::no_squares, opts);
}

/// As above, and squares[i] receives the mean over towers of variable i's squared gradient.
/// squares[i] may overlap nothing (not even tower 0's gradient).
template <tower_gradients TG, class Means, class Squares>
  requires detail::output_range<Means&> && detail::output_range<Squares&>
summary average_gradients_into(const TG& tower_grads, Means&& means, Squares&& squares, const options& opts = {}) {
  return detail::average_into_impl(tower_grads, means, &squares, opts);
}

/// As above, keeping in p what the checks proved (plan.hpp): a later call with p over the same
/// buffers compares each one's presence, first element, element count and contiguity with the proof
/// instead of checking variables, shapes and overlaps again, and the kernel reads the pointers from
/// p. Over other buffers, every check runs and p keeps the new proof. Allocates nothing once p
/// holds a proof of the same size. (P is plan: a template parameter so that calls without a plan
/// never try this overload.)
template <std::same_as<plan> P, tower_gradients TG, class Means>
  requires detail::output_range<Means&>
summary average_gradients_into(P& p, const TG& tower_grads, Means&& means, const options& opts = {}) {
  return detail::average_into_impl(tower_grads, means, detail::no_squares, opts, &p);
}

/// As above, with squares (see the second average_gradients_into).
template <std::same_as<plan> P, tower_gradients TG, class Means, class Squares>
  requires detail::output_range<Means&> && detail::output_range<Squares&>
summary average_gradients_into(P& p, const TG& tower_grads, Means&& means, Squares&& squares,
                               const options& opts = {}) {
  return detail::average_into_impl(tower_grads, means, &squares, opts, &p);
}

namespace detail {

/// The allocating calls (average_gradients with and without include_square).
template <class Tensor, class TG>
auto average_allocating(const TG& tower_grads, bool with_squares, const options& opts) {
  using G = gradient_tensor_t<TG>;
  static_assert(std::is_same_v<Tensor, deduce_tensor> || std::is_same_v<Tensor, G>,
                "gradavg: average_gradients<Tensor>: Tensor must be the gradients' tensor type");
  static_assert(resultable_tensor<G>,
                "gradavg: tensor_traits<Gradient> needs result_type and make() for the allocating API; "
                "use average_gradients_into with outputs you own");
  using R = typename tensor_traits<G>::result_type;
  using V = variable_t<TG>;
  static_assert(dynamic_tensor<G> || supported_scalar<tensor_value_t<G>>,
                "gradavg: gradient elements must be " GRADAVG_ELEMENT_TYPES_MESSAGE_);
  static_assert(gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);

  // Only what making the results needs is read here: every other check is average_gradients_into's.
  require_whole_range(opts);
  const std::size_t variable_count = validate_tower_counts(tower_grads);
  averaged_gradients<R, V> result;
  if constexpr (dynamic_tensor<G>) {
    const element_type e = validate_elements(tower_grads, variable_count, detail::no_means, detail::no_squares)
                               .gradients;
    with_element(e, [&]<class S>() {
      average_gradients_typed<S>(tower_grads, variable_count, e, result, with_squares, opts);
    });
  } else {
    using S = tensor_value_t<G>;
    average_gradients_typed<S>(tower_grads, variable_count, element_of_type<S>(), result, with_squares, opts);
  }
  return result;
}

/// The allocating calls across processes (gradavg::mpi's and gradavg::c10d's average_gradients):
/// results allocated from this rank's towers (local: the options' one-process groups), then
/// call(means, squares: a pointer or no_squares, prior), where prior is a failure before it,
/// which the call passes to its first collective (every rank throws, none waits).
template <class TG, class Call>
auto average_allocating_across(const TG& tower_grads, bool with_squares, const options& local, Call&& call) {
  using G = gradient_tensor_t<TG>;
  static_assert(resultable_tensor<G>,
                "gradavg: tensor_traits<Gradient> needs result_type and make() for the allocating API; "
                "use average_gradients_into with outputs you own");
  using R = typename tensor_traits<G>::result_type;
  averaged_gradients<R, variable_t<TG>> result;
  allocated_outputs<R> outputs;
  std::exception_ptr prior;
  try {
    const std::size_t towers = std::ranges::size(tower_grads);
    const std::size_t variable_count = towers == 0 ? 0 : std::ranges::size(at(tower_grads, 0));
    require_whole_range(local);
    element_type element = element_type::float32;
    if constexpr (dynamic_tensor<G>)
      element = validate_elements(tower_grads, validate_tower_counts(tower_grads), no_means, no_squares).gradients;
    outputs = allocate_results(tower_grads, variable_count, element, with_squares, result);
  } catch (...) {
    prior = std::current_exception();
  }
  result.report = with_squares ? call(outputs.means, &outputs.squares, prior) : call(outputs.means, no_squares, prior);
  return result;
}

}  // namespace detail

/// The seed's _average_gradients: returns, for each variable, its mean gradient over the towers
/// paired with tower 0's variable, and the skipped variables (averaged_gradients). Tensor, when
/// given, must be the gradients' tensor type (it documents the call; it is otherwise deduced).
/// Results have tensor_traits<Tensor>::result_type, of the gradients' element type.
template <class Tensor = detail::deduce_tensor, tower_gradients TG>
auto average_gradients(const TG& tower_grads, const options& opts = {}) {
  return detail::average_allocating<Tensor>(tower_grads, false, opts);
}

/// As above, and the means over towers of the squared gradients (the seed's include_square=True):
/// average_gradients(tower_grads, gradavg::include_square).
template <class Tensor = detail::deduce_tensor, tower_gradients TG>
auto average_gradients(const TG& tower_grads, include_square_t, const options& opts = {}) {
  return detail::average_allocating<Tensor>(tower_grads, true, opts);
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
