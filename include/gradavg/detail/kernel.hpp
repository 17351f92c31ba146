// gradavg internals: the averaging kernel over raw contiguous memory.
//
// Contract of reduce_range (one variable, T towers, elements [begin, end)):
//   mean[j]   = (g_0[j] + g_1[j] + ... + g_{T-1}[j]) / T        summed in tower order
//   square[j] = (g_0[j]^2 + ... + g_{T-1}[j]^2) / T              when square != nullptr
// in the accumulator type; squares use a fused multiply-add where the packets do. The scalar
// path rounds exactly as the packet path, so each element's result depends only on its inputs
// and T — never on blocking, alignment, or how a caller splits [0, n) across threads.
// Every g_k[j] is read once and mean[j], square[j] written once, after all reads of index j,
// so mean may be g_0 itself (in place). No other overlap is allowed.
//
// How: up to group_towers towers are summed in registers, one cache line of each at a time, and
// the result stored straight to the output: T+1 (or T+2) streams, no intermediate memory
// traffic. More towers are folded group by group through an L1-resident block of accumulators.
// With streaming set, outputs are written with non-temporal stores where the target has them.
#pragma once

#include <Eigen/Core>

#if defined(EIGEN_VECTORIZE_SSE2) || defined(EIGEN_VECTORIZE_AVX) || defined(EIGEN_VECTORIZE_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace gradavg::detail {

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

template <class Acc>
using packet_t = typename Eigen::internal::packet_traits<Acc>::type;

template <class Acc>
inline constexpr std::size_t packet_size =
    static_cast<std::size_t>(Eigen::internal::unpacket_traits<packet_t<Acc>>::size);

/// Packets per step: one 64-byte cache line of each tower (at least one packet, at most four).
template <class Acc>
inline constexpr std::size_t step_packets = std::clamp<std::size_t>(64 / sizeof(packet_t<Acc>), 1, 4);

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

/// s + g*g, rounded exactly as the packet path rounds it (fused where packets fuse).
template <class Acc>
inline Acc add_square(Acc s, Acc g) noexcept {
#if defined(EIGEN_VECTORIZE_FMA)
  return std::fma(g, g, s);
#else
  return s + g * g;
#endif
}

/// Stores a packet; with Stream, non-temporally where the target can and p is aligned.
template <bool Stream, class Acc>
inline void store_packet(Acc* p, const packet_t<Acc>& v) noexcept {
  namespace ei = Eigen::internal;
  if constexpr (Stream) {
    if (reinterpret_cast<std::uintptr_t>(p) % sizeof(packet_t<Acc>) == 0) {
#if defined(EIGEN_VECTORIZE_AVX512)
      if constexpr (sizeof(packet_t<Acc>) == 64) {
        if constexpr (std::is_same_v<Acc, float>) return _mm512_stream_ps(p, v);
        else return _mm512_stream_pd(p, v);
      }
#endif
#if defined(EIGEN_VECTORIZE_AVX)
      if constexpr (sizeof(packet_t<Acc>) == 32) {
        if constexpr (std::is_same_v<Acc, float>) return _mm256_stream_ps(p, v);
        else return _mm256_stream_pd(p, v);
      }
#endif
#if defined(EIGEN_VECTORIZE_SSE2)
      if constexpr (sizeof(packet_t<Acc>) == 16) {
        if constexpr (std::is_same_v<Acc, float>) return _mm_stream_ps(p, v);
        else return _mm_stream_pd(p, v);
      }
#endif
    }
  }
  ei::pstoreu(p, v);
}

/// Orders non-temporal stores before what follows (they are weakly ordered).
inline void streaming_fence() noexcept {
#if defined(EIGEN_VECTORIZE_SSE2)
  _mm_sfence();
#endif
}

/// Where a group's sums come from and go: FromAcc = the accumulator block is added first;
/// ToOut = the group is the last, so results are divided by T and stored to the outputs.
template <class S, bool WithSquare, bool FromAcc, bool ToOut, bool Stream>
struct group_pass {
  using Acc = accumulator_t<S>;
  using P = packet_t<Acc>;
  static constexpr std::size_t W = packet_size<Acc>;
  static constexpr std::size_t U = step_packets<Acc>;

  const S* const* towers;  // count pointers, already offset to element 0 of this pass
  std::size_t count;
  Acc* acc;  // accumulator block (FromAcc or !ToOut), indexed like the outputs; any alignment
  Acc* sq;
  Acc* mean;  // outputs (ToOut), offset like towers
  Acc* square;
  Acc divisor;

  /// Elements [j, j + U*W): U packets of every tower, summed in registers.
  void step(std::size_t j) const noexcept {
    namespace ei = Eigen::internal;
    P a[U], s[U];
    std::size_t k = 0;
    if constexpr (FromAcc) {
      for (std::size_t u = 0; u < U; ++u) {
        a[u] = ei::ploadu<P>(acc + j + u * W);
        if constexpr (WithSquare) s[u] = ei::ploadu<P>(sq + j + u * W);
      }
    } else {
      for (std::size_t u = 0; u < U; ++u) {
        a[u] = ei::ploadu<P>(towers[0] + j + u * W);
        if constexpr (WithSquare) s[u] = ei::pmul(a[u], a[u]);
      }
      k = 1;
    }
    for (; k < count; ++k) {
      const S* g = towers[k] + j;
      for (std::size_t u = 0; u < U; ++u) {
        const P x = ei::ploadu<P>(g + u * W);
        a[u] = ei::padd(a[u], x);
        if constexpr (WithSquare) s[u] = ei::pmadd(x, x, s[u]);
      }
    }
    const P d = ei::pset1<P>(divisor);
    for (std::size_t u = 0; u < U; ++u) {
      if constexpr (ToOut) {
        store_packet<Stream>(mean + j + u * W, ei::pdiv(a[u], d));
        if constexpr (WithSquare) store_packet<Stream>(square + j + u * W, ei::pdiv(s[u], d));
      } else {
        ei::pstoreu(acc + j + u * W, a[u]);
        if constexpr (WithSquare) ei::pstoreu(sq + j + u * W, s[u]);
      }
    }
  }

  /// One element, rounded as the packet path rounds it.
  void scalar(std::size_t j) const noexcept {
    Acc a, s{};
    std::size_t k = 0;
    if constexpr (FromAcc) {
      a = acc[j];
      if constexpr (WithSquare) s = sq[j];
    } else {
      a = Acc(towers[0][j]);
      s = a * a;
      k = 1;
    }
    for (; k < count; ++k) {
      const Acc x = Acc(towers[k][j]);
      a = a + x;
      s = add_square(s, x);
    }
    if constexpr (ToOut) {
      mean[j] = a / divisor;
      if constexpr (WithSquare) square[j] = s / divisor;
    } else {
      acc[j] = a;
      if constexpr (WithSquare) sq[j] = s;
    }
  }

  /// Elements [0, len): a scalar head up to the outputs' packet alignment when streaming,
  /// whole steps, then scalars.
  void run(std::size_t len) const noexcept {
    std::size_t j = 0;
    if constexpr (ToOut && Stream) {
      const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(mean) % sizeof(P);
      if (misaligned % sizeof(Acc) == 0 && misaligned != 0)
        for (std::size_t head = std::min(len, (sizeof(P) - misaligned) / sizeof(Acc)); j < head; ++j) scalar(j);
    }
    constexpr std::size_t step_elements = U * W;
    for (; j + step_elements <= len; j += step_elements) step(j);
    for (; j < len; ++j) scalar(j);
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

}  // namespace gradavg::detail
