// gradavg internals: the wire formats of a call across processes (gradavg::compression) — a
// bucket's values in blocks of block_values, each encoded on its own, so that a slice owner
// decodes exactly the blocks it owns. A bucket's parts (the sums, the squares' sums, the
// non-finite flags) each begin a block: a block never mixes magnitudes of two parts (a float16
// block's scale would flush the flags of a block of large sums).
//
// The encoders are loops over whole blocks of a fixed count that the compiler vectorises; they
// use integer operations and multiplications by powers of two only, so every instruction-set level
// gives the same bits (ranks on different CPUs stay bitwise equal).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../isa.hpp"
#include "../../options.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// Values per block of every lossy format.
inline constexpr std::size_t block_values = 256;

/// A bucket's parts as the exchange sees them: lengths in buffer elements, in buffer order (sums,
/// squares' sums, flags; 0 for a part the call has not).
struct bucket_parts {
  std::size_t length[3] = {};

  [[nodiscard]] std::size_t len() const noexcept { return length[0] + length[1] + length[2]; }
  /// Blocks of the encoded bucket: each part rounded up to whole blocks.
  [[nodiscard]] std::size_t blocks() const noexcept {
    std::size_t b = 0;
    for (std::size_t n : length) b += (n + block_values - 1) / block_values;
    return b;
  }
  /// Block b's first buffer element and its count of values (the rest of the block is padding).
  struct block_place {
    std::size_t at, count;
  };
  [[nodiscard]] block_place place(std::size_t b) const noexcept {
    std::size_t at = 0;
    for (std::size_t n : length) {
      const std::size_t part_blocks = (n + block_values - 1) / block_values;
      if (b < part_blocks) return {at + b * block_values, std::min(block_values, n - b * block_values)};
      b -= part_blocks;
      at += n;
    }
    return {at, 0};
  }
  /// Blocks of any bucket of at most max_len elements (each part may add one partial block).
  [[nodiscard]] static std::size_t max_blocks(std::size_t max_len) noexcept {
    return (max_len + block_values - 1) / block_values + 3;
  }
};

/// bfloat16 bits of x, rounded to nearest even; NaN -> 0x7fc0 (quiet, positive).
inline std::uint16_t bfloat16_bits(float x) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(x != x ? 0x7fc0u : rounded);
}
inline float from_bfloat16_bits(std::uint16_t h) noexcept { return std::bit_cast<float>(std::uint32_t{h} << 16); }

/// IEEE half bits of x, rounded to nearest even: overflow -> infinity, NaN -> 0x7e00 with x's sign,
/// subnormal halves rounded to nearest even too (branch-free: one integer path per case, selected).
inline std::uint16_t half_bits(float x) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = bits & 0x80000000u;
  const std::uint32_t f = bits ^ sign;
  // Below the smallest normal half (2^-14): the float addition of 0.5 rounds the mantissa into place.
  const std::uint32_t denorm_magic = ((127 - 15) + (23 - 10) + 1) << 23;
  const bool small = f < (113u << 23);
  const std::uint32_t small_value =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(small ? f : 0u) + std::bit_cast<float>(denorm_magic)) -
      denorm_magic;
  const std::uint32_t odd = (f >> 13) & 1u;
  const std::uint32_t normal_value = (f + 0xc8000fffu + odd) >> 13;  // rebias (-112 << 23) and round
  const bool big = f >= ((127 + 16) << 23);
  const std::uint32_t big_value = f > (255u << 23) ? 0x7e00u : 0x7c00u;
  const std::uint32_t o = big ? big_value : small ? small_value : normal_value;
  return static_cast<std::uint16_t>(o | (sign >> 16));
}

/// The float value of half bits h (exact).
inline float from_half_bits(std::uint16_t h) noexcept {
  const std::uint32_t magnitude = h & 0x7fffu;
  const std::uint32_t sign = std::uint32_t{static_cast<std::uint32_t>(h) & 0x8000u} << 16;
  const std::uint32_t exponent = magnitude & 0x7c00u;
  std::uint32_t o = (magnitude << 13) + ((127 - 15) << 23);
  if (exponent == 0x7c00u) o += (128 - 16) << 23;  // infinity, NaN
  const float subnormal = std::bit_cast<float>(o + (1u << 23)) - std::bit_cast<float>(113u << 23);
  const std::uint32_t value = exponent == 0 ? std::bit_cast<std::uint32_t>(subnormal) : o;
  return std::bit_cast<float>(value | sign);
}

/// The exponent k of a float16 block whose largest finite magnitude is m: m * 2^k in [2^14, 2^15);
/// 0 for a block without a nonzero finite value; at most 127 (2^k a float).
inline int float16_block_exponent(float m) noexcept {
  if (!(m > 0.0f) || !std::isfinite(m)) return 0;
  int e = 0;
  (void)std::frexp(m, &e);  // m in [2^(e-1), 2^e)
  return std::min(15 - e, 127);
}

/// A wire format: how a bucket's blocks are encoded and decoded. Buf: the fusion buffer's element
/// type (float or double; double is rounded to float before it is encoded).
template <class Buf>
struct codec {
  compression format = compression::none;

  [[nodiscard]] bool encodes() const noexcept { return format != compression::none; }
  /// Bytes of one encoded block.
  [[nodiscard]] std::size_t block_bytes() const noexcept {
    return block_values * 2 + (format == compression::float16 ? sizeof(std::int32_t) : 0);
  }

  /// Encodes block `place` of buffer into `to` (block_bytes()), the padding as zeros.
  void encode(const Buf* buffer, bucket_parts::block_place place, std::byte* to) const noexcept {
    float x[block_values];
    for (std::size_t j = 0; j < block_values; ++j) x[j] = 0.0f;
    for (std::size_t j = 0; j < place.count; ++j) x[j] = static_cast<float>(buffer[place.at + j]);
    std::uint16_t h[block_values];
    if (format == compression::bfloat16) {
      for (std::size_t j = 0; j < block_values; ++j) h[j] = bfloat16_bits(x[j]);
    } else {
      float m = 0.0f;
      for (std::size_t j = 0; j < block_values; ++j) m = std::max(m, std::isfinite(x[j]) ? std::fabs(x[j]) : 0.0f);
      const std::int32_t k = float16_block_exponent(m);
      const float scale = std::ldexp(1.0f, k);
      for (std::size_t j = 0; j < block_values; ++j) h[j] = half_bits(x[j] * scale);
      std::memcpy(to, &k, sizeof k);
      to += sizeof k;
    }
    std::memcpy(to, h, sizeof h);
  }

  /// The block_values values of the encoded block at `from`, as floats.
  void decode(const std::byte* from, float (&x)[block_values]) const noexcept {
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
    float x[block_values];
    decode(from, x);
    for (std::size_t j = 0; j < place.count; ++j) buffer[place.at + j] = static_cast<Buf>(x[j]);
  }
};

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
