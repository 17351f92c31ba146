// gradavg internals: the wire formats of a call across processes (gradavg::compression) — a
// bucket's values in blocks of block_values, each encoded on its own, so that a slice owner
// decodes exactly the blocks it owns. A bucket's parts (the sums, the squares' sums, the
// non-finite flags) each begin a block: a block never mixes magnitudes of two parts (a float16
// block's scale would flush the flags of a block of large sums).
//
// The encoders are loops over whole blocks of a fixed count that the compiler vectorises; they
// use integer operations and single IEEE float operations (no product feeds a sum, so no fused
// multiply-add can form), so every instruction-set level gives the same bits. Ranks stay bitwise
// equal in any case: every rank decodes the owners' encoded sums.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../isa.hpp"
#include "../../options.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// Values per block of every lossy format.
inline constexpr std::size_t block_values = 256;

/// A bucket's parts as the exchange sees them: lengths in buffer elements, in buffer order (sums,
/// squares' sums, flags; 0 for a part the call has not), and the flat index of its first element
/// (where the sums' error feedback and the blocks' rounding seeds are).
struct bucket_parts {
  std::size_t length[3] = {};
  std::size_t first = 0;

  [[nodiscard]] std::size_t len() const noexcept { return length[0] + length[1] + length[2]; }
  /// Blocks of the encoded bucket: each part rounded up to whole blocks.
  [[nodiscard]] std::size_t blocks() const noexcept {
    std::size_t b = 0;
    for (std::size_t n : length) b += (n + block_values - 1) / block_values;
    return b;
  }
  /// Block b's first buffer element, its count of values (the rest of the block is padding), its
  /// part and its first element's place in the part.
  struct block_place {
    std::size_t at, count, part, in_part;
  };
  [[nodiscard]] block_place place(std::size_t b) const noexcept {
    std::size_t at = 0;
    for (std::size_t p = 0; p < 3; ++p) {
      const std::size_t n = length[p];
      const std::size_t part_blocks = (n + block_values - 1) / block_values;
      if (b < part_blocks) return {at + b * block_values, std::min(block_values, n - b * block_values), p, b * block_values};
      b -= part_blocks;
      at += n;
    }
    return {at, 0, 3, 0};
  }
  /// Blocks of any bucket of at most max_len elements (each part may add one partial block).
  [[nodiscard]] static std::size_t max_blocks(std::size_t max_len) noexcept {
    return (max_len + block_values - 1) / block_values + 3;
  }
};

// The conversions below select with masks (0 or all ones), not branches, and compare magnitudes
// (below 2^31) as signed integers, which SSE2 has instructions for, so that their loops over a
// block vectorise at -O2 at every instruction-set level.

/// All ones where c, else 0.
constexpr std::uint32_t mask_of(bool c) noexcept { return 0u - static_cast<std::uint32_t>(c); }

/// bfloat16 bits of x, rounded to nearest even; NaN -> 0x7fc0 (quiet, positive).
inline std::uint16_t bfloat16_bits(float x) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = mask_of(static_cast<std::int32_t>(u & 0x7fffffffu) > 0x7f800000);
  return static_cast<std::uint16_t>((nan & 0x7fc0u) | (~nan & rounded));
}
inline float from_bfloat16_bits(std::uint16_t h) noexcept { return std::bit_cast<float>(std::uint32_t{h} << 16); }

/// IEEE half bits of x, rounded to nearest even: overflow -> infinity, NaN -> 0x7e00 with x's sign,
/// subnormal halves rounded to nearest even too.
inline std::uint16_t half_bits(float x) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = bits & 0x80000000u;
  const std::uint32_t f = bits ^ sign;
  const auto magnitude = static_cast<std::int32_t>(f);
  // Below the smallest normal half (2^-14): the float addition of 0.5 rounds the mantissa into place.
  const std::uint32_t denorm_magic = ((127 - 15) + (23 - 10) + 1) << 23;
  const std::uint32_t small = mask_of(magnitude < (113 << 23));
  const std::uint32_t small_value =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(f & small) + std::bit_cast<float>(denorm_magic)) - denorm_magic;
  const std::uint32_t odd = (f >> 13) & 1u;
  const std::uint32_t normal_value = (f + 0xc8000fffu + odd) >> 13;  // rebias (-112 << 23) and round
  const std::uint32_t big = mask_of(magnitude >= ((127 + 16) << 23));
  const std::uint32_t big_value = 0x7c00u | (mask_of(magnitude > (255 << 23)) & 0x0200u);
  std::uint32_t o = (small & small_value) | (~small & normal_value);
  o = (big & big_value) | (~big & o);
  return static_cast<std::uint16_t>(o | (sign >> 16));
}

/// The float value of half bits h (exact).
inline float from_half_bits(std::uint16_t h) noexcept {
  const std::uint32_t magnitude = h & 0x7fffu;
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16;
  const std::uint32_t exponent = magnitude & 0x7c00u;
  std::uint32_t o = (magnitude << 13) + ((127 - 15) << 23);
  o += mask_of(exponent == 0x7c00u) & ((128 - 16) << 23);  // infinity, NaN
  // Subnormal halves: renormalised by one exact float subtraction.
  const std::uint32_t subnormal =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(o + (1u << 23)) - std::bit_cast<float>(113u << 23));
  const std::uint32_t zero_exponent = mask_of(exponent == 0);
  return std::bit_cast<float>(((zero_exponent & subnormal) | (~zero_exponent & o)) | sign);
}

/// The exponent k of a float16 block whose largest finite magnitude is m: m * 2^k in [2^14, 2^15);
/// 0 for a block without a nonzero finite value; at most 127 (2^k a float).
inline int float16_block_exponent(float m) noexcept {
  if (!(m > 0.0f) || !std::isfinite(m)) return 0;
  int e = 0;
  (void)std::frexp(m, &e);  // m in [2^(e-1), 2^e)
  return std::min(15 - e, 127);
}

/// The largest finite magnitude of x[0, block_values) (0 when none).
inline float largest_finite(const float* x) noexcept {
  std::int32_t m = 0;  // the bits of non-negative floats order as the floats do
  for (std::size_t j = 0; j < block_values; ++j) {
    const auto a = static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(x[j]) & 0x7fffffffu);
    const std::int32_t finite = a & static_cast<std::int32_t>(mask_of(a < 0x7f800000));
    m = m > finite ? m : finite;
  }
  return std::bit_cast<float>(m);
}

/// A uniform value in [0, 1) (24 bits) from a key and an index: a 32-bit mixing hash (no state, so
/// the same key and index give the same value on every rank, thread and run).
inline float uniform_of(std::uint32_t key, std::uint32_t j) noexcept {
  std::uint32_t x = key ^ (j * 0x9e3779b9u);
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return static_cast<float>(static_cast<std::int32_t>(x >> 8)) * 0x1p-24f;
}

/// The rounding seed of one block: from the call's seed, the rank, the stage (0: a rank's
/// contribution, 1: an owner's sum), the block's part and its first element's flat index.
inline std::uint32_t block_key(std::uint64_t seed, int rank, int stage, const bucket_parts& parts,
                               const bucket_parts::block_place& place) noexcept {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (1 + ((static_cast<std::uint64_t>(rank) << 3) |
                                                         (static_cast<std::uint64_t>(stage) << 2) | place.part));
  z ^= (parts.first + place.in_part) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<std::uint32_t>((z ^ (z >> 31)) >> 32);
}

/// int8 of t, its magnitude clamped to 127 and rounded stochastically: up with probability of its
/// fraction (u uniform in [0, 1)), so that the rounding is unbiased. t finite.
inline std::int8_t stochastic_int8(float t, float u) noexcept {
  const float a = std::fabs(t);
  const auto whole = static_cast<std::int32_t>(a);  // truncation: the floor of a >= 0
  const float fraction = a - static_cast<float>(whole);  // exact
  std::int32_t magnitude = whole - static_cast<std::int32_t>(mask_of(fraction > u));
  magnitude += static_cast<std::int32_t>(mask_of(magnitude > 127));  // 128 (t a rounding above 127): 127
  const auto negative = static_cast<std::int32_t>(mask_of(t < 0.0f));
  return static_cast<std::int8_t>((magnitude ^ negative) - negative);
}

/// A wire format: how a bucket's blocks are encoded and decoded. Buf: the fusion buffer's element
/// type (float or double; double is rounded to float before it is encoded).
template <class Buf>
struct codec {
  compression format = compression::none;

  [[nodiscard]] bool encodes() const noexcept { return format != compression::none; }
  /// Bytes of one encoded block.
  [[nodiscard]] std::size_t block_bytes() const noexcept {
    switch (format) {
      case compression::float16: return sizeof(std::int32_t) + block_values * 2;
      case compression::int8: return sizeof(float) + block_values;
      default: return block_values * 2;
    }
  }

  /// Encodes block `place` of buffer into `to` (block_bytes()), the padding as zeros. key: the
  /// block's own seed for int8's stochastic rounding (unused by the other formats).
  void encode(const Buf* buffer, bucket_parts::block_place place, std::byte* to, std::uint32_t key) const noexcept {
    float padded[block_values];
    const float* x = padded;
    if constexpr (std::is_same_v<Buf, float>) {
      if (place.count == block_values) x = buffer + place.at;  // a whole block: read in place
    }
    if (x == padded) {
      for (std::size_t j = 0; j < place.count; ++j) padded[j] = static_cast<float>(buffer[place.at + j]);
      for (std::size_t j = place.count; j < block_values; ++j) padded[j] = 0.0f;
    }
    if (format == compression::int8) {
      // The scale: the largest magnitude over 127; NaN where a value is not finite (the block
      // decodes as NaN: a non-finite sum is never hidden).
      std::uint32_t nonfinite = 0;
      for (std::size_t j = 0; j < block_values; ++j)
        nonfinite |= mask_of((std::bit_cast<std::uint32_t>(x[j]) & 0x7fffffffu) >= 0x7f800000u);
      const float m = largest_finite(x);
      std::int8_t q[block_values] = {};
      float scale = std::numeric_limits<float>::quiet_NaN();
      if (nonfinite == 0) {
        scale = m / 127.0f;
        // Blocks below 2^-100 brought up by 2^100 first (exact), so that 127 / m stays finite.
        const float pre = m < 0x1p-100f ? 0x1p100f : 1.0f;
        const float inverse = m > 0.0f ? 127.0f / (m * pre) : 0.0f;
        for (std::size_t j = 0; j < block_values; ++j)
          q[j] = stochastic_int8((x[j] * pre) * inverse, uniform_of(key, static_cast<std::uint32_t>(j)));
      }
      std::memcpy(to, &scale, sizeof scale);
      std::memcpy(to + sizeof scale, q, sizeof q);
      return;
    }
    std::uint16_t h[block_values];
    if (format == compression::bfloat16) {
      for (std::size_t j = 0; j < block_values; ++j) h[j] = bfloat16_bits(x[j]);
    } else {
      const std::int32_t k = float16_block_exponent(largest_finite(x));
      const float scale = std::ldexp(1.0f, k);
      for (std::size_t j = 0; j < block_values; ++j) h[j] = half_bits(x[j] * scale);
      std::memcpy(to, &k, sizeof k);
      to += sizeof k;
    }
    std::memcpy(to, h, sizeof h);
  }

  /// The block_values values of the encoded block at `from`, as floats.
  void decode(const std::byte* from, float* x) const noexcept {
    if (format == compression::int8) {
      float scale = 0;
      std::int8_t q[block_values];
      std::memcpy(&scale, from, sizeof scale);
      std::memcpy(q, from + sizeof scale, sizeof q);
      for (std::size_t j = 0; j < block_values; ++j) x[j] = static_cast<float>(q[j]) * scale;
      return;
    }
    std::uint16_t h[block_values];
    if (format == compression::bfloat16) {
      std::memcpy(h, from, sizeof h);
      for (std::size_t j = 0; j < block_values; ++j) x[j] = from_bfloat16_bits(h[j]);
    } else {
      std::int32_t k = 0;
      std::memcpy(&k, from, sizeof k);
      std::memcpy(h, from + sizeof k, sizeof h);
      const float unscale = std::ldexp(1.0f, -k);
      for (std::size_t j = 0; j < block_values; ++j) x[j] = from_half_bits(h[j]) * unscale;
    }
  }

  /// Decodes the block at `from` into block `place` of buffer.
  void decode_into(const std::byte* from, bucket_parts::block_place place, Buf* buffer) const noexcept {
    if constexpr (std::is_same_v<Buf, float>) {
      if (place.count == block_values) return decode(from, buffer + place.at);  // a whole block: in place
    }
    float x[block_values];
    decode(from, x);
    for (std::size_t j = 0; j < place.count; ++j) buffer[place.at + j] = static_cast<Buf>(x[j]);
  }
};

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
