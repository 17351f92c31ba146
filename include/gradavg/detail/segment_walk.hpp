// gradavg internals: one chunk's walk of a call's table of buffers into the kernel. The pass
// (pass.hpp) cuts the flat element range into segments, hands whole segments to each chunk, and
// after every chunk has returned folds the segments' records in order; a chunk walks the
// variables its segments cover: runs of whole variables in one kernel call, pieces one by one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "access.hpp"
#include "isa.hpp"
#include "kernel.hpp"
#include "ordered_statistics.hpp"
#include "../options.hpp"
#include "../statistics.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// What one segment's fused pass found: the piece of the variable that began before it (head),
/// the variables that begin and end in it (inner, finished and summed in order, as
/// statistics_fold sums them), the piece of the variable that begins in it and continues (tail).
/// Trivial, so that an array of them costs nothing to declare.
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

/// The elements [begin, end) of a variable's own that a flat range covers.
struct covered_elements {
  std::size_t begin, end;
};

/// Of a variable of `size` elements from flat element `offset`, those in [range_begin, range_end).
inline covered_elements covered_by(std::size_t offset, std::size_t size, std::size_t range_begin,
                                   std::size_t range_end) noexcept {
  return {std::max(offset, range_begin) - offset, std::min(offset + size, range_end) - offset};
}

/// Zeros a variable's outputs (square: null without them) over its covered elements: its
/// on_nonfinite::zero.
template <class O>
void zero_outputs(O* mean, O* square, covered_elements c) noexcept {
  std::fill(mean + c.begin, mean + c.end, O(0));
  if (square != nullptr) std::fill(square + c.begin, square + c.end, O(0));
}

/// Variable i finished with its combined result r: its sums zeroed where its outputs are
/// (on_nonfinite::zero and a non-finite input), then reported in c.per_variable[i] where passed.
/// The one-process pass and the call across processes finish every variable here.
inline void finish_variable(const compute_options& c, std::size_t i, piece_result& r) noexcept {
  if (c.on_nonfinite == nonfinite_policy::zero && r.nonfinite) r.sum_mean_squared = r.sum_mean_of_squares = 0;
  if (c.per_variable.empty()) return;
  variable_statistics& out = c.per_variable[i];
  if (c.on_nonfinite != nonfinite_policy::ignore) out.nonfinite = r.nonfinite;
  if (c.statistics) {
    out.sum_mean_squared = r.sum_mean_squared;
    out.sum_mean_of_squares = r.sum_mean_of_squares;
  }
}

/// The call's buffers, as validation recorded them (validate_into's layout, a buffer_table):
/// variable i's gradient on tower k begins at buffers.row(i)[k] (k < T), its means output at
/// row(i)[T] and, with squares, its squares output at row(i)[T + 1]; each holds
/// buffers.elements[i] elements (0: the variable is skipped). total is the sum of the counts.
struct pass_table {
  buffer_table buffers;
  std::size_t total;
};

/// A call's constants as the chunks read them, and the walk of one chunk: walk(c) runs chunk c
/// of `chunks`, i.e. segments [segments * c / chunks, segments * (c + 1) / chunks). The pass sets
/// every member before the first chunk runs; chunks only read them, and write only the records
/// of their own segments.
template <class S, class Acc, class O>
struct segment_walk {
  std::size_t variables = 0, towers = 0;
  pass_table table{};
  bool with_squares = false;
  const options* opts = nullptr;
  bool fused = false, zero_nonfinite = false;
  std::size_t range_begin = 0, range_end = 0;  // the flat range, clamped to table.total
  Acc divisor = 1;
  fused_params<Acc> params{};
  std::size_t segment = 0, segments = 0, chunks = 0;
  bool prefetch = false, stream = false;
  segment_record* records = nullptr;  // max_segments of them; filled by the fused pass only

  void operator()(std::size_t c) { run_segments(segments * c / chunks, segments * (c + 1) / chunks); }

  std::size_t size_of(std::size_t i) const { return table.buffers.elements[i]; }
  O* mean_ptr(std::size_t i) const { return table.buffers.template buffer<O>(i, towers); }
  O* square_ptr(std::size_t i) const {
    return with_squares ? table.buffers.template buffer<O>(i, towers + 1) : nullptr;
  }

  /// Elements [begin, end) of variable i (size elements, starting at flat index offset), in the
  /// segment [seg_begin, seg_end): the kernel, then (fused) the piece's place in the record.
  void run_piece(std::size_t i, std::size_t size, std::size_t offset, std::size_t begin, std::size_t end,
                 std::size_t seg_begin, std::size_t seg_end, segment_record& record) const {
    const tower_reader<S> reader = row_reader<S>(table.buffers, i);
    if (!fused) {
      // Nothing to read back (loading the callee's fresh stores of an empty result stalled
      // every call of a small variable).
      reduce_range<S, Acc>(reader, towers, begin, end, mean_ptr(i), square_ptr(i), stream, prefetch, divisor, nullptr);
      return;
    }
    piece_result piece =
        reduce_range<S, Acc>(reader, towers, begin, end, mean_ptr(i), square_ptr(i), stream, prefetch, divisor, &params);
    const bool starts_here = offset >= seg_begin || seg_begin == range_begin;
    const bool ends_here = offset + size <= seg_end || seg_end == range_end;
    if (!starts_here) {
      record.head_variable = i;
      record.head_ends = ends_here;
      record.head = piece;
    } else if (!ends_here) {
      record.tail_variable = i;
      record.tail = piece;
    } else {
      if (zero_nonfinite && piece.nonfinite) zero_outputs(mean_ptr(i), square_ptr(i), {begin, end});
      finish_variable(opts->compute, i, piece);
      record.inner.add(piece);
      record.inner_nonfinite += piece.nonfinite ? 1 : 0;
    }
  }

  /// Segments [first_segment, last_segment): one chunk's walk over the variables they cover.
  void run_segments(std::size_t first_segment, std::size_t last_segment) const {
    const std::size_t first = range_begin + first_segment * segment;
    std::size_t i = 0, offset = 0;  // variable i begins at flat index offset
    while (i < variables && offset + size_of(i) <= first) offset += size_of(i++);
    // Unfused, nothing depends on where a segment ends: the chunk's segments are walked as one.
    const std::size_t step = fused ? 1 : last_segment - first_segment;
    for (std::size_t s = first_segment; s < last_segment; s += step) {
      const std::size_t seg_begin = range_begin + s * segment;
      const std::size_t seg_end = std::min(range_end, seg_begin + step * segment);
      segment_record& record = records[s];  // written by the chunk that runs s only
      if (fused) record = {segment_record::none, false, {}, segment_record::none, {}, {}, 0};
      while (i < variables && offset < seg_end) {
        if (!fused && offset >= seg_begin) {
          // The segment's whole variables from i on: one kernel call for all of them.
          if (seg_end == table.total) {  // every variable left ends in this segment
            reduce_variables<S, Acc, O>(table.buffers, i, variables, towers, with_squares, stream, prefetch,
                                        divisor);
            i = variables;
            break;
          }
          const std::size_t whole_first = i;
          while (i < variables && offset + size_of(i) <= seg_end) offset += size_of(i++);
          if (i != whole_first) {
            reduce_variables<S, Acc, O>(table.buffers, whole_first, i, towers, with_squares, stream, prefetch,
                                        divisor);
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
};

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
