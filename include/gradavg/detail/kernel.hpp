// gradavg internals: the averaging kernel over raw contiguous memory.
//
// Contract of reduce_range (one variable, T towers, elements [begin, end)), plain:
//   mean[j]   = (g_0[j] + g_1[j] + ... + g_{T-1}[j]) / T        summed in tower order
//   square[j] = (g_0[j]^2 + ... + g_{T-1}[j]^2) / T              when square != nullptr
// in the accumulator type; each square is rounded before it is added (packet_ops::mul_add: never
// fused, whatever the target or the compiler's -ffp-contract). A power-of-two T multiplies by
// 1/T instead: the same bits (exact_reciprocal).
// Fused (fused_params given): with w_k the tower weights, W their sum, c the scale and
// f_k = w_k c (computed in double, rounded once to the accumulator type),
//   mean[j]   = (f_0 g_0[j] + ... + f_{T-1} g_{T-1}[j]) / W
//   square[j] = (f_0 g_0[j] (c g_0[j]) + ...) / W
// each product rounded once before it is added (packet_ops::mul_add, like a square): the scale
// meets every input before any sum, so loss-scaled inputs never overflow the sums (or the sums of
// squares) by their scaled size. With unit weights and c = 1 bitwise the plain results. The fused
// pass also reports whether any input was NaN or +-Inf (probing a step's inputs only where a sum
// is not finite) and sums mean^2 and square in double. With every f_k and c equal to 1 it runs
// the plain operations (the same bits).
// Results are rounded once from the accumulator type to the output type (storage_ops). Every
// element, tails included, is computed by the same packet operations (a tail is copied into a
// zero-padded step), so each element's result depends only on its inputs and T — never on
// blocking, alignment, how a caller splits [0, n) across threads, or the instruction set: means
// and squares are the same bits at every level (SSE2, AVX2, AVX-512, NEON, scalar). The fused
// statistics are sums over elements in lanes of the packet width: bitwise reproducible at one
// level, not across levels. A NaN result is always the default quiet NaN (NaN inputs' payloads
// are not propagated), so NaN results are bitwise reproducible too.
// Every g_k[j] is read once and mean[j], square[j] written once, after all reads of index j,
// so mean may be g_0 itself (in place). No other overlap is allowed.
//
// How: up to group_towers towers are summed in registers, one cache line of each at a time, and
// the result stored straight to the output: T+1 (or T+2) streams, no intermediate memory
// traffic. More towers are folded group by group through an L1-resident block of accumulators.
// With streaming set, outputs are written with non-temporal stores where the target has them;
// with prefetch set (large calls), whole steps prefetch each tower's data a little ahead.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "isa.hpp"
#include "packet.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// Type in which values stored as S are summed: float for the 16-bit types, never 16 bits.
template <class S>
struct accumulator {
  using type = S;
};
template <>
struct accumulator<Eigen::half> {
  using type = float;
};
template <>
struct accumulator<Eigen::bfloat16> {
  using type = float;
};
template <class S>
using accumulator_t = typename accumulator<S>::type;

/// Element types the kernel reads.
template <class S>
inline constexpr bool supported_scalar = std::is_same_v<S, float> || std::is_same_v<S, double> ||
                                         std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>;

/// Output element types allowed for gradients of type S: S itself, or float for 16-bit gradients
/// (float master gradients of mixed-precision training).
template <class S, class O>
inline constexpr bool supported_output =
    std::is_same_v<O, S> || (std::is_same_v<O, float> && std::is_same_v<accumulator_t<S>, float>);

/// Packets per step: one 64-byte cache line of each tower's storage (at least one packet of the
/// accumulator, at most four): two float packets per line of 16-bit values on AVX-512.
template <class S, class Acc>
inline constexpr std::size_t step_packets = std::clamp<std::size_t>(64 / (packet_ops<Acc>::width * sizeof(S)), 1, 4);

/// Elements per step.
template <class S, class Acc>
inline constexpr std::size_t step_elements = step_packets<S, Acc> * packet_ops<Acc>::width;

/// Towers summed in registers before going through the accumulator block.
inline constexpr std::size_t group_towers = 16;

/// Elements per L1-resident accumulator block (used only with more than group_towers towers).
template <class Acc>
inline constexpr std::size_t block_elements = 4096 / sizeof(Acc);

/// Threads split the flat range of all elements at multiples of this: chunk boundaries stay away
/// from sharing a cache line within a variable that starts on one. Results never depend on it.
template <class Acc>
constexpr std::size_t split_granularity() noexcept {
  return block_elements<Acc>;
}

/// Software prefetch: in a large call each whole step asks for every tower's data this many bytes
/// ahead of the line it loads, so that the 16-bit and fused passes run at the time of reading
/// their inputs (gradavg_bench_fused, mean.over.read; docs/performance.md).
inline constexpr std::size_t prefetch_distance = 1024;

/// Calls that move fewer bytes than this (inputs and outputs) do not prefetch: their data may sit
/// in a cache, where prefetching ahead costs time instead of saving it.
inline constexpr std::size_t prefetch_min_bytes = std::size_t{4} << 20;

/// Whether a call over `elements` elements, each moving `bytes_per_element` bytes (every tower's
/// value and every output's), prefetches: its data come from memory, not a cache.
constexpr bool prefetch_pays(std::size_t elements, std::size_t bytes_per_element) noexcept {
  return elements * bytes_per_element >= prefetch_min_bytes;
}

#if defined(__GNUC__) && defined(__x86_64__)
/// Whether steps prefetch at all: on x86-64, where it was measured; elsewhere the hardware's
/// prefetchers alone.
inline constexpr bool software_prefetch = true;

/// Asks for the cache line prefetch_distance bytes past p, for reading soon. Any p: a prefetch
/// never faults and never changes a result.
GRADAVG_INLINE_ void prefetch_ahead(const void* p) noexcept {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + prefetch_distance), 0, 3);
}
#else
inline constexpr bool software_prefetch = false;
GRADAVG_INLINE_ void prefetch_ahead(const void*) noexcept {}
#endif

/// Run-time values of the fused features, in the accumulator type.
template <class Acc>
struct fused_params {
  const double* weights = nullptr;  // one per tower; null: every weight is 1
  double scale = 1;                 // folded into every weight: f_k = w_k * scale
  Acc scale_in_acc = 1;             // the scale, for the squares' second factor
  bool detect = false;      // the non-finite probe
  bool statistics = false;  // the sums of mean^2 and of the means of squares (squares computed)
};

/// What the fused pass found in one piece of one variable. Trivial (value-initialise it: {}),
/// so that arrays of records holding it cost nothing to declare.
struct piece_result {
  bool nonfinite;             // an input element was NaN or +-Inf
  double sum_mean_squared;    // over the piece's elements, in double
  double sum_mean_of_squares;

  void add(const piece_result& other) noexcept {
    nonfinite = nonfinite || other.nonfinite;
    sum_mean_squared += other.sum_mean_squared;
    sum_mean_of_squares += other.sum_mean_of_squares;
  }
};

/// Registers of the fused pass over one piece: whether a non-finite input was found, and the
/// statistics, lane by lane in double (one accumulator per double packet that a packet of Acc
/// widens into: few enough to stay in registers beside the step's sums).
template <class Acc>
struct fused_state {
  using ops = packet_ops<Acc>;
  using D = packet_ops<double>;
  static constexpr std::size_t parts = std::is_same_v<Acc, float> ? widen_ops::parts : 1;

  bool nonfinite = false;
  typename D::type mean_squared[parts];
  typename D::type mean_of_squares[parts];

  fused_state() noexcept {
    for (auto& p : mean_squared) p = D::broadcast(0);
    for (auto& p : mean_of_squares) p = D::broadcast(0);
  }

  /// Adds a step's N packets of means m and means of squares q, widened to double: the squares
  /// m^2 (exact in double for float means) and q summed in pairs of packets, the pairs in order,
  /// then added to the accumulators — one dependent addition per accumulator and step.
  template <std::size_t N>
  GRADAVG_INLINE_ void add_statistics(const typename ops::type (&m)[N], const typename ops::type (&q)[N]) noexcept {
    typename D::type wide_m[N][parts], wide_q[N][parts];
    GRADAVG_UNROLL_
    for (std::size_t u = 0; u < N; ++u) {
      if constexpr (std::is_same_v<Acc, double>) {
        wide_m[u][0] = m[u];
        wide_q[u][0] = q[u];
      } else {
        widen_ops::widen(m[u], wide_m[u]);
        widen_ops::widen(q[u], wide_q[u]);
      }
    }
    GRADAVG_UNROLL_
    for (std::size_t p = 0; p < parts; ++p) {
      typename D::type step_m = pair_of_squares(wide_m, 0, p), step_q = pair_sum(wide_q, 0, p);
      GRADAVG_UNROLL_
      for (std::size_t u = 2; u < N; u += 2) {
        step_m = D::add(step_m, pair_of_squares(wide_m, u, p));
        step_q = D::add(step_q, pair_sum(wide_q, u, p));
      }
      mean_squared[p] = D::add(mean_squared[p], step_m);
      mean_of_squares[p] = D::add(mean_of_squares[p], step_q);
    }
  }

  template <std::size_t N>
  GRADAVG_INLINE_ static typename D::type pair_of_squares(const typename D::type (&w)[N][parts], std::size_t u,
                                                          std::size_t p) noexcept {
    const typename D::type first = D::rounded(D::mul(w[u][p], w[u][p]));
    return u + 1 < N ? D::mul_add(w[u + 1][p], w[u + 1][p], first) : first;
  }
  template <std::size_t N>
  GRADAVG_INLINE_ static typename D::type pair_sum(const typename D::type (&w)[N][parts], std::size_t u,
                                                   std::size_t p) noexcept {
    return u + 1 < N ? D::add(w[u][p], w[u + 1][p]) : w[u][p];
  }

  /// The piece's result: lanes summed in a fixed order.
  piece_result result() const noexcept {
    piece_result r{};
    r.nonfinite = nonfinite;
    alignas(64) double lanes[D::width];
    for (const auto& p : mean_squared) {
      D::store(lanes, p);
      for (double x : lanes) r.sum_mean_squared += x;
    }
    for (const auto& p : mean_of_squares) {
      D::store(lanes, p);
      for (double x : lanes) r.sum_mean_of_squares += x;
    }
    return r;
  }
};

/// Where a group's sums come from and go: FromAcc = the accumulator block is added first;
/// ToOut = the group is the last, so results are divided by the weight sum and stored to the
/// outputs. Fused: weights, scale, and as fused_params ask the non-finite probe and statistics.
/// S: the gradients' element type; O: the outputs'.
template <class S, class Acc, class O, bool Fused, bool WithSquare, bool FromAcc, bool ToOut>
struct group_pass {
  using ops = packet_ops<Acc>;
  using in = storage_ops<S, Acc>;
  using out = storage_ops<O, Acc>;
  using P = typename ops::type;
  static constexpr std::size_t W = ops::width;
  static constexpr std::size_t U = step_packets<S, Acc>;
  static constexpr std::size_t E = step_elements<S, Acc>;
  static constexpr bool Squares = WithSquare;  // fused: a squares output, or statistics
  /// bfloat16 gradients where the target has it: a step's packets in lane order
  /// (storage_ops::lane_order). bfloat16 outputs are packed from it into memory order; float
  /// outputs and the accumulator block are exchanged into memory order before their stores.
  static constexpr bool LaneOrder =
      in::lane_order && U % 2 == 0 && (std::is_same_v<O, S> || std::is_same_v<O, Acc>);
  static constexpr bool LaneOrderOut = LaneOrder && std::is_same_v<O, S>;

  const S* const* towers;  // count pointers, already offset to element 0 of this pass
  std::size_t count;
  Acc* acc;  // accumulator block (FromAcc or !ToOut), indexed like the outputs; any alignment
  Acc* sq;
  O* mean;  // outputs (ToOut), offset like towers
  O* square;  // null in a fused pass that computes squares only for the statistics
  Acc divisor;
  Acc reciprocal;  // exact_reciprocal(divisor): multiply by it instead of dividing when not 0
  const Acc* weights;  // fused: this group's count weights
  const fused_params<Acc>* fused;
  fused_state<Acc>* state;  // fused: carried from group to group; copied into registers by run()
  bool prefetch;  // whole steps prefetch the towers' data (prefetch_ahead)
  bool stream;    // ToOut: whole steps store the outputs non-temporally (storage_ops::stream_step)

  struct no_state {};
  using registers = std::conditional_t<Fused, fused_state<Acc>, no_state>;

  /// Elements [j, j + E): U packets of every tower, summed in registers. Unit (fused only): every
  /// f_k and c are 1, so the weighted operations are the plain ones (x * 1 is x: the same bits)
  /// and the plain ones run. StreamOut: store the outputs non-temporally. prefetching: ask for
  /// each tower's data prefetch_distance bytes ahead (run_steps passes a constant, so each of its
  /// loops has the branch folded away).
  template <bool Unit, bool StreamOut>
  GRADAVG_INLINE_ void step(std::size_t j, [[maybe_unused]] registers& st, bool prefetching) const noexcept {
    constexpr bool Weighted = Fused && !Unit;
    P a[U], s[U];
    std::size_t k = 0;
    P c{};  // the scale, for the squares
    if constexpr (Weighted && Squares) c = ops::broadcast(fused->scale_in_acc);
    if constexpr (FromAcc) {
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        a[u] = ops::load(acc + j + u * W);
        if constexpr (Squares) s[u] = ops::load(sq + j + u * W);
      }
      if constexpr (LaneOrder) {
        in::template reorder_lanes<false>(a);
        if constexpr (Squares) in::template reorder_lanes<false>(s);
      }
    } else {
      P w{};
      if constexpr (Weighted) w = ops::broadcast(weights[0]);
      P xs[U];
      if (prefetching) prefetch_ahead(towers[0] + j);
      in::template load_step<LaneOrder>(towers[0] + j, xs);
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        const P x = xs[u];
        if constexpr (Weighted) {
          a[u] = ops::mul(x, w);
          if constexpr (Squares) s[u] = ops::mul(a[u], ops::mul(x, c));
        } else {
          a[u] = x;
          if constexpr (Squares) s[u] = ops::mul(x, x);
        }
      }
      k = 1;
    }
    for (; k < count; ++k) {
      const S* g = towers[k] + j;
      P w{};
      if constexpr (Weighted) w = ops::broadcast(weights[k]);
      P xs[U];
      if (prefetching) prefetch_ahead(g);
      in::template load_step<LaneOrder>(g, xs);
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        const P x = xs[u];
        if constexpr (Weighted) {
          a[u] = ops::mul_add(x, w, a[u]);  // explicit: a compiler's contraction cannot change it
          if constexpr (Squares) s[u] = ops::mul_add(ops::mul(x, w), ops::mul(x, c), s[u]);
        } else {
          a[u] = ops::add(a[u], x);
          if constexpr (Squares) s[u] = ops::mul_add(x, x, s[u]);
        }
      }
    }
    if constexpr (Fused) {
      // A NaN or +-Inf input makes its sum NaN or +-Inf (f_k > 0 keeps it infinite, f_k = 0 makes
      // it NaN), so the inputs are probed only where a sum is not finite: a sum that overflowed
      // from finite inputs is told apart there, and once one is found nothing more is probed.
      if (fused->detect && !st.nonfinite) {
        const P zero = ops::broadcast(0);
        P probe = ops::mul(a[0], zero);  // 0 for a finite lane, NaN for any other
        for (std::size_t u = 1; u < U; ++u) probe = ops::mul_add(a[u], zero, probe);
        if (ops::any_nan(probe)) st.nonfinite = inputs_nonfinite(j);
      }
    }
    if constexpr (ToOut) {
      P m[U], q[U];
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        if (reciprocal != Acc(0)) {  // the same results: see exact_reciprocal
          const P r = ops::broadcast(reciprocal);
          m[u] = ops::mul(a[u], r);
          if constexpr (Squares) q[u] = ops::mul(s[u], r);
        } else {
          const P d = ops::broadcast(divisor);
          m[u] = ops::div(a[u], d);
          if constexpr (Squares) q[u] = ops::div(s[u], d);
        }
        m[u] = ops::canonical_nan(m[u]);
        if constexpr (Squares) q[u] = ops::canonical_nan(q[u]);
      }
      if constexpr (Fused && Squares)
        if (fused->statistics) st.add_statistics(m, q);
      if constexpr (LaneOrder && !LaneOrderOut) in::template reorder_lanes<true>(m);
      if constexpr (StreamOut) out::template stream_step<LaneOrderOut>(mean + j, m); else out::template store_step<LaneOrderOut>(mean + j, m);
      if constexpr (Squares) {
        if (!Fused || square != nullptr) {  // else the squares fed only the statistics
          if constexpr (LaneOrder && !LaneOrderOut) in::template reorder_lanes<true>(q);
          if constexpr (StreamOut) out::template stream_step<LaneOrderOut>(square + j, q); else out::template store_step<LaneOrderOut>(square + j, q);
        }
      }
    } else {
      if constexpr (LaneOrder) {  // the block in memory order: partial steps copy it by element
        in::template reorder_lanes<true>(a);
        if constexpr (Squares) in::template reorder_lanes<true>(s);
      }
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        ops::store(acc + j + u * W, a[u]);
        if constexpr (Squares) ops::store(sq + j + u * W, s[u]);
      }
    }
  }

  /// Whether an input of this group's towers in [j, j + E) is NaN or +-Inf.
  [[gnu::cold]] [[gnu::noinline]] bool inputs_nonfinite(std::size_t j) const noexcept {
    const P zero = ops::broadcast(0);
    P probe = zero;
    for (std::size_t k = 0; k < count; ++k)
      for (std::size_t u = 0; u < U; ++u) probe = ops::mul_add(in::load(towers[k] + j + u * W), zero, probe);
    return ops::any_nan(probe);
  }

  /// Elements [j, j + n), n < E: copied into a zero-padded step, computed by step() exactly as
  /// whole steps are, and the n results copied back.
  template <bool Unit>
  void partial_step(std::size_t j, std::size_t n, registers& st) const noexcept {
    alignas(64) S in_buf[group_towers][E] = {};
    const S* in_ptrs[group_towers];
    for (std::size_t k = 0; k < group_towers; ++k) in_ptrs[k] = in_buf[k];
    for (std::size_t k = 0; k < count; ++k) std::memcpy(in_buf[k], towers[k] + j, n * sizeof(S));
    alignas(64) Acc a_buf[E] = {}, s_buf[E] = {};
    if constexpr (FromAcc) {
      std::memcpy(a_buf, acc + j, n * sizeof(Acc));
      if constexpr (Squares) std::memcpy(s_buf, sq + j, n * sizeof(Acc));
    }
    alignas(64) O m_buf[E], q_buf[E];
    const group_pass padded{in_ptrs, count, a_buf, s_buf, m_buf, q_buf, divisor, reciprocal,
                            weights, fused, state, false, false};
    padded.template step<Unit, false>(0, st, false);
    if constexpr (ToOut) {
      std::memcpy(mean + j, m_buf, n * sizeof(O));
      if constexpr (Squares)
        if (square != nullptr) std::memcpy(square + j, q_buf, n * sizeof(O));
    } else {
      std::memcpy(acc + j, a_buf, n * sizeof(Acc));
      if constexpr (Squares) std::memcpy(sq + j, s_buf, n * sizeof(Acc));
    }
  }

  /// Elements [0, len).
  void run(std::size_t len) const noexcept { run_inlined(len); }

  /// run(), inlined into a caller whose towers' pointers and weights are its arrays of
  /// group_towers: their loads are then unrolled and hoisted out of the steps.
  GRADAVG_INLINE_ void run_inlined(std::size_t len) const noexcept {
    registers st;  // a local the compiler can keep in registers, unlike *state
    if constexpr (Fused) {
      st = *state;
      // The plain operations where every f_k and c are 1, only where up to group_towers towers
      // go straight to the outputs: more towers take the general ones (the same bits), sparing
      // a second copy of the block passes.
      if constexpr (!FromAcc && ToOut) {
        bool unit = fused->scale_in_acc == Acc(1);
        for (std::size_t k = 0; k < count; ++k) unit = unit && weights[k] == Acc(1);
        if (unit) run_steps<true>(len, st); else run_steps<false>(len, st);
      } else {
        run_steps<false>(len, st);
      }
      *state = st;
    } else {
      run_steps<false>(len, st);
    }
  }

  /// Elements [0, len): when streaming, a partial step up to the alignment of the outputs' widest
  /// stores (step_store_bytes); whole steps; then a partial step for the tail.
  template <bool Unit>
  GRADAVG_INLINE_ void run_steps(std::size_t len, registers& st) const noexcept {
    std::size_t j = 0;
    if (ToOut && stream) {
      // Not with statistics: their lanes follow the steps, which must not move with the outputs'
      // address (a misaligned packet is then stored normally, see packet_ops::stream).
      const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(mean) % out::step_store_bytes;
      if (misaligned % sizeof(O) == 0 && misaligned != 0 && !(Fused && fused->statistics)) {
        j = std::min(len, (out::step_store_bytes - misaligned) / sizeof(O));
        partial_step<Unit>(0, j, st);
      }
    }
    // The whole steps update a copy whose address is never taken (partial_step takes st's), so
    // that the compiler can keep the fused state in registers across the steps.
    registers in_steps = st;
    if (ToOut && stream) {
      if (software_prefetch && prefetch)
        for (; j + E <= len; j += E) step<Unit, ToOut>(j, in_steps, true);
      for (; j + E <= len; j += E) step<Unit, ToOut>(j, in_steps, false);
    } else {
      if (software_prefetch && prefetch)
        for (; j + E <= len; j += E) step<Unit, false>(j, in_steps, true);
      for (; j + E <= len; j += E) step<Unit, false>(j, in_steps, false);
    }
    st = in_steps;
    if (j < len) partial_step<Unit>(j, len - j, st);
  }
};

/// 1/d when d is a positive normal power of two, else 0. Then 1/d is a power of two too, exactly
/// representable (at worst a subnormal), so x * (1/d) and x / d are the same real number and
/// round to the same result for every x (subnormal results, zeros, infinities included; NaN
/// results are made canonical either way): the kernel multiplies instead of dividing, several
/// times cheaper where a call's data sit in cache.
template <class Acc>
Acc exact_reciprocal(Acc d) noexcept {
  static_assert(std::numeric_limits<Acc>::is_iec559);
  using bits_t = std::conditional_t<sizeof(Acc) == 4, std::uint32_t, std::uint64_t>;
  constexpr bits_t fraction_mask = (bits_t{1} << (std::numeric_limits<Acc>::digits - 1)) - 1;
  const bool normal = d >= std::numeric_limits<Acc>::min() && d <= std::numeric_limits<Acc>::max();
  return normal && (std::bit_cast<bits_t>(d) & fraction_mask) == 0 ? Acc(1) / d : Acc(0);
}

/// Tower k's first element of one variable, read through a function pointer: the kernel is
/// compiled once per element type and variant, not once per caller's way of holding gradients.
template <class S>
struct tower_reader {
  const void* context;
  const S* (*first_element)(const void* context, std::size_t tower);
  /// Where first_element is null: tower k's first element is the const std::byte* stored at
  /// table + k * stride (a table of pointers the caller built; no call per tower).
  const std::byte* table = nullptr;
  std::size_t stride = 0;
  const S* operator()(std::size_t tower) const {
    if (first_element == nullptr) {
      const std::byte* p;
      std::memcpy(&p, table + tower * stride, sizeof p);
#if defined(__GNUC__)
      // Keeps the per-tower loop scalar: vectorised, it became a gather (tens of cycles per
      // variable, a tenth of a 1,000 x 64-float call).
      asm("" : "+r"(p));
#endif
      return reinterpret_cast<const S*>(p);
    }
    return first_element(context, tower);
  }
};

/// The pass's state for one variable: the tower pointers and weights of the group being summed,
/// and the fused registers.
template <class S, class Acc, bool Fused>
struct variable_pass {
  struct no_state {};
  const S* group[group_towers];
  Acc weights[group_towers];
  [[maybe_unused]] std::conditional_t<Fused, fused_state<Acc>, no_state> state;

  fused_state<Acc>* state_ptr() noexcept {
    if constexpr (Fused) return &state; else return nullptr;
  }
  /// group[k] and weights[k] for towers [first, first + count), from element `offset` on.
  void load(const tower_reader<S>& tower_data, std::size_t first, std::size_t count, std::size_t offset,
            const fused_params<Acc>* fused) {
    for (std::size_t k = 0; k < count; ++k) group[k] = tower_data(first + k) + offset;
    if constexpr (Fused)
      for (std::size_t k = 0; k < count; ++k)
        weights[k] = static_cast<Acc>((fused->weights ? fused->weights[first + k] : 1.0) * fused->scale);
  }
};

/// More than group_towers towers: group by group through the L1 accumulator block. Out of line,
/// so that its block does not enlarge the stack frame of every call with fewer towers.
template <class S, class Acc, class O, bool Fused, bool WithSquare>
[[gnu::noinline]] void reduce_blocks(variable_pass<S, Acc, Fused>& v, const tower_reader<S>& tower_data,
                                     std::size_t tower_count, std::size_t begin, std::size_t end, O* mean, O* square,
                                     Acc divisor, Acc reciprocal, const fused_params<Acc>* fused, bool prefetch,
                                     bool stream) {
  constexpr std::size_t B = block_elements<Acc>;
  alignas(64) Acc acc[B];
  alignas(64) Acc sq[WithSquare ? B : 1];
  for (std::size_t block = begin; block < end; block += B) {
    const std::size_t len = std::min(B, end - block);
    for (std::size_t first = 0; first < tower_count; first += group_towers) {
      const std::size_t count = std::min(group_towers, tower_count - first);
      v.load(tower_data, first, count, block, fused);
      O* m = mean + block;
      O* q = square ? square + block : nullptr;
      if (first == 0)
        group_pass<S, Acc, O, Fused, WithSquare, false, false>{
            v.group, count, acc, sq, m, q, divisor, reciprocal, v.weights, fused, v.state_ptr(), prefetch, stream}
            .run(len);
      else if (first + count < tower_count)
        group_pass<S, Acc, O, Fused, WithSquare, true, false>{
            v.group, count, acc, sq, m, q, divisor, reciprocal, v.weights, fused, v.state_ptr(), prefetch, stream}
            .run(len);
      else
        group_pass<S, Acc, O, Fused, WithSquare, true, true>{
            v.group, count, acc, sq, m, q, divisor, reciprocal, v.weights, fused, v.state_ptr(), prefetch, stream}
            .run(len);
    }
  }
}

template <class S, class Acc, class O, bool Fused, bool WithSquare>
piece_result reduce_range_impl(const tower_reader<S>& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end,
                               O* mean, O* square, Acc divisor, const fused_params<Acc>* fused, bool prefetch,
                               bool stream) {
  const Acc reciprocal = exact_reciprocal(divisor);
  variable_pass<S, Acc, Fused> v;
  if (tower_count <= group_towers) {
    v.load(tower_data, 0, tower_count, begin, fused);
    group_pass<S, Acc, O, Fused, WithSquare, false, true>{
        v.group, tower_count, nullptr, nullptr, mean + begin, square ? square + begin : nullptr, divisor, reciprocal,
        v.weights, fused, v.state_ptr(), prefetch, stream}
        .run_inlined(end - begin);
  } else {
    reduce_blocks<S, Acc, O, Fused, WithSquare>(v, tower_data, tower_count, begin, end, mean, square, divisor,
                                                reciprocal, fused, prefetch, stream);
  }
  if (stream) streaming_fence();
  if constexpr (Fused)
    return v.state.result();
  else
    return {};
}

/// Reduces elements [begin, end) of one variable (see the file comment), summing in Acc.
/// tower_data(k) returns tower k's first element (of the whole variable, not of the range).
/// divisor: T, or the weight sum. fused: null for the plain pass. streaming: write the outputs
/// with non-temporal stores (storage_ops::stream). prefetch: prefetch the towers' data ahead of
/// the loads (for calls of prefetch_min_bytes or more). Neither changes a result.
template <class S, class Acc, class O>
piece_result reduce_range(const tower_reader<S>& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end,
                          O* mean, O* square, bool streaming, bool prefetch, Acc divisor, const fused_params<Acc>* fused) {
  static_assert(supported_scalar<S>, "gradavg: gradient elements must be float, double, Eigen::half or Eigen::bfloat16");
  static_assert(supported_output<S, O>, "gradavg: outputs must hold the gradients' element type (or float for 16-bit)");
  if (begin >= end) return {};
  auto run = [&]<bool Fused, bool WithSquare>() {
    return reduce_range_impl<S, Acc, O, Fused, WithSquare>(tower_data, tower_count, begin, end, mean, square, divisor,
                                                           fused, prefetch, streaming);
  };
  if (fused != nullptr) {
    if (square != nullptr || fused->statistics) return run.template operator()<true, true>();
    return run.template operator()<true, false>();
  }
  if (square != nullptr) return run.template operator()<false, true>();
  return run.template operator()<false, false>();
}

/// Every (gradients, accumulator, outputs) element-type combination the library instantiates the
/// kernel for: X(S, Acc, O) for each (the passes of average.hpp, the MPI path's buffers).
#define GRADAVG_KERNEL_INSTANCES_(X)                                                            \
  X(float, float, float) X(float, double, float) X(double, double, double)                      \
  X(Eigen::half, float, Eigen::half) X(Eigen::half, float, float)                               \
  X(Eigen::bfloat16, float, Eigen::bfloat16) X(Eigen::bfloat16, float, float)
#define GRADAVG_REDUCE_RANGE_INSTANCE_(S, Acc, O)                                                            \
  template piece_result reduce_range<S, Acc, O>(const tower_reader<S>&, std::size_t, std::size_t, std::size_t, \
                                                O*, O*, bool, bool, Acc, const fused_params<Acc>*);
#define GRADAVG_EXTERN_REDUCE_RANGE_INSTANCE_(S, Acc, O) extern GRADAVG_REDUCE_RANGE_INSTANCE_(S, Acc, O)

// GRADAVG_EXTERN_KERNELS: this translation unit does not compile the kernel; one other unit of
// the program, built for the same instruction set, includes <gradavg/kernels.hpp>.
#if defined(GRADAVG_EXTERN_KERNELS)
GRADAVG_KERNEL_INSTANCES_(GRADAVG_EXTERN_REDUCE_RANGE_INSTANCE_)
#endif

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
