// gradavg internals: the averaging kernel over raw contiguous memory.
//
// Contract of reduce_range (one variable, T towers, elements [begin, end)):
//   mean[j]   = (g_0[j] + g_1[j] + ... + g_{T-1}[j]) / T        summed in tower order
//   square[j] = (g_0[j]^2 + ... + g_{T-1}[j]^2) / T              when square != nullptr
// in the accumulator type; squares use the packets' multiply-add (packet_ops::mul_add). Every
// element, tails included, is computed by the same packet operations (a tail is copied into a
// zero-padded step), so each element's result depends only on its inputs and T — never on
// blocking, alignment, how a caller splits [0, n) across threads, or whether the target's
// multiply-add fuses. A NaN result is always the default quiet NaN (NaN inputs' payloads are not
// propagated), so NaN results are bitwise reproducible too.
// Every g_k[j] is read once and mean[j], square[j] written once, after all reads of index j,
// so mean may be g_0 itself (in place). No other overlap is allowed.
//
// How: up to group_towers towers are summed in registers, one cache line of each at a time, and
// the result stored straight to the output: T+1 (or T+2) streams, no intermediate memory
// traffic. More towers are folded group by group through an L1-resident block of accumulators.
// With streaming set, outputs are written with non-temporal stores where the target has them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.hpp"
#include "packet.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// Type in which values stored as S are summed. 16-bit storage will map to float here.
template <class S>
struct accumulator {
  using type = S;
};
template <class S>
using accumulator_t = typename accumulator<S>::type;

/// Element types the kernel handles today.
template <class S>
inline constexpr bool supported_scalar = std::is_same_v<S, float> || std::is_same_v<S, double>;

/// Packets per step: one 64-byte cache line of each tower (at least one packet, at most four).
template <class Acc>
inline constexpr std::size_t step_packets = std::clamp<std::size_t>(64 / packet_ops<Acc>::bytes, 1, 4);

/// Elements per step.
template <class Acc>
inline constexpr std::size_t step_elements = step_packets<Acc> * packet_ops<Acc>::width;

/// Towers summed in registers before going through the accumulator block.
inline constexpr std::size_t group_towers = 16;

/// Elements per L1-resident accumulator block (used only with more than group_towers towers).
template <class Acc>
inline constexpr std::size_t block_elements = 4096 / sizeof(Acc);

/// Threads split the flat range of all elements at multiples of this: chunk boundaries stay away
/// from sharing a cache line within a variable that starts on one. Results never depend on it.
template <class S>
constexpr std::size_t split_granularity() noexcept {
  return block_elements<accumulator_t<S>>;
}

/// Where a group's sums come from and go: FromAcc = the accumulator block is added first;
/// ToOut = the group is the last, so results are divided by T and stored to the outputs.
template <class S, bool WithSquare, bool FromAcc, bool ToOut, bool Stream>
struct group_pass {
  using Acc = accumulator_t<S>;
  using ops = packet_ops<Acc>;
  using P = typename ops::type;
  static constexpr std::size_t W = ops::width;
  static constexpr std::size_t U = step_packets<Acc>;
  static constexpr std::size_t E = step_elements<Acc>;

  const S* const* towers;  // count pointers, already offset to element 0 of this pass
  std::size_t count;
  Acc* acc;  // accumulator block (FromAcc or !ToOut), indexed like the outputs; any alignment
  Acc* sq;
  Acc* mean;  // outputs (ToOut), offset like towers
  Acc* square;
  Acc divisor;

  /// Elements [j, j + E): U packets of every tower, summed in registers. StreamOut: store the
  /// outputs non-temporally.
  template <bool StreamOut>
  void step(std::size_t j) const noexcept {
    P a[U], s[U];
    std::size_t k = 0;
    if constexpr (FromAcc) {
      for (std::size_t u = 0; u < U; ++u) {
        a[u] = ops::load(acc + j + u * W);
        if constexpr (WithSquare) s[u] = ops::load(sq + j + u * W);
      }
    } else {
      for (std::size_t u = 0; u < U; ++u) {
        a[u] = ops::load(towers[0] + j + u * W);
        if constexpr (WithSquare) s[u] = ops::mul(a[u], a[u]);
      }
      k = 1;
    }
    for (; k < count; ++k) {
      const S* g = towers[k] + j;
      for (std::size_t u = 0; u < U; ++u) {
        const P x = ops::load(g + u * W);
        a[u] = ops::add(a[u], x);
        if constexpr (WithSquare) s[u] = ops::mul_add(x, x, s[u]);
      }
    }
    for (std::size_t u = 0; u < U; ++u) {
      if constexpr (ToOut) {
        const P d = ops::broadcast(divisor);
        const P m = ops::canonical_nan(ops::div(a[u], d));
        if constexpr (StreamOut) ops::stream(mean + j + u * W, m); else ops::store(mean + j + u * W, m);
        if constexpr (WithSquare) {
          const P q = ops::canonical_nan(ops::div(s[u], d));
          if constexpr (StreamOut) ops::stream(square + j + u * W, q); else ops::store(square + j + u * W, q);
        }
      } else {
        ops::store(acc + j + u * W, a[u]);
        if constexpr (WithSquare) ops::store(sq + j + u * W, s[u]);
      }
    }
  }

  /// Elements [j, j + n), n < E: copied into a zero-padded step, computed by step() exactly as
  /// whole steps are, and the n results copied back.
  void partial_step(std::size_t j, std::size_t n) const noexcept {
    alignas(64) S in[group_towers][E] = {};
    const S* in_ptrs[group_towers];
    for (std::size_t k = 0; k < group_towers; ++k) in_ptrs[k] = in[k];
    for (std::size_t k = 0; k < count; ++k) std::memcpy(in[k], towers[k] + j, n * sizeof(S));
    alignas(64) Acc a_buf[E] = {}, s_buf[E] = {};
    if constexpr (FromAcc) {
      std::memcpy(a_buf, acc + j, n * sizeof(Acc));
      if constexpr (WithSquare) std::memcpy(s_buf, sq + j, n * sizeof(Acc));
    }
    alignas(64) Acc m_buf[E], q_buf[E];
    const group_pass padded{in_ptrs, count, a_buf, s_buf, m_buf, q_buf, divisor};
    padded.template step<false>(0);
    if constexpr (ToOut) {
      std::memcpy(mean + j, m_buf, n * sizeof(Acc));
      if constexpr (WithSquare) std::memcpy(square + j, q_buf, n * sizeof(Acc));
    } else {
      std::memcpy(acc + j, a_buf, n * sizeof(Acc));
      if constexpr (WithSquare) std::memcpy(sq + j, s_buf, n * sizeof(Acc));
    }
  }

  /// Elements [0, len): when streaming, a partial step up to the outputs' packet alignment;
  /// whole steps; then a partial step for the tail.
  void run(std::size_t len) const noexcept {
    std::size_t j = 0;
    if constexpr (ToOut && Stream) {
      const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(mean) % ops::bytes;
      if (misaligned % sizeof(Acc) == 0 && misaligned != 0) {
        j = std::min(len, (ops::bytes - misaligned) / sizeof(Acc));
        partial_step(0, j);
      }
    }
    for (; j + E <= len; j += E) step<ToOut && Stream>(j);
    if (j < len) partial_step(j, len - j);
  }
};

template <class S, bool WithSquare, bool Stream>
void reduce_range_impl(const auto& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end, S* mean,
                       S* square) {
  using Acc = accumulator_t<S>;
  const Acc divisor = static_cast<Acc>(tower_count);
  const S* group[group_towers];

  if (tower_count <= group_towers) {
    for (std::size_t k = 0; k < tower_count; ++k) group[k] = tower_data(k) + begin;
    group_pass<S, WithSquare, false, true, Stream>{group,       tower_count, nullptr, nullptr,
                                                   mean + begin, square ? square + begin : nullptr, divisor}
        .run(end - begin);
  } else {
    constexpr std::size_t B = block_elements<Acc>;
    alignas(64) Acc acc[B];
    alignas(64) Acc sq[WithSquare ? B : 1];
    for (std::size_t block = begin; block < end; block += B) {
      const std::size_t len = std::min(B, end - block);
      for (std::size_t first = 0; first < tower_count; first += group_towers) {
        const std::size_t count = std::min(group_towers, tower_count - first);
        for (std::size_t k = 0; k < count; ++k) group[k] = tower_data(first + k) + block;
        Acc* m = mean + block;
        Acc* q = square ? square + block : nullptr;
        if (first == 0)
          group_pass<S, WithSquare, false, false, Stream>{group, count, acc, sq, m, q, divisor}.run(len);
        else if (first + count < tower_count)
          group_pass<S, WithSquare, true, false, Stream>{group, count, acc, sq, m, q, divisor}.run(len);
        else
          group_pass<S, WithSquare, true, true, Stream>{group, count, acc, sq, m, q, divisor}.run(len);
      }
    }
  }
  if constexpr (Stream) streaming_fence();
}

/// Reduces elements [begin, end) of one variable (see the file comment). tower_data(k) returns
/// tower k's first element (of the whole variable, not of the range). streaming: write the
/// outputs with non-temporal stores.
template <class S, class TowerData>
void reduce_range(const TowerData& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end, S* mean,
                  S* square, bool streaming = false) {
  static_assert(supported_scalar<S>, "gradavg: gradient elements must be float or double");
  if (begin >= end) return;
  if (square != nullptr) {
    if (streaming)
      reduce_range_impl<S, true, true>(tower_data, tower_count, begin, end, mean, square);
    else
      reduce_range_impl<S, true, false>(tower_data, tower_count, begin, end, mean, square);
  } else {
    if (streaming)
      reduce_range_impl<S, false, true>(tower_data, tower_count, begin, end, mean, square);
    else
      reduce_range_impl<S, false, false>(tower_data, tower_count, begin, end, mean, square);
  }
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
