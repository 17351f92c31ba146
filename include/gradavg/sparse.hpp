// gradavg: averaging row-sparse gradients (sparse_types.hpp: TensorFlow's IndexedSlices, a sparse
// embedding's gradient) over towers, without densifying them.
//
// tower_grads is as for average.hpp, each entry's gradient slot a row-sparse gradient (or a
// reference_wrapper to one, or a pointer-like holder: null is the seed's None). For each variable i
// the call computes what average_gradients_into computes over the densified gradients
// (sparse_types.hpp's densify), with the same options:
//   mean[i]   = (densify(g_0) + ... + densify(g_{T-1})) / T                 summed in tower order
//   square[i] = (densify(g_0)^2 + ... + densify(g_{T-1})^2) / T
// bit for bit, element by element (with weights, scale, accumulation and non-finite policy
// likewise), while it reads only the rows some tower lists. Skipped (absent on every tower) and
// partly absent (missing_gradient_error) as for dense gradients. Every tower must give the same
// dense shape (shape_error); every index must name a row (index_error).
//
// The output each variable receives is chosen by the range passed:
//   - dense: a writable tensor of the dense shape (tensor.hpp), every element written (the rows
//     no tower lists receive the kernel's result for zeros: +0, -0 under a negative scale);
//   - coalesced: a sparse_rows<Index, O> (Index: the gradients' index type), resized and filled
//     with the rows some tower lists, ascending, each once, and their results.
// O is the gradients' value type, or float for 16-bit gradients. Means and squares may take
// different forms. Outputs overlap nothing (aliasing_error, unless options.check.aliasing is
// alias_check::none): no averaging in place. options.compute.range must be whole (option_error).
// Statistics (options.compute.statistics, per_variable) are sums over the same values as the
// dense call's, in another order: equal within rounding, not bit for bit.
//
// Mixing: a call's gradients are all row-sparse; a variable whose gradient is dense goes to
// average.hpp's call. Everything is validated before anything is written: after an exception, the
// caller's outputs are unchanged. The call allocates its scratch, and the coalesced outputs'
// vectors grow as needed; with a sparse_workspace, a loop's calls allocate nothing once the
// workspace and the outputs have grown to their size.
#pragma once

#include <concepts>
#include <cstddef>
#include <ranges>
#include <type_traits>
#include <utility>
#include <vector>

#include "detail/isa.hpp"
#include "detail/sparse_pass.hpp"
#include "entry.hpp"
#include "errors.hpp"
#include "options.hpp"
#include "results.hpp"
#include "sparse_types.hpp"
#include "statistics.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE

/// A range of towers, each a range of (row-sparse gradient, variable) entries.
template <class TG>
concept sparse_tower_gradients =
    std::ranges::random_access_range<const TG> && std::ranges::sized_range<const TG> &&
    std::ranges::random_access_range<std::remove_reference_t<detail::tower_ref_t<TG>>> &&
    std::ranges::sized_range<std::remove_reference_t<detail::tower_ref_t<TG>>> &&
    detail::sparse_slot<detail::gradient_slot_t<TG>>;

namespace detail {

/// The calls into outputs: the types checked, then average_sparse_typed with w's scratch (or a
/// call's own).
template <class TG, class Means, class Squares>
summary average_sparse_into(const TG& tg, Means& means, Squares* squares, const options& opts,
                            sparse_workspace* w) {
  using S = sparse_value_t<TG>;
  using I = sparse_index_t<TG>;
  using O = typename sparse_output_value<Means&>::type;
  static_assert(sparse_index<I>, "gradavg: row-sparse indices must be std::int32_t or std::int64_t");
  static_assert(supported_scalar<S>, "gradavg: gradient elements must be " GRADAVG_ELEMENT_TYPES_MESSAGE_);
  static_assert(supported_output<S, O>,
                "gradavg: the means outputs must hold the gradients' element type (or float for 16-bit gradients)");
  static_assert(gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);
  auto check_index = []<class Outputs>(Outputs*) {
    if constexpr (coalesced_outputs<Outputs&>)
      static_assert(std::is_same_v<typename coalesced_t<Outputs&>::index_type, I>,
                    "gradavg: coalesced outputs must hold the gradients' index type");
  };
  check_index(&means);
  if constexpr (outputs_passed<Squares>) {
    check_index(squares);
    static_assert(std::is_same_v<typename sparse_output_value<Squares&>::type, O>,
                  "gradavg: the squares outputs must hold the same element type as the means outputs");
  }
  if (w != nullptr) return average_sparse_typed<S, O>(tg, means, squares, opts, shared_detail::sparse_access::of(*w));
  shared_detail::sparse_scratch scratch;
  return average_sparse_typed<S, O>(tg, means, squares, opts, scratch);
}

/// The allocating calls: a sparse_rows per averaged variable, then the call into them.
template <class TG>
auto average_sparse_allocating(const TG& tg, bool with_squares, const options& opts) {
  using R = sparse_rows<sparse_index_t<TG>, sparse_value_t<TG>>;
  using V = variable_t<TG>;
  require_whole_range(opts);
  const std::size_t variables = validate_tower_counts(tg);
  averaged_gradients<R, V> result;
  std::vector<R*> means(variables, nullptr), squares;
  std::vector<std::size_t> slot(variables, 0);
  for (std::size_t i = 0; i < variables; ++i) {
    if (!read_sparse(tg, 0, i).present) {
      result.skipped.push_back({i, variable_copy(tg, i)});
      continue;
    }
    slot[i] = result.gradients.size();
    result.gradients.emplace_back(R{}, variable_copy(tg, i));
    if (with_squares) result.squares.emplace_back(R{}, result.gradients.back().second);
  }
  if (with_squares) squares.assign(variables, nullptr);
  for (std::size_t i = 0; i < variables; ++i) {
    if (!read_sparse(tg, 0, i).present) continue;
    means[i] = &result.gradients[slot[i]].first;
    if (with_squares) squares[i] = &result.squares[slot[i]].first;
  }
  options into = opts;
  if (opts.check.aliasing <= alias_check::none) into.check.aliasing = alias_check::none;  // new outputs
  result.report = with_squares ? average_sparse_into(tg, means, &squares, into, nullptr)
                               : average_sparse_into(tg, means, no_squares, into, nullptr);
  return result;
}

}  // namespace detail

/// Averages row-sparse gradients into outputs the caller owns: means[i] receives variable i's mean,
/// dense or coalesced (see the file comment). Outputs of skipped variables are left untouched.
template <sparse_tower_gradients TG, class Means>
  requires detail::sparse_output_range<Means&>
summary average_gradients_into(const TG& tower_grads, Means&& means, const options& opts = {}) {
  return detail::average_sparse_into(tower_grads, means, detail::no_squares, opts, nullptr);
}

/// As above, and squares[i] receives the mean over towers of variable i's squared (densified)
/// gradient.
template <sparse_tower_gradients TG, class Means, class Squares>
  requires detail::sparse_output_range<Means&> && detail::sparse_output_range<Squares&>
summary average_gradients_into(const TG& tower_grads, Means&& means, Squares&& squares, const options& opts = {}) {
  return detail::average_sparse_into(tower_grads, means, &squares, opts, nullptr);
}

/// As above, with the scratch kept in w (no allocation once it has grown to the calls' size).
template <std::same_as<sparse_workspace> W, sparse_tower_gradients TG, class Means>
  requires detail::sparse_output_range<Means&>
summary average_gradients_into(W& w, const TG& tower_grads, Means&& means, const options& opts = {}) {
  return detail::average_sparse_into(tower_grads, means, detail::no_squares, opts, &w);
}

template <std::same_as<sparse_workspace> W, sparse_tower_gradients TG, class Means, class Squares>
  requires detail::sparse_output_range<Means&> && detail::sparse_output_range<Squares&>
summary average_gradients_into(W& w, const TG& tower_grads, Means&& means, Squares&& squares,
                               const options& opts = {}) {
  return detail::average_sparse_into(tower_grads, means, &squares, opts, &w);
}

/// The seed's _average_gradients over row-sparse gradients: for each averaged variable its mean
/// as coalesced rows (sparse_rows of the gradients' index and value types), paired with tower 0's
/// variable, and the skipped variables.
template <sparse_tower_gradients TG>
auto average_gradients(const TG& tower_grads, const options& opts = {}) {
  return detail::average_sparse_allocating(tower_grads, false, opts);
}

/// As above, and the means of the squared gradients (the seed's include_square=True).
template <sparse_tower_gradients TG>
auto average_gradients(const TG& tower_grads, include_square_t, const options& opts = {}) {
  return detail::average_sparse_allocating(tower_grads, true, opts);
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
