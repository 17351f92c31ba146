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
// statistics are sums over elements in eight double lanes filled in the same order at every SIMD
// level (fused_state): the same bits too. A NaN result is always the default quiet NaN (NaN
// inputs' payloads are not propagated), so NaN results are bitwise reproducible too.
// Every g_k[j] is read once and mean[j], square[j] written once, after all reads of index j,
// so mean may be g_0 itself (in place). No other overlap is allowed.
//
// How: up to group_towers towers are summed in registers, one cache line of each at a time, and
// the result stored straight to the output: T+1 (or T+2) streams, no intermediate memory
// traffic. More towers are folded group by group through an L1-resident block of accumulators.
// With streaming set, outputs are written with non-temporal stores where the target has them;
// with prefetch set (large calls), whole steps prefetch each tower's data a little ahead.
//
// Levels (simd.hpp): packet_level.hpp, storage_level.hpp, kernel_level.hpp and reduce_level.hpp
// are compiled once per level this translation unit has (detail/isa.hpp), each in its own
// namespace (detail::sse2, avx2, avx512, avx512_bf16; detail::generic for a unit without run-time
// dispatch) and, on x86-64, inside a region that enables the level's instructions for those
// functions alone; reduce_range (and reduce_variables) picks one per call.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#if GRADAVG_UNIT_LEVEL_ >= 2 || defined(GRADAVG_DISPATCH_)
#include <immintrin.h>
#endif

#include "../simd.hpp"
#include "layout_proof.hpp"
#include "isa.hpp"
#include "types.hpp"

/// Inlined into the kernel's loops whatever the compiler's heuristics say (they keep packet
/// registers out of memory).
#if defined(__GNUC__) || defined(__clang__)
#define GRADAVG_INLINE_ [[gnu::always_inline]] inline
#else
#define GRADAVG_INLINE_ inline
#endif

/// Unrolls the loop that follows over a step's few packets, so that per-packet registers
/// indexed by the loop stay registers.
#if defined(__clang__)
#define GRADAVG_UNROLL_ _Pragma("unroll")
#elif defined(__GNUC__)
#define GRADAVG_UNROLL_ _Pragma("GCC unroll 8")
#else
#define GRADAVG_UNROLL_
#endif

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

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

/// Orders non-temporal stores before what follows (they are weakly ordered): the same at every
/// level (SSE's sfence); nothing where no level streams.
inline void streaming_fence() noexcept {
#if GRADAVG_UNIT_LEVEL_ >= 2
  _mm_sfence();
#endif
}

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

/// The towers of variable i of a table of buffers: its row of first bytes, read directly.
template <class S>
tower_reader<S> row_reader(const shared_detail::buffer_table& table, std::size_t i) noexcept {
  return {nullptr, nullptr, reinterpret_cast<const std::byte*>(table.row(i)), sizeof(const std::byte*)};
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg

#include "levels.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// Reduces elements [begin, end) of one variable (see the file comment), summing in Acc, at the
/// level simd_level_in_use() names. tower_data(k) returns tower k's first element (of the whole
/// variable, not of the range). divisor: T, or the weight sum. fused: null for the plain pass.
/// streaming: write the outputs with non-temporal stores (storage_ops::stream). prefetch:
/// prefetch the towers' data ahead of the loads (for calls of prefetch_min_bytes or more).
/// Neither changes a result.
template <class S, class Acc, class O>
piece_result reduce_range(const tower_reader<S>& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end,
                          O* mean, O* square, bool streaming, bool prefetch, Acc divisor, const fused_params<Acc>* fused) {
  static_assert(supported_scalar<S>, "gradavg: gradient elements must be " GRADAVG_ELEMENT_TYPES_MESSAGE_);
  static_assert(supported_output<S, O>, "gradavg: outputs must hold the gradients' element type (or float for 16-bit)");
  if (begin >= end) return {};
  GRADAVG_AT_LEVEL_((std::is_same_v<O, Eigen::bfloat16>),
                    reduce_range<S, Acc, O>(tower_data, tower_count, begin, end, mean, square, streaming, prefetch,
                                            divisor, fused));
}

/// Whole variables [first, last) of table, plain pass, each as reduce_range over all its
/// elements, with one dispatch for all of them: variable i's gradient on tower k begins at
/// table.row(i)[k], its means output at row(i)[T] and, with_squares, its squares output at
/// row(i)[T + 1], each of table.elements[i] elements (0: the variable is skipped).
template <class S, class Acc, class O>
void reduce_variables(const shared_detail::buffer_table& table, std::size_t first, std::size_t last,
                      std::size_t tower_count, bool with_squares, bool streaming, bool prefetch, Acc divisor) {
  if (first >= last) return;
  GRADAVG_AT_LEVEL_((std::is_same_v<O, Eigen::bfloat16>),
                    reduce_variables<S, Acc, O>(table, first, last, tower_count, with_squares, streaming, prefetch,
                                                divisor));
}

/// to[j] = from[j] / divisor for j in [0, len), a NaN quotient the default quiet NaN, with
/// non-temporal stores where the level has them: the same values as the scalar division. Call
/// streaming_fence before the outputs are read (once for many calls).
template <class Acc>
void stream_quotients(const Acc* from, Acc* to, std::size_t len, Acc divisor) noexcept {
  GRADAVG_AT_LEVEL_(false, stream_quotients<Acc>(from, to, len, divisor));
}

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
