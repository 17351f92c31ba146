// Test helpers: an independent scalar reference (computed in double, one tower at a time) and
// deterministic random data. Nothing here uses gradavg.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace gradavg_test {

/// Mean over towers of g_k[j] (and of g_k[j]^2), in double. towers[k] points at n values.
template <class S>
struct reference {
  std::vector<double> mean, square;

  reference(const std::vector<const S*>& towers, std::size_t n) : mean(n, 0.0), square(n, 0.0) {
    for (const S* g : towers)
      for (std::size_t j = 0; j < n; ++j) {
        const double x = static_cast<double>(g[j]);
        mean[j] += x;
        square[j] += x * x;
      }
    for (std::size_t j = 0; j < n; ++j) {
      mean[j] /= static_cast<double>(towers.size());
      square[j] /= static_cast<double>(towers.size());
    }
  }
};

/// Tolerance of a T-term float/double sum followed by a division, relative to the sum of
/// magnitudes: T+1 roundings of at most half an ulp each, with a factor 2 of slack.
template <class S>
double tolerance(std::size_t towers) {
  return 2.0 * static_cast<double>(towers + 1) * std::numeric_limits<S>::epsilon();
}

/// Whether got[j] matches want[j] within tolerance<S>(towers) of the mean magnitude scale[j].
/// Returns the first failing index, or n when all match.
template <class S>
std::size_t first_mismatch(const S* got, const std::vector<double>& want, const std::vector<double>& scale,
                           std::size_t towers) {
  const double tol = tolerance<S>(towers);
  for (std::size_t j = 0; j < want.size(); ++j) {
    const double err = std::abs(static_cast<double>(got[j]) - want[j]);
    if (!(err <= tol * scale[j] + std::numeric_limits<S>::denorm_min())) return j;
  }
  return want.size();
}

/// Mean over towers of |g_k[j]| (the scale the rounding error is relative to), and of g_k[j]^2.
template <class S>
std::vector<double> magnitude(const std::vector<const S*>& towers, std::size_t n, bool squares) {
  std::vector<double> m(n, 0.0);
  for (const S* g : towers)
    for (std::size_t j = 0; j < n; ++j) {
      const double x = static_cast<double>(g[j]);
      m[j] += squares ? x * x : std::abs(x);
    }
  for (double& x : m) x /= static_cast<double>(towers.size());
  return m;
}

/// n values uniform in [-1, 1] from a seeded generator.
template <class S>
std::vector<S> random_values(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<S> v(n);
  for (S& x : v) x = static_cast<S>(dist(gen));
  return v;
}

}  // namespace gradavg_test
