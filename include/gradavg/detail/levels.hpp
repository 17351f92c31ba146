// gradavg internals: the instruction-set levels this translation unit compiles (detail/isa.hpp
// says which), each once: packet_level.hpp, storage_level.hpp, kernel_level.hpp and
// reduce_level.hpp included in the level's namespace and, on x86-64 where the unit's flags do not
// imply them, in a region that enables the level's instructions for those functions alone; then
// GRADAVG_AT_LEVEL_, the run-time switch over them. Included by kernel.hpp after the types the
// levels share.
#pragma once

#include "isa.hpp"

// Each level's definitions, in a region whose functions may use the level's instructions.
#if defined(__clang__)
#define GRADAVG_TARGET_PUSH_(features) \
  _Pragma(GRADAVG_ISA_STRINGIZE(clang attribute push(__attribute__((target(features))), apply_to = function)))
#define GRADAVG_TARGET_POP_ _Pragma("clang attribute pop")
#else
#define GRADAVG_TARGET_PUSH_(features) _Pragma("GCC push_options") _Pragma(GRADAVG_ISA_STRINGIZE(GCC target(features)))
#define GRADAVG_TARGET_POP_ _Pragma("GCC pop_options")
#endif

// GRADAVG_HAS_<LEVEL>_LEVEL_: the levels this unit compiles; GRADAVG_<LEVEL>_TARGET_: the target
// features of each level's region (where the unit's flags do not imply them already).
#define GRADAVG_AVX2_TARGET_ "avx2,f16c"
#define GRADAVG_AVX512_TARGET_ "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c"
#define GRADAVG_AVX512_BF16_TARGET_ "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,f16c"
#if GRADAVG_UNIT_LEVEL_ >= 2
#if GRADAVG_UNIT_LEVEL_ <= 2
#define GRADAVG_HAS_SSE2_LEVEL_ 1
#define GRADAVG_LEVEL_NS_ sse2
#define GRADAVG_LEVEL_SSE2_ 1
#include "packet_level.hpp"
#include "storage_level.hpp"
#include "kernel_level.hpp"
#include "reduce_level.hpp"
#undef GRADAVG_LEVEL_SSE2_
#undef GRADAVG_LEVEL_NS_
#endif
#if GRADAVG_UNIT_LEVEL_ <= 3 && GRADAVG_TOP_LEVEL_ >= 3
#define GRADAVG_HAS_AVX2_LEVEL_ 1
#define GRADAVG_LEVEL_NS_ avx2
#define GRADAVG_LEVEL_AVX2_ 1
#if GRADAVG_UNIT_LEVEL_ < 3
GRADAVG_TARGET_PUSH_(GRADAVG_AVX2_TARGET_)
#endif
#include "packet_level.hpp"
#include "storage_level.hpp"
#include "kernel_level.hpp"
#include "reduce_level.hpp"
#if GRADAVG_UNIT_LEVEL_ < 3
GRADAVG_TARGET_POP_
#endif
#undef GRADAVG_LEVEL_AVX2_
#undef GRADAVG_LEVEL_NS_
#endif
#if GRADAVG_UNIT_LEVEL_ <= 4 && GRADAVG_TOP_LEVEL_ >= 4
#define GRADAVG_HAS_AVX512_LEVEL_ 1
#define GRADAVG_LEVEL_NS_ avx512
#define GRADAVG_LEVEL_AVX512_ 1
#if GRADAVG_UNIT_LEVEL_ < 4
GRADAVG_TARGET_PUSH_(GRADAVG_AVX512_TARGET_)
#endif
#include "packet_level.hpp"
#include "storage_level.hpp"
#include "kernel_level.hpp"
#include "reduce_level.hpp"
#if GRADAVG_UNIT_LEVEL_ < 4
GRADAVG_TARGET_POP_
#endif
#undef GRADAVG_LEVEL_AVX512_
#undef GRADAVG_LEVEL_NS_
#endif
// AVX-512 with BF16: only bfloat16 outputs take other instructions (the conversion), so a unit
// that also compiles the plain AVX-512 level instantiates this one for them alone (reduce_range).
#if GRADAVG_TOP_LEVEL_ >= 5
#define GRADAVG_HAS_AVX512_BF16_LEVEL_ 1
#define GRADAVG_LEVEL_NS_ avx512_bf16
#define GRADAVG_LEVEL_AVX512_ 1
#define GRADAVG_LEVEL_BF16_ 1
#if GRADAVG_UNIT_LEVEL_ < 5
GRADAVG_TARGET_PUSH_(GRADAVG_AVX512_BF16_TARGET_)
#endif
#include "packet_level.hpp"
#include "storage_level.hpp"
#include "kernel_level.hpp"
#include "reduce_level.hpp"
#if GRADAVG_UNIT_LEVEL_ < 5
GRADAVG_TARGET_POP_
#endif
#undef GRADAVG_LEVEL_AVX512_
#undef GRADAVG_LEVEL_BF16_
#undef GRADAVG_LEVEL_NS_
#endif
#else
#define GRADAVG_HAS_GENERIC_LEVEL_ 1
#define GRADAVG_LEVEL_NS_ generic
#define GRADAVG_LEVEL_GENERIC_ 1
#include "packet_level.hpp"
#include "storage_level.hpp"
#include "kernel_level.hpp"
#include "reduce_level.hpp"
#undef GRADAVG_LEVEL_GENERIC_
#undef GRADAVG_LEVEL_NS_
#endif

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// The level this unit's own flags imply (the lowest it compiles), whose functions code compiled
/// with those flags can call and inline directly (tests of the packet operations).
#if GRADAVG_UNIT_LEVEL_ <= 1
namespace unit_level = generic;
#elif GRADAVG_UNIT_LEVEL_ == 2
namespace unit_level = sse2;
#elif GRADAVG_UNIT_LEVEL_ == 3
namespace unit_level = avx2;
#elif GRADAVG_UNIT_LEVEL_ == 4
namespace unit_level = avx512;
#else
namespace unit_level = avx512_bf16;
#endif

// GRADAVG_AT_LEVEL_(bf16, call): returns `call`, a call of a function of a level's namespace, at
// the level simd_level_in_use() names (a switch over the levels this unit compiles); at
// avx512_bf16, the plain AVX-512 level's unless bf16 (bfloat16 outputs) or the unit has none.
#if GRADAVG_UNIT_LEVEL_ >= 2
#if GRADAVG_UNIT_LEVEL_ <= 2
#define GRADAVG_CASE_SSE2_(...) case simd_level::sse2: return sse2::__VA_ARGS__;
#else
#define GRADAVG_CASE_SSE2_(...)
#endif
#if GRADAVG_UNIT_LEVEL_ <= 3 && GRADAVG_TOP_LEVEL_ >= 3
#define GRADAVG_CASE_AVX2_(...) case simd_level::avx2: return avx2::__VA_ARGS__;
#else
#define GRADAVG_CASE_AVX2_(...)
#endif
#if GRADAVG_UNIT_LEVEL_ <= 4 && GRADAVG_TOP_LEVEL_ >= 4
#define GRADAVG_CASE_AVX512_(...) case simd_level::avx512: return avx512::__VA_ARGS__;
#else
#define GRADAVG_CASE_AVX512_(...)
#endif
#if GRADAVG_UNIT_LEVEL_ <= 4 && GRADAVG_TOP_LEVEL_ >= 5
#define GRADAVG_CASE_AVX512_BF16_(bf16, ...) \
  case simd_level::avx512_bf16:              \
    if constexpr (bf16) return avx512_bf16::__VA_ARGS__; else return avx512::__VA_ARGS__;
#elif GRADAVG_TOP_LEVEL_ >= 5
#define GRADAVG_CASE_AVX512_BF16_(bf16, ...) case simd_level::avx512_bf16: return avx512_bf16::__VA_ARGS__;
#else
#define GRADAVG_CASE_AVX512_BF16_(bf16, ...)
#endif
#define GRADAVG_AT_LEVEL_(bf16, ...)                \
  switch (simd_level_in_use()) {                     \
    GRADAVG_CASE_SSE2_(__VA_ARGS__)                  \
    GRADAVG_CASE_AVX2_(__VA_ARGS__)                  \
    GRADAVG_CASE_AVX512_(__VA_ARGS__)                \
    GRADAVG_CASE_AVX512_BF16_(bf16, __VA_ARGS__)     \
    default: break;                                  \
  }                                                  \
  __builtin_unreachable()
#else
#define GRADAVG_AT_LEVEL_(bf16, ...) return generic::__VA_ARGS__
#endif

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
