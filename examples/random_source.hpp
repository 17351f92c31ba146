// Deterministic random numbers for the examples' synthetic data. mt19937_64's output is fixed by
// the standard, the std distributions' are not: converting by hand keeps the data the same with
// every standard library.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>

#include <Eigen/Core>

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
