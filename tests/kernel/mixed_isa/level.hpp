// The mixed-instruction-set test: the same gradavg call compiled into two translation units at
// different SIMD levels, linked into one program. Each unit exports its result through this
// C-like interface (no standard-library types cross it: their inline code is subject to the
// same one-definition hazard), but for gradavg::shape, a plain aggregate of integers.
#pragma once

#include <cstddef>
#include <cstdint>

#include <gradavg/tensor.hpp>

namespace mixed_isa {

inline constexpr std::size_t towers = 3;
inline constexpr std::size_t elements = 37;  // whole packets and a tail at every level

struct level_result {
  const char* isa_namespace;  // gradavg::isa_namespace as the unit sees it
  const void* entry_point;    // the address of the average_gradients_into instantiation it calls
};

/// Averages towers[k][0, elements) into mean and square (each `elements` long).
level_result average_baseline(const float* const* tower_data, float* mean, float* square);  // -march=x86-64
level_result average_v3(const float* const* tower_data, float* mean, float* square);        // -march=x86-64-v3

/// gradavg's vocabulary is the same type in units of any level: declared here, defined in the v3
/// unit, called from the baseline one (a type of the per-level namespace would not link).
gradavg::shape matrix_shape_v3(std::int64_t rows, std::int64_t cols);

}  // namespace mixed_isa
