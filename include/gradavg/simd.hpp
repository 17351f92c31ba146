// gradavg: the instruction-set level the averaging kernel runs at, chosen at run time.
//
// On x86-64 (GCC and Clang) every translation unit compiles the kernel for each level at or above
// its own compile flags (SSE2, AVX2 with F16C, AVX-512 F/BW/VL/DQ, and that with AVX-512 BF16 for
// bfloat16 outputs: all with no -march, one with -march=native on an AVX-512 machine), and each
// call runs the widest one the CPU supports.
// Elsewhere (aarch64 NEON, other targets, GRADAVG_NO_DISPATCH defined) the kernel is compiled for
// the unit's flags alone. Every level computes the same bits: means, means of squares, 16-bit
// outputs and the fused statistics (kernel.hpp states the arithmetic).
//
// The level can be lowered, never raised past what the CPU runs:
//   - the environment variable GRADAVG_ISA=sse2|avx2|avx512|avx512_bf16 (read once; an
//     unknown name is ignored), for a whole process;
//   - force_simd_level(level) / reset_simd_level(), for tests and benchmarks.
// simd_level_in_use() names the level a call made now runs at, for logs and bug reports. The
// choice is gradavg's one piece of program-wide state: an atomic that force_simd_level and
// reset_simd_level set and each kernel call reads (relaxed: a call that overlaps a change runs
// at either level, with the same results).
#pragma once

#include <atomic>
#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "detail/isa.hpp"

namespace gradavg {

/// Instruction-set levels of the kernel, lowest first within an architecture.
enum class simd_level : int {
  scalar = 0,  ///< no SIMD (a target Eigen does not vectorise)
  neon = 1,    ///< aarch64 / Arm NEON (compile-time level)
  sse2 = 2,    ///< x86-64 baseline
  avx2 = 3,    ///< x86-64 with AVX2 and F16C
  avx512 = 4,  ///< x86-64 with AVX-512 F, BW, VL and DQ
  avx512_bf16 = 5,  ///< the same with AVX-512 BF16 (its bfloat16 conversion: the same bits, faster)
};

/// "scalar", "neon", "sse2", "avx2", "avx512" or "avx512_bf16".
constexpr std::string_view to_string(simd_level level) noexcept {
  switch (level) {
    case simd_level::scalar: return "scalar";
    case simd_level::neon: return "neon";
    case simd_level::sse2: return "sse2";
    case simd_level::avx2: return "avx2";
    case simd_level::avx512: return "avx512";
    case simd_level::avx512_bf16: return "avx512_bf16";
  }
  return "unknown";
}

namespace shared_detail {

/// The widest x86-64 level this CPU and its operating system support (CPUID, XGETBV), or
/// simd_level::scalar where the target is not x86-64 with GCC or Clang.
inline simd_level detect_cpu_simd_level() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return simd_level::sse2;
  const bool avx = (c >> 28) & 1u, osxsave = (c >> 27) & 1u, f16c = (c >> 29) & 1u;
  if (!avx || !osxsave || !f16c) return simd_level::sse2;
  unsigned xcr0_low = 0, xcr0_high = 0;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0u));
  if ((xcr0_low & 0x6u) != 0x6u) return simd_level::sse2;  // the OS saves XMM and YMM state
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return simd_level::sse2;
  if (((b >> 5) & 1u) == 0) return simd_level::sse2;  // AVX2
  const unsigned avx512_bits = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // F, DQ, BW, VL
  const bool os_zmm = (xcr0_low & 0xe0u) == 0xe0u;  // opmask and all of ZMM state
  if ((b & avx512_bits) != avx512_bits || !os_zmm) return simd_level::avx2;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d) == 0) return simd_level::avx512;
  return ((a >> 5) & 1u) != 0 ? simd_level::avx512_bf16 : simd_level::avx512;
#else
  return simd_level::scalar;
#endif
}

}  // namespace shared_detail

/// The widest level this CPU runs (x86-64: sse2, avx2, avx512 or avx512_bf16, detected once per
/// process; scalar on other targets, whose level is fixed at compile time).
inline simd_level cpu_simd_level() noexcept {
  static const simd_level level = shared_detail::detect_cpu_simd_level();
  return level;
}

namespace shared_detail {

/// GRADAVG_ISA as a level, or -1 where it is unset or names no level.
inline int environment_simd_level() noexcept {
  const char* value = std::getenv("GRADAVG_ISA");
  if (value == nullptr) return -1;
  for (int level = 0; level <= static_cast<int>(simd_level::avx512_bf16); ++level)
    if (to_string(static_cast<simd_level>(level)) == std::string_view(value)) return level;
  return -1;
}

/// The level GRADAVG_ISA asks for, within the CPU's: what runs unless force_simd_level says.
inline int default_simd_level() noexcept {
  static const int level = [] {
    const int cpu = static_cast<int>(gradavg::cpu_simd_level());
    const int environment = environment_simd_level();
    return environment < 0 || environment > cpu ? cpu : environment;
  }();
  return level;
}

/// The program's current choice (force_simd_level's, else default_simd_level()), or -1 before
/// the first call has read it: one relaxed load per kernel call.
inline std::atomic<int>& selected_simd_level() noexcept {
  static std::atomic<int> level{-1};
  return level;
}

/// The program's choice before each unit's own bounds (simd_level_in_use): the forced level,
/// else GRADAVG_ISA, else the CPU's widest; never above the CPU's widest.
inline int requested_simd_level() noexcept {
  int level = selected_simd_level().load(std::memory_order_relaxed);
  if (level < 0) [[unlikely]] {
    const int fallback = default_simd_level();
    // A force_simd_level made meanwhile wins.
    if (selected_simd_level().compare_exchange_strong(level, fallback, std::memory_order_relaxed)) level = fallback;
  }
  return level;
}

}  // namespace shared_detail

/// Runs every later call at `level` (program-wide, from any thread): false, and nothing changed,
/// where this CPU cannot run it or it is not an x86-64 level (sse2, avx2, avx512, avx512_bf16).
/// A translation unit compiled for a higher level than `level` (its -march) runs its lowest one.
inline bool force_simd_level(simd_level level) noexcept {
  if (level < simd_level::sse2 || level > cpu_simd_level()) return false;
  shared_detail::selected_simd_level().store(static_cast<int>(level), std::memory_order_relaxed);
  return true;
}

/// Undoes force_simd_level: GRADAVG_ISA, else the CPU's widest level.
inline void reset_simd_level() noexcept {
  shared_detail::selected_simd_level().store(shared_detail::default_simd_level(), std::memory_order_relaxed);
}

GRADAVG_BEGIN_ISA_NAMESPACE

/// The level a call from this translation unit runs at now: the program's choice (the CPU's
/// widest, GRADAVG_ISA or force_simd_level) within the levels this unit compiles.
inline simd_level simd_level_in_use() noexcept {
  const int level = shared_detail::requested_simd_level();
  if (level < GRADAVG_UNIT_LEVEL_) return static_cast<simd_level>(GRADAVG_UNIT_LEVEL_);
  if (level > GRADAVG_TOP_LEVEL_) return static_cast<simd_level>(GRADAVG_TOP_LEVEL_);
  return static_cast<simd_level>(level);
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
