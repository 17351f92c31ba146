// The compressed exchange's roundings written from their documented definitions
// (gradavg::compression), with Eigen's scalar bfloat16 and half conversions: the reference the
// tests of the compressed exchange (threads as ranks, MPI) compare the library's bits with.
#pragma once

#include <gradavg/options.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace gradavg_test {

inline float bfloat16_round(float x) { return static_cast<float>(Eigen::bfloat16(x)); }

/// The documented float16 block: the largest finite magnitude m brought into [2^14, 2^15) by a
/// power of two 2^k (k at most 127), each value scaled, rounded to half, scaled back.
inline void float16_round_block(float* v, std::size_t n) {
  float m = 0.0f;
  for (std::size_t j = 0; j < n; ++j)
    if (std::isfinite(v[j])) m = std::max(m, std::fabs(v[j]));
  const int k = m > 0.0f ? std::min(14 - std::ilogb(m), 127) : 0;
  for (std::size_t j = 0; j < n; ++j)
    v[j] = std::ldexp(static_cast<float>(Eigen::half(std::ldexp(v[j], k))), -k);
}

/// A part of a bucket (its sums, or its squares' sums) as a 16-bit format rounds it: blocks of
/// 256 from the part's start (double values rounded to float first).
template <class Buf>
std::vector<Buf> round_part(const std::vector<Buf>& part, gradavg::compression format) {
  std::vector<float> v(part.begin(), part.end());
  if (format == gradavg::compression::bfloat16) {
    for (float& x : v) x = bfloat16_round(x);
  } else {
    for (std::size_t b = 0; b < v.size(); b += 256) float16_round_block(v.data() + b, std::min<std::size_t>(256, v.size() - b));
  }
  return {v.begin(), v.end()};
}

}  // namespace gradavg_test
