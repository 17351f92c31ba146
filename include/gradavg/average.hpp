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
// towers only is an error. Everything is validated before anything is written: after an
// exception, the caller's outputs are unchanged.
#pragma once

#include <cstddef>
#include <ranges>
#include <type_traits>
#include <utility>
#include <vector>

#include "detail/isa.hpp"
#include "detail/kernel.hpp"
#include "detail/parallel.hpp"
#include "detail/validate.hpp"
#include "entry.hpp"
#include "errors.hpp"
#include "executor.hpp"
#include "options.hpp"
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

/// A variable whose gradient was absent on every tower.
template <class Variable>
struct skipped_variable {
  std::size_t index;  ///< position in the towers' variable order
  Variable variable;  ///< tower 0's variable
};

/// What average_gradients returns: the seed's (average_grads, average_grads_square), plus the
/// variables it skipped, which the seed only printed.
template <class Tensor, class Variable>
struct averaged_gradients {
  /// (mean gradient, tower 0's variable) for every averaged variable, in variable order.
  std::vector<std::pair<Tensor, Variable>> gradients;
  /// (mean of squared gradients, variable), same order; empty unless options.include_square.
  std::vector<std::pair<Tensor, Variable>> squares;
  /// Variables left out because their gradient was absent on every tower.
  std::vector<skipped_variable<Variable>> skipped;
  /// Counts, non-finite report and fused statistics, as average_gradients_into returns them.
  summary report;
};

namespace detail {

struct deduce_tensor {};

/// Runs the kernel over every variable: size_of(i) elements (0 for a skipped variable),
/// tower_data(i, k) tower k's first element, mean_ptr(i) / square_ptr(i) the outputs (square_ptr
/// returns null for every i when with_squares is false).
/// All variables' elements form one flat range, split into contiguous chunks (one per thread):
/// each chunk walks the variables it covers, so small variables share a fork/join.
template <class S, class SizeOf, class TowerData, class MeanPtr, class SquarePtr>
void average_all(std::size_t variable_count, std::size_t tower_count, const SizeOf& size_of,
                 const TowerData& tower_data, const MeanPtr& mean_ptr, const SquarePtr& square_ptr, bool with_squares,
                 const options& opts) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < variable_count; ++i) total += size_of(i);
  // Every element of the flat range reads one value per tower and writes a mean (and a square).
  const std::size_t bytes_per_element = (tower_count + (with_squares ? 2 : 1)) * sizeof(S);
  const std::size_t chunks = chunk_count(total, bytes_per_element, opts);
  constexpr std::size_t granularity = split_granularity<S>();

  // Elements [first, last) of the flat range.
  auto run = [&](std::size_t first, std::size_t last) {
    std::size_t offset = 0;  // flat index of variable i's first element
    for (std::size_t i = 0; i < variable_count && offset < last; ++i) {
      const std::size_t n = size_of(i);
      if (n == 0) continue;
      if (offset + n > first) {
        const std::size_t begin = first > offset ? first - offset : 0;
        const std::size_t end = std::min(n, last - offset);
        reduce_range<S>([&tower_data, i](std::size_t k) -> const S* { return tower_data(i, k); }, tower_count, begin,
                        end, mean_ptr(i), square_ptr(i), opts.streaming_stores);
      }
      offset += n;
    }
  };
  auto chunk = [&](std::size_t c) {
    auto bound = [&](std::size_t b) { return b == chunks ? total : total / chunks * b / granularity * granularity; };
    run(bound(c), bound(c + 1));
  };
  run_chunks(chunks, chunk, opts);
}

/// average_all reading every gradient again through tower_grads.
template <class TG, class MeanPtr, class SquarePtr>
void average_all_entries(const TG& tg, std::size_t variable_count, const MeanPtr& mean_ptr,
                         const SquarePtr& square_ptr, bool with_squares, const options& opts) {
  using S = tensor_value_t<gradient_tensor_t<TG>>;
  average_all<S>(
      variable_count, std::ranges::size(tg),
      [&tg](std::size_t i) {
        const auto g = read_gradient(tg, 0, i);
        return g.present ? g.dims.size() : 0;
      },
      [&tg](std::size_t i, std::size_t k) { return gradient_data(tg, k, i); }, mean_ptr, square_ptr,
      with_squares, opts);
}

template <class TG, class Means, class Squares>
summary average_into_impl(const TG& tg, Means& means, Squares* squares, const options& opts) {
  using S = tensor_value_t<gradient_tensor_t<TG>>;
  constexpr bool with_squares = !std::is_same_v<Squares, std::nullptr_t>;
  static_assert(supported_scalar<S>, "gradavg: gradient elements must be float or double");
  static_assert(gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);
  static_assert(outputs_outlive_reads<Means&>,
                "gradavg: means yields outputs by value that own their elements; yield references or views");
  static_assert(std::is_same_v<tensor_value_t<output_tensor_t<Means&>>, accumulator_t<S>>,
                "gradavg: the means outputs must hold the gradients' element type");
  if constexpr (with_squares) {
    static_assert(outputs_outlive_reads<Squares&>,
                  "gradavg: squares yields outputs by value that own their elements; yield references or views");
    static_assert(std::is_same_v<tensor_value_t<output_tensor_t<Squares&>>, accumulator_t<S>>,
                  "gradavg: the squares outputs must hold the gradients' element type");
  }

  check_scratch scratch;  // uninitialised arrays: costs nothing unless used
  const validated v = validate_into(tg, means, squares, opts, scratch);
  const std::size_t towers = std::ranges::size(tg);

  if (v.layout != nullptr) {
    // Pointers as read by the checks: variable i's ranges start at layout[i * stride].
    const std::size_t stride = towers + (with_squares ? 2 : 1);
    const byte_range* layout = v.layout;
    auto out = [](const std::byte* p) { return const_cast<S*>(reinterpret_cast<const S*>(p)); };
    average_all<S>(
        v.variables, towers,
        [=](std::size_t i) {
          const byte_range& g = layout[i * stride];
          return static_cast<std::size_t>(g.last - g.first) / sizeof(S);
        },
        [=](std::size_t i, std::size_t k) { return reinterpret_cast<const S*>(layout[i * stride + k].first); },
        [=](std::size_t i) { return out(layout[i * stride + towers].first); },
        [=](std::size_t i) { return with_squares ? out(layout[i * stride + towers + 1].first) : nullptr; },
        with_squares, opts);
  } else {
    auto mean_ptr = [&means](std::size_t i) { return read_output(means, i).data; };
    if constexpr (with_squares)
      average_all_entries(
          tg, v.variables, mean_ptr, [squares](std::size_t i) { return read_output(*squares, i).data; }, true, opts);
    else
      average_all_entries(
          tg, v.variables, mean_ptr, [](std::size_t) { return static_cast<S*>(nullptr); }, false, opts);
  }
  return {v.averaged, v.skipped};
}

}  // namespace detail

/// Averages into outputs the caller owns: means[i] receives variable i's mean gradient.
/// means is a random-access range with one output per variable: a writable tensor, a
/// reference_wrapper to one, or a pointer-like to one (null allowed only where the variable is
/// skipped). Outputs of skipped variables are left untouched; a variable is skipped exactly when
/// its gradient is absent on tower 0 (and so, validly, on every tower).
///
/// Aliasing: means[i] may be tower 0's gradient i itself (same data, same shape): averaging in
/// place. No other overlap between an output and any gradient or other output is allowed;
/// options.aliasing says how much of that is checked (aliasing_error): by default everything,
/// O(N log N) in the N = V*(T+2) buffers, O(N) when options.layout proved the same layout before.
///
/// Allocates nothing, except the scratch of the default overlap check when more than 256
/// buffers are passed without options.layout (and a layout_cache's own memory the first time it
/// holds a layout that large). Throws a gradavg::error before writing anything.
template <tower_gradients TG, class Means>
  requires detail::output_range<Means&>
summary average_gradients_into(const TG& tower_grads, Means&& means, const options& opts = {}) {
  return detail::average_into_impl(tower_grads, means, static_cast<std::nullptr_t*>(nullptr), opts);
}

/// As above, and squares[i] receives the mean over towers of variable i's squared gradient.
/// squares[i] may overlap nothing (not even tower 0's gradient).
template <tower_gradients TG, class Means, class Squares>
  requires detail::output_range<Means&> && detail::output_range<Squares&>
summary average_gradients_into(const TG& tower_grads, Means&& means, Squares&& squares, const options& opts = {}) {
  return detail::average_into_impl(tower_grads, means, &squares, opts);
}

/// The seed's _average_gradients: returns, for each variable, its mean gradient over the towers
/// paired with tower 0's variable, the means of squares when options.include_square, and the
/// skipped variables. Tensor, when given, must be the gradients' tensor type (it documents the
/// call; it is otherwise deduced). Results have tensor_traits<Tensor>::result_type.
template <class Tensor = detail::deduce_tensor, tower_gradients TG>
auto average_gradients(const TG& tower_grads, const options& opts = {}) {
  using G = detail::gradient_tensor_t<TG>;
  static_assert(std::is_same_v<Tensor, detail::deduce_tensor> || std::is_same_v<Tensor, G>,
                "gradavg: average_gradients<Tensor>: Tensor must be the gradients' tensor type");
  static_assert(resultable_tensor<G>,
                "gradavg: tensor_traits<Gradient> needs result_type and make() for the allocating API; "
                "use average_gradients_into with outputs you own");
  using R = typename tensor_traits<G>::result_type;
  using V = detail::variable_t<TG>;
  using S = tensor_value_t<G>;
  static_assert(detail::supported_scalar<S>, "gradavg: gradient elements must be float or double");
  static_assert(detail::gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);

  const std::size_t variable_count = detail::validate_towers(tower_grads);
  averaged_gradients<R, V> result;
  std::vector<std::size_t> slot_of(variable_count, 0);  // position in result.gradients and .squares
  for (std::size_t i = 0; i < variable_count; ++i) {
    const auto g0 = detail::read_gradient(tower_grads, 0, i);
    if (!g0.present) {
      result.skipped.push_back({i, detail::variable_copy(tower_grads, i)});
      continue;
    }
    slot_of[i] = result.gradients.size();
    result.gradients.emplace_back(tensor_traits<G>::make(g0.dims), detail::variable_copy(tower_grads, i));
    if (opts.include_square) result.squares.emplace_back(tensor_traits<G>::make(g0.dims), result.gradients.back().second);
  }

  detail::average_all_entries(
      tower_grads, variable_count,
      [&](std::size_t i) { return tensor_traits<R>::mutable_data(result.gradients[slot_of[i]].first); },
      [&](std::size_t i) -> S* {
        return opts.include_square ? tensor_traits<R>::mutable_data(result.squares[slot_of[i]].first) : nullptr;
      },
      opts.include_square, opts);
  return result;
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
