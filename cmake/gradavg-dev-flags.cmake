# Compile settings for gradavg's own tests, benchmarks and examples. Never applied to the
# exported gradavg::gradavg target.
#
#   GRADAVG_WERROR    -Wall -Wextra -Wpedantic -Werror (CI turns it on)
#   GRADAVG_NATIVE    -march=native, so the SIMD kernels use the machine's widest packets
#                     (on by default, off when cross compiling)
#   GRADAVG_SANITIZE  sanitizers with -fno-sanitize-recover=all: "address,undefined", or "thread"
#
# Targets:
#   gradavg_dev_sanitize_flags  the sanitizers alone (for third-party code built here)
#   gradavg_dev_base_flags      warnings and sanitizers, no instruction-set flag
#   gradavg_dev_flags           the same plus -march=native when GRADAVG_NATIVE is on
#   gradavg_dev_kernels         the kernel (<gradavg/kernels.hpp>) compiled once with
#                               gradavg_dev_flags; linking it defines GRADAVG_EXTERN_KERNELS
# gradavg_suppress_eigen_avx512_warnings(<target>) is the one place where a warning is turned
# off; see there.
if(CMAKE_CROSSCOMPILING)
  set(_gradavg_native_default OFF)
else()
  set(_gradavg_native_default ON)
endif()
option(GRADAVG_WERROR "Treat warnings as errors in tests, bench and examples" OFF)
option(GRADAVG_NATIVE "Build tests, bench and examples with -march=native" ${_gradavg_native_default})
set(GRADAVG_SANITIZE "" CACHE STRING "Sanitizers for tests and examples: address,undefined or thread")

if(GRADAVG_SANITIZE MATCHES "thread" AND GRADAVG_SANITIZE MATCHES "address|leak|memory")
  message(FATAL_ERROR "GRADAVG_SANITIZE=${GRADAVG_SANITIZE}: thread cannot be combined with "
                      "address, leak or memory; use address,undefined or thread")
endif()

add_library(gradavg_dev_sanitize_flags INTERFACE)
if(GRADAVG_SANITIZE)
  target_compile_options(gradavg_dev_sanitize_flags INTERFACE
    -fsanitize=${GRADAVG_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer)
  target_link_options(gradavg_dev_sanitize_flags INTERFACE -fsanitize=${GRADAVG_SANITIZE})
endif()

add_library(gradavg_dev_base_flags INTERFACE)
target_compile_options(gradavg_dev_base_flags INTERFACE -Wall -Wextra -Wpedantic)
if(GRADAVG_WERROR)
  target_compile_options(gradavg_dev_base_flags INTERFACE -Werror)
endif()
target_link_libraries(gradavg_dev_base_flags INTERFACE gradavg_dev_sanitize_flags)

add_library(gradavg_dev_flags INTERFACE)
target_link_libraries(gradavg_dev_flags INTERFACE gradavg_dev_base_flags)
if(GRADAVG_NATIVE)
  target_compile_options(gradavg_dev_flags INTERFACE -march=native)
endif()

# The kernel compiled once per build tree, for the tests and examples built with
# gradavg_dev_flags: they link it instead of compiling it themselves (10 to 45 s of each unit's
# compile at -O2, the most for libtorch's run-time element types), as docs/building.md ("Compile
# time") shows users. Built only when something links it.
file(CONFIGURE OUTPUT "${PROJECT_BINARY_DIR}/gradavg_dev_kernels.cpp"
     CONTENT "// The kernel for the targets that link gradavg_dev_kernels (cmake/gradavg-dev-flags.cmake).\n#include <gradavg/kernels.hpp>\n")
add_library(gradavg_dev_kernels STATIC EXCLUDE_FROM_ALL "${PROJECT_BINARY_DIR}/gradavg_dev_kernels.cpp")
target_link_libraries(gradavg_dev_kernels PUBLIC gradavg::gradavg PRIVATE gradavg_dev_flags)
target_compile_definitions(gradavg_dev_kernels PUBLIC GRADAVG_EXTERN_KERNELS)

# What GRADAVG_NATIVE compiles for on this machine: _gradavg_native_avx512, AVX-512 with GCC (the
# only case that needs gradavg_suppress_eigen_avx512_warnings); _gradavg_native_v4, every
# x86-64-v4 feature (the tests' instruction-set matrix then skips its AVX-512 build of the Eigen
# tests: the native one is that build).
set(_gradavg_native_avx512 OFF)
set(_gradavg_native_v4 OFF)
if(GRADAVG_NATIVE)
  include(CheckCXXSourceCompiles)
  set(CMAKE_REQUIRED_FLAGS -march=native)
  set(CMAKE_REQUIRED_QUIET ON)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    check_cxx_source_compiles("#ifndef __AVX512F__\n#error no AVX-512\n#endif\nint main() { return 0; }"
                              GRADAVG_NATIVE_HAS_AVX512)
    set(_gradavg_native_avx512 ${GRADAVG_NATIVE_HAS_AVX512})
  endif()
  check_cxx_source_compiles(
    "#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512CD__) && defined(__AVX512DQ__) && defined(__AVX512VL__))\n#error not x86-64-v4\n#endif\nint main() { return 0; }"
    GRADAVG_NATIVE_HAS_X86_64_V4)
  set(_gradavg_native_v4 ${GRADAVG_NATIVE_HAS_X86_64_V4})
  unset(CMAKE_REQUIRED_FLAGS)
  unset(CMAKE_REQUIRED_QUIET)
endif()

# GCC 12 reports -Wuninitialized / -Wmaybe-uninitialized on `__Y` inside its own AVX-512
# intrinsic headers (avx512fintrin.h: _mm512_undefined_ps and friends used as a don't-care
# operand) once Eigen 3.4's AVX-512 packet code (predux, ptranspose, pmax, reached from Eigen's
# gemm and reductions) is inlined into a translation unit: GCC bug 105593, fixed in GCC 13. The
# warning is about GCC's header, and system-header status does not hide middle-end warnings
# after inlining, so it can only be turned off for the translation unit.
#
# This turns off exactly those two diagnostics, for GCC before 13, in the named sources only
# (those that instantiate Eigen's gemm or reductions), and only when they are compiled with
# -march=native on a machine with AVX-512. It cannot hide a warning in gradavg's own code: every
# gradavg header is also compiled with the full warning set and -Werror, with no suppression,
# by the tests built without -march (every level of the run-time dispatch, tests/) and by the
# Clang build; and scripts/test.sh builds the suppressed sources themselves with -Werror and no
# suppression at SSE2 (the ASan+UBSan stage) and with Clang at the machine's level (the clang
# stage).
function(gradavg_suppress_eigen_avx512_warnings)
  if(_gradavg_native_avx512 AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    set_property(SOURCE ${ARGN} DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR} APPEND
                 PROPERTY COMPILE_OPTIONS -Wno-uninitialized -Wno-maybe-uninitialized)
  endif()
endfunction()
