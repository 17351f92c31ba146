// gradavg internals: the one-process pass behind average_gradients_into and average_gradients,
// over the call's table of buffers — segmentation of the flat element range over threads (each
// chunk's walk into the kernel: segment_walk.hpp), the fused step's ordered statistics, the
// accumulator type, and the results the allocating calls make (the checks and the plan around
// the pass: into.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <ranges>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "access.hpp"
#include "isa.hpp"
#include "kernel.hpp"
#include "parallel.hpp"
#include "segment_walk.hpp"
#include "trace.hpp"
#include "../entry.hpp"
#include "../errors.hpp"
#include "../executor.hpp"
#include "../options.hpp"
#include "../results.hpp"
#include "../statistics.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

struct deduce_tensor {};

/// How many towers weigh more than 0 (summary::weighted_towers).
inline std::size_t positive_weights(std::span<const double> weights) noexcept {
  return static_cast<std::size_t>(std::count_if(weights.begin(), weights.end(), [](double w) { return w > 0; }));
}

/// The divisor of a call over `towers` towers: their weights summed in tower order, or the tower
/// count when no weights are given.
inline double weight_sum(std::span<const double> weights, std::size_t towers) noexcept {
  if (weights.empty()) return static_cast<double>(towers);
  double sum = 0;
  for (double w : weights) sum += w;
  return sum;
}

/// Whether options ask for anything beyond the plain mean (and squares).
inline bool fused_requested(const options& opts) noexcept {
  const compute_options& c = opts.compute;
  return !c.weights.empty() || c.scale != 1.0 || c.on_nonfinite != nonfinite_policy::ignore || c.statistics ||
         !c.per_variable.empty();
}

/// How many of `variables` variables, laid end to end in the flat range of all of them with
/// size(i) elements each, have at least one element in [begin, end): the variables a partial
/// call writes (summary::averaged), in one process and across processes.
template <class Size>
std::size_t variables_in_range(std::size_t variables, Size&& size, std::size_t begin, std::size_t end) {
  std::size_t written = 0, offset = 0;
  for (std::size_t i = 0; i < variables; ++i) {
    const std::size_t n = size(i);
    written += n != 0 && begin < end && offset < end && offset + n > begin ? 1 : 0;
    offset += n;
  }
  return written;
}

/// What the pass over all variables reports (summary's counts except skipped).
struct pass_result {
  bool whole_range = true;
  std::size_t written = 0;  // partial range: variables with at least one element in it
  std::size_t nonfinite = 0;
  double sum_mean_squared = 0;
  double sum_mean_of_squares = 0;
};

/// One call of the pass: the call's constants (range, segments, chunks, the fused parameters)
/// in a segment_walk, the chunks run over it, and the ordered combination of the segments' records.
template <class S, class Acc, class O>
class pass_run {
 public:
  pass_run(std::size_t variable_count, std::size_t tower_count, const pass_table& table, bool with_squares,
           const options& opts, double divisor) {
    divisor_ = divisor;
    walk_.variables = variable_count;
    walk_.towers = tower_count;
    walk_.table = table;
    walk_.with_squares = with_squares;
    walk_.opts = &opts;
    walk_.fused = fused_requested(opts);
    walk_.zero_nonfinite = opts.compute.on_nonfinite == nonfinite_policy::zero;
    walk_.range_begin = std::min(opts.compute.range.begin, table.total);
    walk_.range_end = std::min(opts.compute.range.end, table.total);
    walk_.records = records_;
  }
  pass_run(const pass_run&) = delete;  // walk_ points into records_
  pass_run& operator=(const pass_run&) = delete;

  /// Runs the kernel over the range (threads as options say) and returns what it found.
  pass_result run() {
    segment_walk<S, Acc, O>& w = walk_;
    const options& opts = *w.opts;
    pass_result result;
    result.whole_range = w.range_begin == 0 && w.range_end == w.table.total;
    if (!result.whole_range)
      result.written = variables_in_range(w.variables, [&](std::size_t i) { return w.size_of(i); }, w.range_begin,
                                          w.range_end);
    const std::size_t n = w.range_end - w.range_begin;
    if (n == 0) return result;

    const compute_options& c = opts.compute;
    w.divisor = static_cast<Acc>(divisor_ > 0 ? divisor_ : weight_sum(c.weights, w.towers));
    // validate_options: the scale and every weight times it are representable in Acc.
    w.params = {c.weights.empty() ? nullptr : c.weights.data(), c.scale, static_cast<Acc>(c.scale),
                c.on_nonfinite != nonfinite_policy::ignore, c.statistics};

    w.segment = segment_elements<Acc>(n);
    w.segments = (n + w.segment - 1) / w.segment;
    // Every element of the flat range reads one value per tower and writes a mean (and a square).
    const std::size_t bytes_per_element = w.towers * sizeof(S) + (w.with_squares ? 2 : 1) * sizeof(O);
    w.chunks = std::min(chunk_count(n, bytes_per_element, opts), w.segments);
    w.prefetch = prefetch_pays(n, bytes_per_element);
    w.stream = streams(opts, n * bytes_per_element);
    run_chunks(w.chunks, w, opts);
    if (w.fused) combine_records(result);
    return result;
  }

 private:
  /// The segments' records folded in order (statistics_fold): variables over several segments
  /// piece by piece, then finished; the sums over everything.
  void combine_records(pass_result& result) const {
    const segment_walk<S, Acc, O>& w = walk_;
    auto finish = [&](std::size_t i, piece_result& r) {
      if (w.zero_nonfinite && r.nonfinite) {
        std::size_t offset = 0;
        for (std::size_t v = 0; v < i; ++v) offset += w.size_of(v);
        zero_outputs(w.mean_ptr(i), w.square_ptr(i), covered_by(offset, w.size_of(i), w.range_begin, w.range_end));
      }
      finish_variable(w.opts->compute, i, r);
    };
    statistics_fold fold;
    for (std::size_t s = 0; s < w.segments; ++s) {
      const segment_record& record = records_[s];
      if (record.head_variable != segment_record::none)
        fold.piece(record.head_variable, record.head, false, record.head_ends, finish);
      fold.end_segment(record.inner, record.inner_nonfinite);
      if (record.tail_variable != segment_record::none)
        fold.piece(record.tail_variable, record.tail, true, false, finish);
    }
    result.nonfinite = fold.nonfinite;
    result.sum_mean_squared = fold.everything.sum_mean_squared;
    result.sum_mean_of_squares = fold.everything.sum_mean_of_squares;
  }

  segment_walk<S, Acc, O> walk_;
  double divisor_ = 0;
  segment_record records_[max_segments];  // fused only
};

/// Runs the kernel over every variable of table, summing in Acc and writing O.
/// The elements of options.compute.range form one flat range, split into contiguous chunks of whole
/// segments (one chunk per thread): each chunk walks the variables it covers, so small variables
/// share a fork/join. divisor: what the sums are divided by where the plain pass reads fewer towers
/// than the call has (the rows of a row-sparse call); 0: the weights' sum, or tower_count.
template <class S, class Acc, class O>
pass_result average_pass(std::size_t variable_count, std::size_t tower_count, const pass_table& table,
                         bool with_squares, const options& opts, double divisor = 0) {
  return pass_run<S, Acc, O>(variable_count, tower_count, table, with_squares, opts, divisor).run();
}

/// average_pass for each of GRADAVG_KERNEL_INSTANCES_ (kernel.hpp; see kernels.hpp).
#define GRADAVG_PASS_INSTANCE_(S, Acc, O) \
  template pass_result average_pass<S, Acc, O>(std::size_t, std::size_t, const pass_table&, bool, const options&, \
                                               double);
#define GRADAVG_EXTERN_PASS_INSTANCE_(S, Acc, O) extern GRADAVG_PASS_INSTANCE_(S, Acc, O)

#if defined(GRADAVG_EXTERN_KERNELS)  // see kernel.hpp
GRADAVG_KERNEL_INSTANCES_(GRADAVG_EXTERN_PASS_INSTANCE_)
#endif

/// Calls f.template operator()<Acc>() with the accumulator type options choose for S.
template <class S, class F>
decltype(auto) with_accumulator(const options& opts, F&& f) {
  if constexpr (std::is_same_v<S, float>) {
    if (opts.compute.accumulate == accumulation::double_precision) return f.template operator()<double>();
  }
  return f.template operator()<accumulator_t<S>>();
}

/// The largest finite value of the accumulator type options choose for S.
template <class S>
double accumulator_max(const options& opts) noexcept {
  return with_accumulator<S>(opts, []<class Acc>() { return static_cast<double>(std::numeric_limits<Acc>::max()); });
}

/// The summary of a call from validation's counts (elements: the flat range's total) and the
/// pass's result.
inline summary make_summary(std::size_t averaged, std::size_t skipped, std::size_t towers, std::size_t elements,
                            const pass_result& pass, const options& opts) {
  summary r;
  r.shard = {std::min(opts.compute.range.begin, elements), std::min(opts.compute.range.end, elements)};
  r.shard.begin = std::min(r.shard.begin, r.shard.end);
  r.averaged = pass.whole_range ? averaged : pass.written;
  r.skipped = skipped;
  r.nonfinite_variables = pass.nonfinite;
  r.statistics = opts.compute.statistics;
  if (opts.compute.statistics) {
    r.sum_mean_squared = pass.sum_mean_squared;
    r.sum_mean_of_squares = pass.sum_mean_of_squares;
  }
  r.towers = towers;
  r.weighted_towers = opts.compute.weights.empty() ? towers : positive_weights(opts.compute.weights);
  return r;
}

/// The pass over a table of buffers validation proved (its stride towers + 1, + 2 with squares),
/// and the call's summary.
template <class S, class O>
summary average_layout(const buffer_table& layout, std::size_t variables, std::size_t towers, bool with_squares,
                       std::size_t elements, std::size_t averaged, std::size_t skipped, const options& opts) {
  const shared_detail::traced_span span(opts.run.timeline, "pass");
  const pass_table table{layout, elements};
  const pass_result pass = with_accumulator<S>(
      opts, [&]<class Acc>() { return average_pass<S, Acc, O>(variables, towers, table, with_squares, opts); });
  return make_summary(averaged, skipped, towers, elements, pass, opts);
}

/// The allocating calls return whole variables: options.compute.range must be the default
/// (option_error).
inline void require_whole_range(const options& opts) {
  if (opts.compute.range.begin != 0 || opts.compute.range.end != element_range{}.end)
    throw option_error(
        "gradavg: options.compute.range is for average_gradients_into; average_gradients returns whole variables");
}

/// Each variable's new outputs (null where it is skipped).
template <class R>
struct allocated_outputs {
  std::vector<R*> means, squares;  // squares: empty without them
};

/// The allocating calls' results, made before anything is averaged (one process and across
/// ranks): for each variable present on tower 0 a mean, and with_squares a mean of squares, of
/// its shape and of element type `element` (tensor_traits<G>::make), paired with tower 0's
/// variable; the others listed in result.skipped.
template <class TG, class R, class V>
allocated_outputs<R> allocate_results(const TG& tower_grads, std::size_t variable_count, element_type element,
                                      bool with_squares, averaged_gradients<R, V>& result) {
  using G = gradient_tensor_t<TG>;
  auto make = [&](const shape& dims) {
    if constexpr (dynamic_tensor<G>)
      return tensor_traits<G>::make(dims, element);
    else
      return tensor_traits<G>::make(dims);
  };
  std::vector<std::size_t> slot_of(variable_count, 0);  // position in result.gradients and .squares
  std::vector<bool> present(variable_count, false);
  for (std::size_t i = 0; i < variable_count; ++i) {
    const auto g0 = read_gradient(tower_grads, 0, i);
    if (!g0.present) {
      result.skipped.push_back({i, variable_copy(tower_grads, i)});
      continue;
    }
    present[i] = true;
    slot_of[i] = result.gradients.size();
    result.gradients.emplace_back(make(g0.dims), variable_copy(tower_grads, i));
    if (with_squares) result.squares.emplace_back(make(g0.dims), result.gradients.back().second);
  }
  allocated_outputs<R> outputs;  // pointers taken once the vectors hold every result
  outputs.means.assign(variable_count, nullptr);
  if (with_squares) outputs.squares.assign(variable_count, nullptr);
  for (std::size_t i = 0; i < variable_count; ++i) {
    if (!present[i]) continue;
    outputs.means[i] = &result.gradients[slot_of[i]].first;
    if (with_squares) outputs.squares[i] = &result.squares[slot_of[i]].first;
  }
  return outputs;
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
