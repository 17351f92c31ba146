# Cross compiling for 64-bit ARM (aarch64, NEON) with Debian's g++-aarch64-linux-gnu; the tests
# and examples run under qemu-user (package qemu-user):
#   cmake -S . -B build/aarch64 --toolchain cmake/toolchains/aarch64-linux-gnu.cmake \
#         -DGRADAVG_BUILD_BENCH=OFF
#   cmake --build build/aarch64 && ctest --test-dir build/aarch64
# Eigen and Catch2 (v2.13) are used as header-only packages from the build machine; libraries
# come from the aarch64 sysroot only.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(GRADAVG_AARCH64_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${GRADAVG_AARCH64_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${GRADAVG_AARCH64_TRIPLE}-g++)

set(GRADAVG_AARCH64_SYSROOT /usr/${GRADAVG_AARCH64_TRIPLE})
set(CMAKE_FIND_ROOT_PATH ${GRADAVG_AARCH64_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)   # build tools run on the build machine
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)    # never link a build-machine library
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)    # header-only Eigen and Catch2 from /usr/include
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)    # their CMake configs from /usr/lib, /usr/share

find_program(GRADAVG_QEMU_AARCH64 qemu-aarch64)
if(GRADAVG_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${GRADAVG_QEMU_AARCH64} -L ${GRADAVG_AARCH64_SYSROOT})
endif()
