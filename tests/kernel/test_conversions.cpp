// The conversions between the accumulator and the storage types (detail/storage_level.hpp), at
// every level this unit compiles that the CPU runs (built without instruction-set flags on
// x86-64: SSE2, AVX2, AVX-512 and AVX-512 BF16; NEON or the scalar path elsewhere), each level's
// functions called directly, on every path they take (intrinsics where the level has them,
// Eigen's scalar conversions elsewhere), against Eigen's scalar conversions: round to nearest
// even, exact widening.
#include <gradavg/gradavg.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"

namespace {

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
  while (v.size() % 16 != 0) v.push_back(1.f);  // whole packets at every level
  return v;
}

}  // namespace

// Each level's checks, compiled as the kernel's level is (detail/kernel.hpp).
namespace {
#if defined(GRADAVG_HAS_SSE2_LEVEL_)
#define GRADAVG_TEST_LEVEL_NS_ sse2
#include "conversion_checks.inc"
#undef GRADAVG_TEST_LEVEL_NS_
#endif
#if defined(GRADAVG_HAS_AVX2_LEVEL_)
#define GRADAVG_TEST_LEVEL_NS_ avx2
#if GRADAVG_UNIT_LEVEL_ < 3
GRADAVG_TARGET_PUSH_(GRADAVG_AVX2_TARGET_)
#endif
#include "conversion_checks.inc"
#if GRADAVG_UNIT_LEVEL_ < 3
GRADAVG_TARGET_POP_
#endif
#undef GRADAVG_TEST_LEVEL_NS_
#endif
#if defined(GRADAVG_HAS_AVX512_LEVEL_)
#define GRADAVG_TEST_LEVEL_NS_ avx512
#if GRADAVG_UNIT_LEVEL_ < 4
GRADAVG_TARGET_PUSH_(GRADAVG_AVX512_TARGET_)
#endif
#include "conversion_checks.inc"
#if GRADAVG_UNIT_LEVEL_ < 4
GRADAVG_TARGET_POP_
#endif
#undef GRADAVG_TEST_LEVEL_NS_
#endif
#if defined(GRADAVG_HAS_AVX512_BF16_LEVEL_)
#define GRADAVG_TEST_LEVEL_NS_ avx512_bf16
#if GRADAVG_UNIT_LEVEL_ < 5
GRADAVG_TARGET_PUSH_(GRADAVG_AVX512_BF16_TARGET_)
#endif
#include "conversion_checks.inc"
#if GRADAVG_UNIT_LEVEL_ < 5
GRADAVG_TARGET_POP_
#endif
#undef GRADAVG_TEST_LEVEL_NS_
#endif
#if defined(GRADAVG_HAS_GENERIC_LEVEL_)
#define GRADAVG_TEST_LEVEL_NS_ generic
#include "conversion_checks.inc"
#undef GRADAVG_TEST_LEVEL_NS_
#endif

/// One level's checks.
struct level_checks {
  gradavg::simd_level level;
  void (*step_stores)(const std::vector<float>&, bool bfloat16);
  void (*narrowing)(const std::vector<float>&, bool bfloat16);
  void (*widening)(bool bfloat16);
  void (*float_double)(const std::vector<float>&);
};

/// The levels this unit compiles that this CPU runs (at least one: the unit's own).
std::vector<level_checks> runnable_levels() {
  using gradavg::simd_level;
  std::vector<level_checks> all;
#define GRADAVG_TEST_LEVEL_ENTRY_(ns, level) \
  all.push_back({level, ns::step_stores, ns::narrowing, ns::widening, ns::float_double})
#if defined(GRADAVG_HAS_SSE2_LEVEL_)
  GRADAVG_TEST_LEVEL_ENTRY_(sse2, simd_level::sse2);
#endif
#if defined(GRADAVG_HAS_AVX2_LEVEL_)
  GRADAVG_TEST_LEVEL_ENTRY_(avx2, simd_level::avx2);
#endif
#if defined(GRADAVG_HAS_AVX512_LEVEL_)
  GRADAVG_TEST_LEVEL_ENTRY_(avx512, simd_level::avx512);
#endif
#if defined(GRADAVG_HAS_AVX512_BF16_LEVEL_)
  GRADAVG_TEST_LEVEL_ENTRY_(avx512_bf16, simd_level::avx512_bf16);
#endif
#if defined(GRADAVG_HAS_GENERIC_LEVEL_)
  GRADAVG_TEST_LEVEL_ENTRY_(generic, static_cast<simd_level>(GRADAVG_UNIT_LEVEL_));
#endif
#undef GRADAVG_TEST_LEVEL_ENTRY_
  // The unit's own level runs wherever the unit does (off x86-64, cpu_simd_level() is scalar).
  std::vector<level_checks> runnable;
  for (const auto& checks : all)
    if (checks.level <= gradavg::cpu_simd_level() || checks.level == static_cast<simd_level>(GRADAVG_UNIT_LEVEL_))
      runnable.push_back(checks);
  REQUIRE(!runnable.empty());
  return runnable;
}

}  // namespace

TEST_CASE("a step's 16-bit stores, ordinary or streaming, round each element alike at any alignment") {
  auto values = sample_floats();
  values.resize(4096 + 1024);  // the special values and enough random patterns; a multiple of 4 packets
  for (const auto& checks : runnable_levels()) {
    INFO("SIMD level " << gradavg::to_string(checks.level));
    SECTION("half " + std::string(gradavg::to_string(checks.level))) { checks.step_stores(values, false); }
    SECTION("bfloat16 " + std::string(gradavg::to_string(checks.level))) { checks.step_stores(values, true); }
  }
}

TEST_CASE("float to 16-bit rounds to nearest even on every level's path, NaN stays NaN") {
  const auto values = sample_floats();
  for (const auto& checks : runnable_levels()) {
    INFO("SIMD level " << gradavg::to_string(checks.level));
    SECTION("half " + std::string(gradavg::to_string(checks.level))) { checks.narrowing(values, false); }
    SECTION("bfloat16 " + std::string(gradavg::to_string(checks.level))) { checks.narrowing(values, true); }
  }
}

TEST_CASE("16-bit to float widens every bit pattern exactly") {
  for (const auto& checks : runnable_levels()) {
    INFO("SIMD level " << gradavg::to_string(checks.level));
    SECTION("half " + std::string(gradavg::to_string(checks.level))) { checks.widening(false); }
    SECTION("bfloat16 " + std::string(gradavg::to_string(checks.level))) { checks.widening(true); }
  }
}

TEST_CASE("float to double and back: exact widening, narrowing to nearest even") {
  const auto values = sample_floats();
  for (const auto& checks : runnable_levels()) {
    INFO("SIMD level " << gradavg::to_string(checks.level));
    checks.float_double(values);
  }
}
