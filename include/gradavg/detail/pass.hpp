// gradavg internals: the one-process pass behind average_gradients_into and average_gradients,
// over the call's table of buffers — segmentation of the flat element range over threads, the
// kernel per variable piece (or per run of whole variables), the fused step's ordered statistics,
// the accumulator type, and the results the allocating calls make (the checks and the plan
// around the pass: into.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <ranges>
#include <type_traits>
#include <utility>
#include <vector>

#include "elements.hpp"
#include "isa.hpp"
#include "kernel.hpp"
#include "parallel.hpp"
#include "validate.hpp"
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

/// The flat element range of a call is cut into at most max_segments segments of a size that
/// depends only on the range's length (a power-of-two multiple of the split granularity), and
/// threads take whole segments. Everything the fused pass sums is summed per segment and then
/// segment by segment in order, so statistics never depend on the thread count.
inline constexpr std::size_t max_segments = 256;

/// What one segment's fused pass found: the piece of the variable that began before it (head),
/// the variables that begin and end in it (inner, summed in order), the piece of the variable that
/// begins in it and continues (tail). Trivial, so that an array of them costs nothing to declare.
struct segment_record {
  static constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  std::size_t head_variable;
  bool head_ends;
  piece_result head;
  std::size_t tail_variable;
  piece_result tail;
  piece_result inner;
  std::size_t inner_nonfinite;
};
static_assert(std::is_trivially_default_constructible_v<segment_record>);

/// Whether options ask for anything beyond the plain mean (and squares).
inline bool fused_requested(const options& opts) noexcept {
  const compute_options& c = opts.compute;
  return !c.weights.empty() || c.scale != 1.0 || c.on_nonfinite != nonfinite_policy::ignore || c.statistics ||
         !c.per_variable.empty();
}

/// What the pass over all variables reports (summary's counts except skipped).
struct pass_result {
  bool whole_range = true;
  std::size_t written = 0;  // partial range: variables with at least one element in it
  std::size_t nonfinite = 0;
  double sum_mean_squared = 0;
  double sum_mean_of_squares = 0;
};

/// The call's buffers, as validation recorded them (validate_into's layout): variable i's
/// gradient on tower k is layout[i * stride + k] (k < T; empty for a skipped variable), its means
/// output begins at layout[i * stride + T] and, with squares, its squares output at
/// layout[i * stride + T + 1]; total is the sum of the variables' element counts.
struct pass_table {
  const byte_range* layout;
  std::size_t stride;
  std::size_t total;
};

/// One call of the pass: the call's constants (range, segments, chunks, the fused parameters),
/// the walk of a chunk's segments, and the ordered combination of the segments' records.
template <class S, class Acc, class O>
class pass_run {
 public:
  pass_run(std::size_t variable_count, std::size_t tower_count, const pass_table& table, bool with_squares,
           const options& opts)
      : variables_(variable_count),
        towers_(tower_count),
        layout_(table.layout),
        stride_(table.stride),
        total_(table.total),
        with_squares_(with_squares),
        opts_(opts),
        fused_(fused_requested(opts)),
        zero_nonfinite_(opts.compute.on_nonfinite == nonfinite_policy::zero) {
    range_begin_ = std::min(opts.compute.range.begin, total_);
    range_end_ = std::min(opts.compute.range.end, total_);
  }

  /// Runs the kernel over the range (threads as options say) and returns what it found.
  pass_result run() {
    pass_result result;
    result.whole_range = range_begin_ == 0 && range_end_ == total_;
    if (!result.whole_range) result.written = variables_in_range();
    const std::size_t n = range_end_ - range_begin_;
    if (n == 0) return result;

    const compute_options& c = opts_.compute;
    divisor_ = static_cast<Acc>(weight_sum(c.weights, towers_));
    // validate_options: the scale and every weight times it are representable in Acc.
    params_ = {c.weights.empty() ? nullptr : c.weights.data(), c.scale, static_cast<Acc>(c.scale),
               c.on_nonfinite != nonfinite_policy::ignore, c.statistics};

    segment_ = split_granularity<Acc>();
    while ((n + segment_ - 1) / segment_ > max_segments) segment_ *= 2;
    segments_ = (n + segment_ - 1) / segment_;
    // Every element of the flat range reads one value per tower and writes a mean (and a square).
    const std::size_t bytes_per_element = towers_ * sizeof(S) + (with_squares_ ? 2 : 1) * sizeof(O);
    const std::size_t chunks = std::min(chunk_count(n, bytes_per_element, opts_), segments_);
    prefetch_ = prefetch_pays(n, bytes_per_element);
    stream_ = streams(opts_, n * bytes_per_element);
    auto chunk = [&](std::size_t c) { run_segments(segments_ * c / chunks, segments_ * (c + 1) / chunks); };
    run_chunks(chunks, chunk, opts_);
    if (fused_) combine_records(result);
    return result;
  }

 private:
  std::size_t size_of(std::size_t i) const { return shared_detail::elements_in<S>(layout_[i * stride_]); }
  O* mean_ptr(std::size_t i) const { return shared_detail::output_start<O>(layout_[i * stride_ + towers_]); }
  O* square_ptr(std::size_t i) const {
    return with_squares_ ? shared_detail::output_start<O>(layout_[i * stride_ + towers_ + 1]) : nullptr;
  }

  /// Partial range: the variables with at least one element in it.
  std::size_t variables_in_range() const {
    std::size_t written = 0, offset = 0;
    for (std::size_t i = 0; i < variables_; ++i) {
      const std::size_t size = size_of(i);
      written += size != 0 && range_begin_ < range_end_ && offset < range_end_ && offset + size > range_begin_ ? 1 : 0;
      offset += size;
    }
    return written;
  }

  void zero_outputs(std::size_t i, std::size_t begin, std::size_t end) const {
    std::fill(mean_ptr(i) + begin, mean_ptr(i) + end, O(0));
    if (O* q = square_ptr(i)) std::fill(q + begin, q + end, O(0));
  }

  /// A variable's combined result: zeroed when the policy says, reported per variable.
  void finish_variable(std::size_t i, piece_result& r) const {
    if (zero_nonfinite_ && r.nonfinite) r.sum_mean_squared = r.sum_mean_of_squares = 0;
    if (!opts_.compute.per_variable.empty()) {
      variable_statistics& out = opts_.compute.per_variable[i];
      if (opts_.compute.on_nonfinite != nonfinite_policy::ignore) out.nonfinite = r.nonfinite;
      if (opts_.compute.statistics) {
        out.sum_mean_squared = r.sum_mean_squared;
        out.sum_mean_of_squares = r.sum_mean_of_squares;
      }
    }
  }

  /// Elements [begin, end) of variable i (size elements, starting at flat index offset), in the
  /// segment [seg_begin, seg_end): the kernel, then (fused) the piece's place in the record.
  void run_piece(std::size_t i, std::size_t size, std::size_t offset, std::size_t begin, std::size_t end,
                 std::size_t seg_begin, std::size_t seg_end, segment_record& record) const {
    const tower_reader<S> reader{nullptr, nullptr, reinterpret_cast<const std::byte*>(layout_ + i * stride_),
                                 sizeof(byte_range)};
    if (!fused_) {
      // Nothing to read back (loading the callee's fresh stores of an empty result stalled
      // every call of a small variable).
      reduce_range<S, Acc>(reader, towers_, begin, end, mean_ptr(i), square_ptr(i), stream_, prefetch_, divisor_,
                           nullptr);
      return;
    }
    piece_result piece = reduce_range<S, Acc>(reader, towers_, begin, end, mean_ptr(i), square_ptr(i), stream_,
                                              prefetch_, divisor_, &params_);
    const bool starts_here = offset >= seg_begin || seg_begin == range_begin_;
    const bool ends_here = offset + size <= seg_end || seg_end == range_end_;
    if (!starts_here) {
      record.head_variable = i;
      record.head_ends = ends_here;
      record.head = piece;
    } else if (!ends_here) {
      record.tail_variable = i;
      record.tail = piece;
    } else {
      if (zero_nonfinite_ && piece.nonfinite) zero_outputs(i, begin, end);
      finish_variable(i, piece);
      record.inner.add(piece);
      record.inner_nonfinite += piece.nonfinite ? 1 : 0;
    }
  }

  /// Segments [first_segment, last_segment): one chunk's walk over the variables they cover.
  void run_segments(std::size_t first_segment, std::size_t last_segment) {
    const std::size_t first = range_begin_ + first_segment * segment_;
    std::size_t i = 0, offset = 0;  // variable i begins at flat index offset
    while (i < variables_ && offset + size_of(i) <= first) offset += size_of(i++);
    for (std::size_t s = first_segment; s < last_segment; ++s) {
      const std::size_t seg_begin = range_begin_ + s * segment_;
      const std::size_t seg_end = std::min(range_end_, seg_begin + segment_);
      segment_record& record = records_[s];  // written by the chunk that runs s only
      if (fused_) record = {segment_record::none, false, {}, segment_record::none, {}, {}, 0};
      while (i < variables_ && offset < seg_end) {
        if (!fused_ && offset >= seg_begin) {
          // The segment's whole variables from i on: one kernel call for all of them.
          const std::size_t whole_first = i;
          while (i < variables_ && offset + size_of(i) <= seg_end) offset += size_of(i++);
          if (i != whole_first) {
            reduce_variables<S, Acc, O>(layout_, stride_, whole_first, i, towers_, with_squares_, stream_, prefetch_,
                                        divisor_);
            continue;
          }
        }
        const std::size_t size = size_of(i);
        if (size == 0) {
          ++i;
          continue;
        }
        const std::size_t begin = std::max(offset, seg_begin) - offset;
        const std::size_t end = std::min(offset + size, seg_end) - offset;
        run_piece(i, size, offset, begin, end, seg_begin, seg_end, record);
        if (offset + size > seg_end) break;  // continues in the next segment
        offset += size;
        ++i;
      }
    }
  }

  /// Variables over several segments, combined piece by piece in segment order; the sums over
  /// everything, variable by variable in order.
  void combine_records(pass_result& result) const {
    piece_result open{};
    std::size_t open_variable = segment_record::none;
    piece_result everything{};
    for (std::size_t s = 0; s < segments_; ++s) {
      const segment_record& record = records_[s];
      if (record.head_variable != segment_record::none) {
        if (open_variable == record.head_variable) {
          open.add(record.head);
        } else {
          open = record.head;
          open_variable = record.head_variable;
        }
        if (record.head_ends) {
          if (zero_nonfinite_ && open.nonfinite) {
            std::size_t offset = 0;
            for (std::size_t i = 0; i < open_variable; ++i) offset += size_of(i);
            const std::size_t begin = std::max(offset, range_begin_) - offset;
            zero_outputs(open_variable, begin, std::min(offset + size_of(open_variable), range_end_) - offset);
          }
          finish_variable(open_variable, open);
          everything.add(open);
          result.nonfinite += open.nonfinite ? 1 : 0;
          open_variable = segment_record::none;
        }
      }
      everything.add(record.inner);
      result.nonfinite += record.inner_nonfinite;
      if (record.tail_variable != segment_record::none) {
        open = record.tail;
        open_variable = record.tail_variable;
      }
    }
    result.sum_mean_squared = everything.sum_mean_squared;
    result.sum_mean_of_squares = everything.sum_mean_of_squares;
  }

  const std::size_t variables_, towers_;
  const byte_range* const layout_;
  const std::size_t stride_, total_;
  const bool with_squares_;
  const options& opts_;
  const bool fused_, zero_nonfinite_;
  std::size_t range_begin_ = 0, range_end_ = 0;
  Acc divisor_ = 1;
  fused_params<Acc> params_{};
  std::size_t segment_ = 0, segments_ = 0;
  bool prefetch_ = false, stream_ = false;
  segment_record records_[max_segments];  // fused only
};

/// Runs the kernel over every variable of table, summing in Acc and writing O.
/// The elements of options.compute.range form one flat range, split into contiguous chunks of whole
/// segments (one chunk per thread): each chunk walks the variables it covers, so small variables
/// share a fork/join.
template <class S, class Acc, class O>
pass_result average_pass(std::size_t variable_count, std::size_t tower_count, const pass_table& table,
                         bool with_squares, const options& opts) {
  return pass_run<S, Acc, O>(variable_count, tower_count, table, with_squares, opts).run();
}

/// average_pass for each of GRADAVG_KERNEL_INSTANCES_ (kernel.hpp; see kernels.hpp).
#define GRADAVG_PASS_INSTANCE_(S, Acc, O) \
  template pass_result average_pass<S, Acc, O>(std::size_t, std::size_t, const pass_table&, bool, const options&);
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

/// The summary of a call from validation's counts and the pass's result.
inline summary make_summary(std::size_t averaged, std::size_t skipped, std::size_t towers, const pass_result& pass,
                            const options& opts) {
  summary r;
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

/// The pass over a layout validation proved (variable i's buffers at layout[i * stride], stride
/// = towers + 1, + 2 with squares), and the call's summary.
template <class S, class O>
summary average_layout(const byte_range* layout, std::size_t variables, std::size_t towers, bool with_squares,
                       std::size_t elements, std::size_t averaged, std::size_t skipped, const options& opts) {
  const pass_table table{layout, towers + (with_squares ? 2 : 1), elements};
  const pass_result pass = with_accumulator<S>(
      opts, [&]<class Acc>() { return average_pass<S, Acc, O>(variables, towers, table, with_squares, opts); });
  return make_summary(averaged, skipped, towers, pass, opts);
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
