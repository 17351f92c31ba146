// Built with -march=x86-64-v3 (AVX2 and FMA).
#include "level_impl.hpp"

mixed_isa::level_result mixed_isa::average_v3(const float* const* tower_data, float* mean, float* square) {
  return average_here(tower_data, mean, square);
}
