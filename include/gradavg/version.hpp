// gradavg: the library's version, its single source (CMake reads it back).
#pragma once

#define GRADAVG_VERSION_MAJOR 0
#define GRADAVG_VERSION_MINOR 1
#define GRADAVG_VERSION_PATCH 0

namespace gradavg {
inline constexpr int version_major = GRADAVG_VERSION_MAJOR;
inline constexpr int version_minor = GRADAVG_VERSION_MINOR;
inline constexpr int version_patch = GRADAVG_VERSION_PATCH;
}  // namespace gradavg
