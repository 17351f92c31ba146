// What the training examples share: deterministic random numbers for their synthetic data, the
// command line's integers and wire formats, and the comparison of two parameter sets.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include <gradavg/options.hpp>

// mt19937_64's output is fixed by the standard, the std distributions' are not: converting by
// hand keeps the data the same with every standard library.
class random_source {
 public:
  explicit random_source(std::uint64_t seed) : engine_(seed) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)
  // Box-Muller: one standard normal from two uniforms.
  float normal() {
    const double radius = std::sqrt(-2.0 * std::log(1.0 - uniform()));
    return static_cast<float>(radius * std::cos(2.0 * std::numbers::pi * uniform()));
  }
  Eigen::Index below(Eigen::Index n) { return static_cast<Eigen::Index>(engine_() % static_cast<std::uint64_t>(n)); }

 private:
  std::mt19937_64 engine_;
};

// n independent standard normals.
inline Eigen::VectorXf normal_vector(Eigen::Index n, random_source& rng) {
  Eigen::VectorXf v(n);
  for (float& e : v) e = rng.normal();
  return v;
}

// A direction in N-dimensional feature space. Fixed-size: GCC 12 at -O3 warns
// (-Waggressive-loop-optimizations) inside Eigen's reduction over a dynamic-size vector whose size
// is a known constant.
template <int N>
using direction = Eigen::Matrix<float, N, 1>;

// Two orthonormal directions, drawn from rng (Gram-Schmidt on two normal vectors): the plane the
// training examples' labels depend on.
template <int N>
std::pair<direction<N>, direction<N>> orthonormal_directions(random_source& rng) {
  const direction<N> u = normal_vector(N, rng).normalized();
  direction<N> v = normal_vector(N, rng);
  v = (v - v.dot(u) * u).normalized();
  return {u, v};
}

// A fresh random order of `from` (samples in the columns of .x, labels in .y) for the next epoch
// (Fisher-Yates), written into `to`.
template <class Dataset>
void shuffle_into(const Dataset& from, Dataset& to, random_source& rng) {
  std::vector<Eigen::Index> order(static_cast<std::size_t>(from.y.size()));
  for (std::size_t j = 0; j < order.size(); ++j) order[j] = static_cast<Eigen::Index>(j);
  for (auto j = static_cast<Eigen::Index>(order.size()) - 1; j > 0; --j)
    std::swap(order[static_cast<std::size_t>(j)], order[static_cast<std::size_t>(rng.below(j + 1))]);
  for (Eigen::Index j = 0; j < from.y.size(); ++j) {
    to.x.col(j) = from.x.col(order[static_cast<std::size_t>(j)]);
    to.y(j) = from.y(order[static_cast<std::size_t>(j)]);
  }
}

// text as an int in [low, high], or nothing.
/// The exchange's wire formats (gradavg::compression) by their --compression names, each with the
/// relative difference its two roundings may add to the first step's averaged gradient against
/// the full batch's (relative to the largest element): bfloat16 rounds to 2^-9 of each value,
/// float16 to 2^-12 of a block's largest, int8 to a step, 1/127 of a block's largest. none: 0 (each
/// example states its own bound for float sums in another order).
struct wire_format {
  gradavg::compression format;
  const char* name;
  double rounding_tolerance;
};
inline constexpr std::array<wire_format, 4> wire_formats = {{{gradavg::compression::none, "none", 0.0},
                                                             {gradavg::compression::bfloat16, "bf16", 0x1p-7},
                                                             {gradavg::compression::float16, "fp16", 0x1p-9},
                                                             {gradavg::compression::int8, "int8", 0x1p-5}}};

/// The wire format named `name` (wire_formats), or nothing.
inline std::optional<wire_format> wire_format_named(std::string_view name) {
  for (const wire_format& f : wire_formats)
    if (name == f.name) return f;
  return std::nullopt;
}

/// The wire format of `format`.
inline const wire_format& wire_format_of(gradavg::compression format) {
  for (const wire_format& f : wire_formats)
    if (f.format == format) return f;
  return wire_formats[0];
}

inline std::optional<int> parse_int(std::string_view text, int low, int high) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < low || value > high) return std::nullopt;
  return value;
}

// The largest element difference between two parameter sets over the largest element of b
// (for_each_pair, found where Parameters is declared, lists their members).
template <class Parameters>
float max_relative_difference(const Parameters& a, const Parameters& b) {
  float difference = 0, scale = 0;
  for_each_pair(a, b, [&](const auto& x, const auto& y) {
    difference = std::max(difference, (x - y).cwiseAbs().maxCoeff());
    scale = std::max(scale, y.cwiseAbs().maxCoeff());
  });
  return difference / scale;
}
