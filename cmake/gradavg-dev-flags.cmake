# Compile settings for gradavg's own tests, benchmarks and examples. Never applied to the
# exported gradavg::gradavg target.
#
#   GRADAVG_WERROR    -Wall -Wextra -Wpedantic -Werror (CI turns it on)
#   GRADAVG_NATIVE    -march=native, so the SIMD kernels use the machine's widest packets
#   GRADAVG_SANITIZE  e.g. "address,undefined": sanitizers with -fno-sanitize-recover=all
option(GRADAVG_WERROR "Treat warnings as errors in tests, bench and examples" OFF)
option(GRADAVG_NATIVE "Build tests, bench and examples with -march=native" ON)
set(GRADAVG_SANITIZE "" CACHE STRING "Sanitizers for tests and examples, e.g. address,undefined")

add_library(gradavg_dev_flags INTERFACE)
target_compile_options(gradavg_dev_flags INTERFACE -Wall -Wextra -Wpedantic)
if(GRADAVG_WERROR)
  target_compile_options(gradavg_dev_flags INTERFACE -Werror)
endif()
if(GRADAVG_NATIVE)
  target_compile_options(gradavg_dev_flags INTERFACE -march=native)
endif()
if(GRADAVG_SANITIZE)
  target_compile_options(gradavg_dev_flags INTERFACE
    -fsanitize=${GRADAVG_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer)
  target_link_options(gradavg_dev_flags INTERFACE -fsanitize=${GRADAVG_SANITIZE})
endif()
