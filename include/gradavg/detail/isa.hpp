// gradavg internals: one definition per instruction-set level.
//
// A header-only library compiles into every translation unit that includes it, with that unit's
// flags. If two units built for different SIMD levels (say -march=x86-64 and -march=x86-64-v4)
// defined the same gradavg function, the linker would keep one of the two bodies for both, and
// the unit built for the older machine could run AVX-512 code (or round differently). So every
// gradavg function and every type whose code depends on the level lives in an inline namespace
// named after the packet width and multiply-add fusion that Eigen uses here, e.g.
// gradavg::packet512_fma. Callers still write gradavg::average_gradients; the mangled names
// differ per level, so units of different levels link into one program safely.
//
// Outside it, shared by all levels of one program: the exceptions (errors.hpp: a catch clause in
// one unit must catch what another throws), the vocabulary types (tensor.hpp, entry.hpp's
// traits, options, results, gradavg::mpi's options and workspace, gradavg::libtorch's options and
// report), and the executor interface with thread_pool (executor.hpp: a pool made in one unit
// serves calls from any other). They hold no element arithmetic.
#pragma once

#include <Eigen/Core>

#define GRADAVG_ISA_CAT_(a, b) a##b
#define GRADAVG_ISA_CAT(a, b) GRADAVG_ISA_CAT_(a, b)

// Packet width in bits of the float packets Eigen uses in this translation unit.
#if !defined(EIGEN_VECTORIZE) || defined(EIGEN_DONT_VECTORIZE)
#define GRADAVG_ISA_WIDTH_ scalar
#elif defined(EIGEN_VECTORIZE_AVX512)
#define GRADAVG_ISA_WIDTH_ packet512
#elif defined(EIGEN_VECTORIZE_AVX) && defined(__AVX2__) && defined(__F16C__)
#define GRADAVG_ISA_WIDTH_ packet256
#elif defined(EIGEN_VECTORIZE_AVX)
// AVX without AVX2 or F16C (Sandy Bridge, some builds): the 16-bit conversions take the portable path.
#define GRADAVG_ISA_WIDTH_ packet256_avx1
#elif defined(EIGEN_VECTORIZE_SVE) && defined(EIGEN_ARM64_SVE_VL)
#define GRADAVG_ISA_WIDTH_ GRADAVG_ISA_CAT(packet_sve, EIGEN_ARM64_SVE_VL)
#else
#define GRADAVG_ISA_WIDTH_ packet128
#endif

// Whether the target has fused multiply-add instructions (Eigen's own code and the compiler's
// contractions in the caller's code may use them; gradavg's kernel never fuses).
#if defined(EIGEN_VECTORIZE_FMA) || defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define GRADAVG_ISA_NAMESPACE GRADAVG_ISA_CAT(GRADAVG_ISA_WIDTH_, _fma)
#else
#define GRADAVG_ISA_NAMESPACE GRADAVG_ISA_WIDTH_
#endif

// The kernel's levels in this translation unit (simd.hpp), as simd_level values: every x86-64
// level from the one its flags imply up (run-time dispatch, GCC and Clang), else the one level of
// its flags. GRADAVG_NO_DISPATCH: the flags' level alone on x86-64 too.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(GRADAVG_NO_DISPATCH)
#define GRADAVG_DISPATCH_ 1
#endif
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512BF16__)
#define GRADAVG_UNIT_LEVEL_ 5
#elif defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define GRADAVG_UNIT_LEVEL_ 4
#elif defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__)
#define GRADAVG_UNIT_LEVEL_ 3
#elif defined(__x86_64__)
#define GRADAVG_UNIT_LEVEL_ 2
#elif defined(EIGEN_VECTORIZE_NEON) && !defined(EIGEN_DONT_VECTORIZE)
#define GRADAVG_UNIT_LEVEL_ 1
#else
#define GRADAVG_UNIT_LEVEL_ 0
#endif
#if defined(GRADAVG_DISPATCH_)
#define GRADAVG_TOP_LEVEL_ 5
#else
#define GRADAVG_TOP_LEVEL_ GRADAVG_UNIT_LEVEL_
#endif

/// Opens and closes the level's namespace inside namespace gradavg.
#define GRADAVG_BEGIN_ISA_NAMESPACE inline namespace GRADAVG_ISA_NAMESPACE {
#define GRADAVG_END_ISA_NAMESPACE }

#define GRADAVG_ISA_STRINGIZE_(x) #x
#define GRADAVG_ISA_STRINGIZE(x) GRADAVG_ISA_STRINGIZE_(x)

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE

/// The name of the instruction-set namespace this translation unit uses, e.g. "packet256_fma".
inline constexpr const char* isa_namespace = GRADAVG_ISA_STRINGIZE(GRADAVG_ISA_NAMESPACE);

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
