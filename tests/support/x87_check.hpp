// Test helper: the calling thread's x87 state after a call into gradavg. On x86, long double
// arithmetic runs on the x87 register stack, which the MMX registers alias: code that ran an MMX
// instruction without emms leaves the stack full, and the caller's next x87 load gives NaN.
#pragma once

#include <limits>
#include <string>

#include "catch.hpp"

namespace gradavg_test {

inline constexpr long double x87_epsilon = std::numeric_limits<long double>::epsilon();

/// (1 + eps) - 1 in long double from operands the compiler cannot fold: exactly eps, or NaN when
/// the x87 register stack was left full. Not inlined, so the ABI's empty x87 stack holds on entry.
[[gnu::noinline]] inline long double x87_arithmetic() {
  volatile long double one = 1;
  volatile long double eps = x87_epsilon;
  return (one + eps) - one;
}

#if defined(__x86_64__) || defined(__i386__)
/// The x87 tag word: 0xFFFF when every register is empty, as the ABI requires between calls; an
/// MMX instruction marks all eight in use until emms. (fnstenv masks every exception: fldenv puts
/// the control word back.)
[[gnu::noinline]] inline unsigned x87_tag_word() {
  unsigned char env[28] = {};
  __asm__ volatile("fnstenv %0\n\tfldenv %0" : "+m"(env));
  return static_cast<unsigned>(env[8]) | static_cast<unsigned>(env[9]) << 8;
}

/// Empties the register stack and clears the exception flags, so that a failure is reported
/// after the call that caused it only.
inline void reset_x87() { __asm__ volatile("emms\n\tfnclex"); }
#else
inline unsigned x87_tag_word() { return 0xFFFF; }  // long double is not x87 here: nothing to read
inline void reset_x87() {}
#endif

/// Whether the calling thread's x87 state is as the ABI requires after a call (resets it if not).
/// For threads other than Catch2's.
inline bool x87_intact() {
  const unsigned tags = x87_tag_word();
  const long double r = x87_arithmetic();
  const bool ok = tags == 0xFFFF && r == x87_epsilon;
  if (!ok) reset_x87();
  return ok;
}

/// Checks x87 arithmetic on the calling thread right after `call` returned or threw.
inline void check_x87_after(const std::string& call) {
  INFO("x87 arithmetic after " << call);
  const unsigned tags = x87_tag_word();
  CHECK(tags == 0xFFFFu);  // every x87 register empty
  const long double r = x87_arithmetic();
  CHECK(r == x87_epsilon);  // NaN when the stack was left full
  if (tags != 0xFFFF || !(r == x87_epsilon)) reset_x87();
}

}  // namespace gradavg_test
