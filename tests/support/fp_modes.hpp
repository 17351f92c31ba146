// Test helpers: floating-point modes of the calling thread, set for a scope and restored after.
#pragma once

#include <cfenv>
#include <cstdint>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace gradavg_test {

/// Flush denormal results to zero and read denormal inputs as zero on this thread: MXCSR's FTZ
/// and DAZ on x86, FPCR's FZ on AArch64 (which does both). supported is false elsewhere.
class flush_denormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  static constexpr bool supported = true;
  flush_denormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ (bit 15), DAZ (bit 6)
  ~flush_denormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  static constexpr bool supported = true;
  flush_denormals() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const std::uint64_t fz = saved_ | (std::uint64_t{1} << 24);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fz));
  }
  ~flush_denormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }

 private:
  std::uint64_t saved_;
#else
  static constexpr bool supported = false;
#endif

 public:
  flush_denormals(const flush_denormals&) = delete;
  flush_denormals& operator=(const flush_denormals&) = delete;
};

/// Rounds toward +infinity on this thread for the scope.
class round_upward {
 public:
  round_upward() : saved_(std::fegetround()) { std::fesetround(FE_UPWARD); }
  ~round_upward() { std::fesetround(saved_); }
  round_upward(const round_upward&) = delete;
  round_upward& operator=(const round_upward&) = delete;

 private:
  int saved_;
};

}  // namespace gradavg_test
