// Test helpers for the kernel's run-time levels (simd.hpp): the x86-64 levels this CPU runs, and
// a guard that restores the automatic choice however a test case ends.
#pragma once

#include <gradavg/simd.hpp>

#include <vector>

namespace gradavg_test {

/// The x86-64 levels this CPU runs, the baseline (SSE2) first; empty on other targets.
inline std::vector<gradavg::simd_level> runnable_simd_levels() {
  std::vector<gradavg::simd_level> levels;
  for (auto level : {gradavg::simd_level::sse2, gradavg::simd_level::avx2, gradavg::simd_level::avx512,
                     gradavg::simd_level::avx512_bf16})
    if (level <= gradavg::cpu_simd_level()) levels.push_back(level);
  return levels;
}

/// Calls reset_simd_level when it goes out of scope, whatever the test threw.
struct simd_level_reset {
  simd_level_reset() = default;
  simd_level_reset(const simd_level_reset&) = delete;
  simd_level_reset& operator=(const simd_level_reset&) = delete;
  ~simd_level_reset() { gradavg::reset_simd_level(); }
};

}  // namespace gradavg_test
