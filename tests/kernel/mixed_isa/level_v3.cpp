// Built with -march=x86-64-v3 (AVX2 and FMA).
#include "level_impl.hpp"

mixed_isa::level_result mixed_isa::average_v3(const float* const* tower_data, float* mean, float* square) {
  return average_here(tower_data, mean, square);
}

gradavg::shape mixed_isa::matrix_shape_v3(std::int64_t rows, std::int64_t cols) {
  return gradavg::shape::matrix(rows, cols, gradavg::storage_order::col_major);
}
