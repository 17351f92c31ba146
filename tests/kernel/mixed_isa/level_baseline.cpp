// Built with -march=x86-64 (SSE2, no FMA).
#include "level_impl.hpp"

mixed_isa::level_result mixed_isa::average_baseline(const float* const* tower_data, float* mean, float* square) {
  return average_here(tower_data, mean, square);
}
