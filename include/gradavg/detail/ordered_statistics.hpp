// gradavg internals: the order in which the fused statistics are summed, in one place for the
// one-process pass and the pass across processes, so that both give the same bits: the flat range
// is cut into segments (segment_elements), a piece (a variable's elements within one segment) is
// summed in eight lanes (the kernel's fused_state; piece_lanes is its element-by-element twin),
// and pieces are folded into each variable's result and the call's (statistics_fold).
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "isa.hpp"
#include "kernel.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// The flat element range of a call is cut into at most max_segments segments of a size that
/// depends only on the range's length (a power-of-two multiple of the split granularity), and
/// threads take whole segments. Everything the fused pass sums is summed per segment and then
/// segment by segment in order, so statistics never depend on the thread count.
inline constexpr std::size_t max_segments = 256;

/// The segment size of a flat range of n elements summed in Acc.
template <class Acc>
std::size_t segment_elements(std::size_t n) noexcept {
  std::size_t segment = split_granularity<Acc>();
  while ((n + segment - 1) / segment > max_segments) segment *= 2;
  return segment;
}

/// x, opaque to the optimiser: a product passed through it is rounded to double before any later
/// sum, never contracted into a fused multiply-add (packet_ops::rounded's scalar twin).
inline double rounded_double(double x) noexcept {
#if defined(__GNUC__) && (defined(__x86_64__) || (defined(__i386__) && defined(__SSE2_MATH__)))
  __asm__("" : "+x"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  volatile double kept = x;
  x = kept;
#endif
  return x;
}

/// One piece's statistics fed element by element (a mean and a mean of squares in Acc, in the
/// piece's order), summed exactly as the kernel's fused_state sums them at every level: element j
/// of each block of 16 (float) or 8 (double) from the piece's start goes to lane j mod 8 — a float
/// block's elements j and j + 8 first added to each other, squares rounded — each block added to
/// the lanes in block order, the last block padded with zeros, and the lanes added in order.
template <class Acc>
class piece_lanes {
 public:
  void add(Acc mean, Acc square) noexcept {
    means_[filled_] = static_cast<double>(mean);
    squares_[filled_] = static_cast<double>(square);
    if (++filled_ == block) add_block();
  }

  /// The piece's sums; the lanes start again for the next piece.
  piece_result take() noexcept {
    if (filled_ != 0) {
      for (std::size_t j = filled_; j < block; ++j) means_[j] = squares_[j] = 0;
      add_block();
    }
    piece_result r{};
    for (std::size_t l = 0; l < lanes; ++l) {
      r.sum_mean_squared += mean_squared_[l];
      r.sum_mean_of_squares += mean_of_squares_[l];
      mean_squared_[l] = mean_of_squares_[l] = 0;
    }
    return r;
  }

 private:
  static constexpr std::size_t lanes = 8;
  static constexpr std::size_t block = std::is_same_v<Acc, float> ? 2 * lanes : lanes;

  void add_block() noexcept {
    for (std::size_t l = 0; l < lanes; ++l) {
      const double first = rounded_double(means_[l] * means_[l]);
      if constexpr (block == 2 * lanes) {
        const double second = rounded_double(means_[l + lanes] * means_[l + lanes]);
        mean_squared_[l] += second + first;
        mean_of_squares_[l] += squares_[l] + squares_[l + lanes];
      } else {
        mean_squared_[l] += first;
        mean_of_squares_[l] += squares_[l];
      }
    }
    filled_ = 0;
  }

  double mean_squared_[lanes] = {}, mean_of_squares_[lanes] = {};
  double means_[block], squares_[block];
  std::size_t filled_ = 0;
};

/// How a pass folds its pieces' results, in flat order, into each variable's and the call's: a
/// variable that lies whole in one segment is finished alone and added to its segment's sum of
/// such variables (in order), which is added to the call's at the segment's end; a variable over
/// several segments has its pieces added in segment order and is finished and added to the call's
/// once its last piece is in. finish(i, result): the variable's combined result (which it may
/// change, e.g. zero), before it is added.
struct statistics_fold {
  piece_result open{};  // the pieces so far of open_variable, which continues past its segment
  std::size_t open_variable = 0;
  piece_result segment_whole{};  // the variables lying whole in the current segment, in order
  piece_result everything{};
  std::size_t nonfinite = 0;  // variables finished with a non-finite input

  /// Variable i's piece p: first, its variable's first piece in the range; last, its last.
  template <class Finish>
  void piece(std::size_t i, piece_result p, bool first, bool last, Finish&& finish) {
    if (first && last) {
      finish(i, p);
      segment_whole.add(p);
      nonfinite += p.nonfinite ? 1 : 0;
      return;
    }
    if (first || open_variable != i) {
      open = p;
      open_variable = i;
    } else {
      open.add(p);
    }
    if (last) {
      finish(i, open);
      everything.add(open);
      nonfinite += open.nonfinite ? 1 : 0;
    }
  }

  /// A segment ends: its whole variables' sum joins the call's.
  void end_segment() noexcept {
    everything.add(segment_whole);
    segment_whole = {};
  }

  /// A segment whose whole variables were finished and summed in order elsewhere (a thread's
  /// segment_record): their sum and how many had a non-finite input, then the segment's end.
  void end_segment(const piece_result& whole, std::size_t whole_nonfinite) noexcept {
    segment_whole = whole;
    nonfinite += whole_nonfinite;
    end_segment();
  }
};

/// The fused statistics of a pass whose means arrive element by element in flat order (the pass
/// across processes, bucket by bucket): pieces cut at the segments of the range [begin, end),
/// summed by piece_lanes and folded by statistics_fold, so the same bits as the one-process pass
/// over the same means.
template <class Acc>
class flat_statistics {
 public:
  flat_statistics(std::size_t begin, std::size_t end) noexcept
      : end_(end), segment_(segment_elements<Acc>(end - begin)), segment_end_(std::min(end, begin + segment_)) {}

  /// Variable i's elements at flat positions [from, to), within its elements in the range
  /// [first, last), in order after every earlier element of the range; value(n) gives the
  /// (mean, mean of squares) of position from + n. finish: as statistics_fold::piece's.
  template <class Value, class Finish>
  void add(std::size_t i, std::size_t first, std::size_t last, std::size_t from, std::size_t to, Value&& value,
           Finish&& finish) {
    for (std::size_t p = from; p < to;) {
      if (!in_piece_) {
        in_piece_ = true;
        piece_first_ = p == first;
      }
      const std::size_t stop = std::min(to, segment_end_);
      for (; p < stop; ++p) {
        const auto [mean, square] = value(p - from);
        lanes_.add(mean, square);
      }
      const bool segment_ends = p == segment_end_;
      if (p == last || segment_ends) {
        fold_.piece(i, lanes_.take(), piece_first_, p == last, finish);
        in_piece_ = false;
      }
      if (segment_ends) {
        fold_.end_segment();
        segment_end_ = std::min(end_, segment_end_ + segment_);
      }
    }
  }

  /// The sums over everything added so far (every element of the range: the call's).
  [[nodiscard]] const piece_result& everything() const noexcept { return fold_.everything; }

 private:
  std::size_t end_, segment_, segment_end_;
  piece_lanes<Acc> lanes_;
  statistics_fold fold_;
  bool in_piece_ = false, piece_first_ = false;
};

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
