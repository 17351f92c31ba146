// The conversions between the accumulator and the storage types (detail/packet_level.hpp), at
// the level this unit's flags imply (detail::unit_level; the instruction-set matrix builds it per
// level), on every path it takes (intrinsics where the ISA level has them, Eigen's scalar conversions
// elsewhere), against Eigen's scalar conversions: round to nearest even, exact widening.
#include <gradavg/gradavg.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"

namespace {

using gradavg::detail::unit_level::packet_ops;
using gradavg::detail::unit_level::storage_ops;

constexpr std::size_t width = packet_ops<float>::width;

std::uint16_t bits_of(Eigen::half h) { return Eigen::numext::bit_cast<std::uint16_t>(h); }
std::uint16_t bits_of(Eigen::bfloat16 b) { return Eigen::numext::bit_cast<std::uint16_t>(b); }

/// Floats to check: special values, the halfway cases of both 16-bit formats, random bit patterns.
std::vector<float> sample_floats() {
  std::vector<float> v = {0.f, -0.f, 1.f, -2.5f, 65504.f, 65519.f, 65520.f, 1e-8f, 6e-8f, 5.9604645e-8f,
                          2.9802322e-8f, 3e38f, 3.4028235e38f, std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                          1.00390625f,   // halfway between two bfloat16 values, even below
                          1.01171875f,   // halfway, even above
                          1.00048828125f,  // halfway between two halves, even below
                          1.00146484375f};  // halfway, even above
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) v.push_back(std::bit_cast<float>(bits(rng)));
  while (v.size() % width != 0) v.push_back(1.f);
  return v;
}

template <class S>
void check_narrowing(const std::vector<float>& values) {
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < values.size(); i += width) {
    alignas(64) S out[width];
    storage_ops<S, float>::store(out, packet_ops<float>::load(values.data() + i));
    for (std::size_t l = 0; l < width; ++l) {
      const float f = values[i + l];
      const S expected(f);
      const bool ok = f != f ? Eigen::numext::isnan(out[l]) : bits_of(out[l]) == bits_of(expected);
      if (!ok && mismatches++ < 5) {
        INFO("float " << f << " (bits " << std::bit_cast<std::uint32_t>(f) << "): got " << bits_of(out[l])
                      << ", nearest even is " << bits_of(expected));
        CHECK(ok);
      }
    }
  }
  CHECK(mismatches == 0);
}

template <class S>
void check_widening() {
  // Every 16-bit pattern, widened exactly.
  std::vector<S> all(65536);
  for (std::uint32_t b = 0; b < 65536; ++b)
    all[b] = Eigen::numext::bit_cast<S>(static_cast<std::uint16_t>(b));
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < all.size(); i += width) {
    alignas(64) float out[width];
    packet_ops<float>::store(out, storage_ops<S, float>::load(all.data() + i));
    for (std::size_t l = 0; l < width; ++l) {
      const float expected = static_cast<float>(all[i + l]);
      const bool ok = expected != expected ? out[l] != out[l]
                                           : std::bit_cast<std::uint32_t>(out[l]) == std::bit_cast<std::uint32_t>(expected);
      mismatches += ok ? 0 : 1;
    }
  }
  CHECK(mismatches == 0);
}

/// A step's stores (store_step, or stream_step when streaming) of U packets at `offset` elements
/// past a 64-byte boundary: the same bits as narrowing each element alone, in element order, and
/// nothing written outside the step.
template <class S, std::size_t U>
void check_step_stores(const std::vector<float>& values, std::size_t offset, bool streaming) {
  constexpr std::size_t n = U * width;
  constexpr std::uint16_t guard = 0x5a5a;
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i + n <= values.size(); i += n) {
    typename packet_ops<float>::type v[U];
    for (std::size_t u = 0; u < U; ++u) v[u] = packet_ops<float>::load(values.data() + i + u * width);
    alignas(64) S buffer[n + 64];
    for (S& x : buffer) x = Eigen::numext::bit_cast<S>(guard);
    S* p = buffer + offset;
    if (streaming) {
      storage_ops<S, float>::stream_step(p, v);
      gradavg::detail::streaming_fence();
    } else {
      storage_ops<S, float>::store_step(p, v);
    }
    for (std::size_t l = 0; l < std::size(buffer); ++l) {
      const bool inside = l >= offset && l < offset + n;
      bool ok;
      if (inside) {
        const float f = values[i + l - offset];
        ok = f != f ? Eigen::numext::isnan(buffer[l]) : bits_of(buffer[l]) == bits_of(S(f));
      } else {
        ok = bits_of(buffer[l]) == guard;
      }
      if (!ok && mismatches++ < 5) {
        INFO("step element " << static_cast<std::ptrdiff_t>(l) - static_cast<std::ptrdiff_t>(offset) << " of " << n
                             << ", offset " << offset << (streaming ? ", streaming" : ""));
        CHECK(ok);
      }
    }
  }
  CHECK(mismatches == 0);
}

template <class S>
void check_step_stores_everywhere(const std::vector<float>& values) {
  // Offsets of 0 to 33 elements: aligned to 64, 32 and 16 bytes, and to the element only.
  for (std::size_t offset = 0; offset <= 33; ++offset) {
    for (bool streaming : {false, true}) {
      check_step_stores<S, 1>(values, offset, streaming);
      check_step_stores<S, 2>(values, offset, streaming);
      check_step_stores<S, 4>(values, offset, streaming);
    }
  }
}

}  // namespace

TEST_CASE("a step's 16-bit stores, ordinary or streaming, round each element alike at any alignment") {
  INFO("SIMD level " << gradavg::isa_namespace);
  auto values = sample_floats();
  values.resize(4096 + 1024);  // the special values and enough random patterns; a multiple of 4 packets
  SECTION("half") { check_step_stores_everywhere<Eigen::half>(values); }
  SECTION("bfloat16") { check_step_stores_everywhere<Eigen::bfloat16>(values); }
}

TEST_CASE("float to 16-bit rounds to nearest even on this build's path, NaN stays NaN") {
  INFO("SIMD level " << gradavg::isa_namespace);
  const auto values = sample_floats();
  SECTION("half") { check_narrowing<Eigen::half>(values); }
  SECTION("bfloat16") { check_narrowing<Eigen::bfloat16>(values); }
}

TEST_CASE("16-bit to float widens every bit pattern exactly") {
  INFO("SIMD level " << gradavg::isa_namespace);
  SECTION("half") { check_widening<Eigen::half>(); }
  SECTION("bfloat16") { check_widening<Eigen::bfloat16>(); }
}

TEST_CASE("float to double and back: exact widening, narrowing to nearest even") {
  using wide = storage_ops<float, double>;
  constexpr std::size_t n = packet_ops<double>::width;
  const auto values = sample_floats();
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i + n <= values.size(); i += n) {
    alignas(64) double widened[n];
    packet_ops<double>::store(widened, wide::load(values.data() + i));
    for (std::size_t l = 0; l < n; ++l) {
      const float f = values[i + l];
      mismatches += (f != f ? widened[l] == widened[l] : widened[l] != static_cast<double>(f)) ? 1 : 0;
    }
    // Narrow values between floats: each double rounds to the nearest float, ties to even.
    alignas(64) double between[n];
    for (std::size_t l = 0; l < n; ++l) between[l] = widened[l] * (1.0 + std::ldexp(1.0, -30));
    alignas(64) float narrowed[n];
    wide::store(narrowed, packet_ops<double>::load(between));
    for (std::size_t l = 0; l < n; ++l) {
      const float expected = static_cast<float>(between[l]);
      mismatches += (expected != expected ? narrowed[l] == narrowed[l]
                                          : std::bit_cast<std::uint32_t>(narrowed[l]) != std::bit_cast<std::uint32_t>(expected))
                        ? 1
                        : 0;
    }
  }
  CHECK(mismatches == 0);
}
