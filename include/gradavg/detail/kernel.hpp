// gradavg internals: the averaging kernel over raw contiguous memory.
//
// Contract of reduce_variable (for one variable, T towers, n elements):
//   mean[j]   = (g_0[j] + g_1[j] + ... + g_{T-1}[j]) / T        summed in tower order
//   square[j] = (g_0[j]^2 + ... + g_{T-1}[j]^2) / T              when square != nullptr
// in the accumulator type. Every g_k[j] is read once and mean[j], square[j] written once, after
// all reads of index j in the same block, so mean may be g_0 itself (in place). No other overlap
// is allowed. Each element's result depends only on its inputs and T, never on blocking or on
// how a caller splits [0, n) into ranges, as long as every split point is a multiple of
// split_granularity<Storage>().
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
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
inline constexpr std::size_t packet_size = static_cast<std::size_t>(Eigen::internal::unpacket_traits<packet_t<Acc>>::size);

/// Elements per L1-resident accumulator block (a mean and a square block of this many).
template <class Acc>
inline constexpr std::size_t block_elements = 4096 / sizeof(Acc);

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

/// Folds towers [first, first + count) of one block into the accumulators: acc (and sq) are
/// initialised from the first tower when initialise is set, else added to. count <= 4.
template <class S, bool WithSquare>
inline void fold_towers(const S* const* towers, std::size_t count, bool initialise, std::size_t offset,
                        std::size_t len, accumulator_t<S>* acc, accumulator_t<S>* sq) noexcept {
  using Acc = accumulator_t<S>;
  using P = packet_t<Acc>;
  constexpr std::size_t W = packet_size<Acc>;
  namespace ei = Eigen::internal;

  const S* t[4];
  for (std::size_t k = 0; k < count; ++k) t[k] = towers[k] + offset;
  const std::size_t packets_end = len / W * W;
  if (initialise) {
    // acc = g_first (+ the next towers of this group, in order).
    for (std::size_t j = 0; j < packets_end; j += W) {
      P g = ei::ploadu<P>(t[0] + j);
      P a = g;
      P s;
      if constexpr (WithSquare) s = ei::pmul(g, g);
      for (std::size_t k = 1; k < count; ++k) {
        g = ei::ploadu<P>(t[k] + j);
        a = ei::padd(a, g);
        if constexpr (WithSquare) s = ei::pmadd(g, g, s);
      }
      ei::pstore(acc + j, a);
      if constexpr (WithSquare) ei::pstore(sq + j, s);
    }
    for (std::size_t j = packets_end; j < len; ++j) {
      Acc g = Acc(t[0][j]);
      Acc a = g;
      Acc s = g * g;
      for (std::size_t k = 1; k < count; ++k) {
        g = Acc(t[k][j]);
        a = a + g;
        s = add_square(s, g);
      }
      acc[j] = a;
      if constexpr (WithSquare) sq[j] = s;
    }
    return;
  }
  for (std::size_t j = 0; j < packets_end; j += W) {
    P a = ei::pload<P>(acc + j);
    P s;
    if constexpr (WithSquare) s = ei::pload<P>(sq + j);
    for (std::size_t k = 0; k < count; ++k) {
      P g = ei::ploadu<P>(t[k] + j);
      a = ei::padd(a, g);
      if constexpr (WithSquare) s = ei::pmadd(g, g, s);
    }
    ei::pstore(acc + j, a);
    if constexpr (WithSquare) ei::pstore(sq + j, s);
  }
  for (std::size_t j = packets_end; j < len; ++j) {
    Acc a = acc[j];
    Acc s = WithSquare ? sq[j] : Acc(0);
    for (std::size_t k = 0; k < count; ++k) {
      Acc g = Acc(t[k][j]);
      a = a + g;
      s = add_square(s, g);
    }
    acc[j] = a;
    if constexpr (WithSquare) sq[j] = s;
  }
}

/// out[j] = acc[j] / towers for j < len.
template <class Acc, class Out>
inline void finish_block(const Acc* acc, std::size_t len, Acc towers, Out* out) noexcept {
  using P = packet_t<Acc>;
  constexpr std::size_t W = packet_size<Acc>;
  namespace ei = Eigen::internal;
  static_assert(std::is_same_v<Acc, Out>, "outputs hold the accumulator type today");
  const P divisor = ei::pset1<P>(towers);
  const std::size_t packets_end = len / W * W;
  for (std::size_t j = 0; j < packets_end; j += W) ei::pstoreu(out + j, ei::pdiv(ei::pload<P>(acc + j), divisor));
  for (std::size_t j = packets_end; j < len; ++j) out[j] = acc[j] / towers;
}

/// Reduces elements [begin, end) of one variable (see the file comment). tower_data(k) returns
/// tower k's first element (of the whole variable, not of the range).
template <class S, class Out, class TowerData>
void reduce_range(const TowerData& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end, Out* mean,
                  Out* square) {
  using Acc = accumulator_t<S>;
  constexpr std::size_t B = block_elements<Acc>;
  static_assert(supported_scalar<S>, "gradavg: gradient elements must be float or double");
  alignas(64) Acc acc[B];
  alignas(64) Acc sq[B];
  const Acc divisor = static_cast<Acc>(tower_count);

  for (std::size_t block = begin; block < end; block += B) {
    const std::size_t len = std::min(B, end - block);
    const S* group[4];
    for (std::size_t first = 0; first < tower_count; first += 4) {
      const std::size_t count = std::min<std::size_t>(4, tower_count - first);
      for (std::size_t k = 0; k < count; ++k) group[k] = tower_data(first + k);
      if (square != nullptr)
        fold_towers<S, true>(group, count, first == 0, block, len, acc, sq);
      else
        fold_towers<S, false>(group, count, first == 0, block, len, acc, sq);
    }
    finish_block(acc, len, divisor, mean + block);
    if (square != nullptr) finish_block(sq, len, divisor, square + block);
  }
}

}  // namespace gradavg::detail
