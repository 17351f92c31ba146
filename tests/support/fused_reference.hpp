// Test helpers for the fused training step (test_fused.cpp, test_half.cpp): an independent
// reference of weights, scale, non-finite detection and the statistics, computed in long double
// from the inputs; round-to-nearest-even of a double to float, half or bfloat16 written out here;
// towers of any element type over variables of given sizes. Nothing here uses gradavg.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradavg_test {

/// The value of x (float, double, Eigen::half or Eigen::bfloat16) as a double: exact for each.
template <class S>
double as_double(S x) {
  if constexpr (std::is_floating_point_v<S>)
    return static_cast<double>(x);
  else
    return static_cast<double>(static_cast<float>(x));
}

/// A floating-point format: significand bits (with the implicit one), least normal exponent,
/// greatest finite value.
struct float_format {
  int precision;
  int min_normal_exponent;
  double max_finite;
};
inline constexpr float_format half_format{11, -14, 65504.0};
inline constexpr float_format bfloat16_format{8, -126, 0x1.fep127};
inline constexpr float_format float_format_of{24, -126, 0x1.fffffep127};

/// x rounded once to format f, round-to-nearest-even, overflowing to +-Inf, as a double
/// (exact: every value of f is a double). Works on the exponent and significand with
/// frexp/ldexp and rounds with nearbyint in the default rounding mode (ties to even).
inline double round_to_format(double x, const float_format& f) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e = 0;
  std::frexp(x, &e);  // x = m 2^e, 0.5 <= |m| < 1: the leading bit has weight 2^(e-1)
  const int leading = std::max(e - 1, f.min_normal_exponent);
  const int quantum = leading - (f.precision - 1);  // weight of the last significand bit
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -quantum)), quantum);
  if (std::abs(r) > f.max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

template <class O>
constexpr float_format format_of() {
  if constexpr (std::is_same_v<O, Eigen::half>)
    return half_format;
  else if constexpr (std::is_same_v<O, Eigen::bfloat16>)
    return bfloat16_format;
  else
    return float_format_of;
}

/// x rounded once to O (float, double, Eigen::half, Eigen::bfloat16), nearest-even, as a double.
template <class O>
double round_to(double x) {
  if constexpr (std::is_same_v<O, double>)
    return x;
  else
    return round_to_format(x, format_of<O>());
}

/// One variable's expected results under the fused contract, over its elements [begin, end):
///   mean   = (sum_k w_k g_k / sum_k w_k) * scale
///   square = (sum_k w_k g_k^2 / sum_k w_k) * scale^2
/// computed in long double from the inputs (w_k = 1 without weights).
struct fused_expectation {
  std::size_t begin = 0, end = 0;
  std::vector<double> mean, square;          // indexed from 0 = element begin
  std::vector<double> mean_mag, square_mag;  // (sum w|g| / W) |scale| and the square: error scales
  bool nonfinite = false;                    // an input element in [begin, end) is NaN or +-Inf
  double sum_mean_squared = 0, sum_mean_of_squares = 0;
};

template <class S>
fused_expectation expect_fused(const std::vector<const S*>& towers, std::size_t begin, std::size_t end,
                               std::span<const double> weights, double scale) {
  fused_expectation e;
  e.begin = begin;
  e.end = end;
  const std::size_t n = end - begin;
  e.mean.resize(n);
  e.square.resize(n);
  e.mean_mag.resize(n);
  e.square_mag.resize(n);
  long double wsum = 0;
  for (std::size_t k = 0; k < towers.size(); ++k) wsum += weights.empty() ? 1.0L : weights[k];
  const long double sc = scale;
  long double sum_m2 = 0, sum_msq = 0;
  for (std::size_t j = 0; j < n; ++j) {
    long double a = 0, s = 0, mag = 0;
    for (std::size_t k = 0; k < towers.size(); ++k) {
      const long double w = weights.empty() ? 1.0L : weights[k];
      const long double x = as_double(towers[k][begin + j]);
      if (!std::isfinite(x)) e.nonfinite = true;
      a += w * x;
      s += w * x * x;
      mag += w * std::abs(x);
    }
    const long double m = a / wsum * sc;
    const long double q = s / wsum * (sc * sc);
    e.mean[j] = static_cast<double>(m);
    e.square[j] = static_cast<double>(q);
    e.mean_mag[j] = static_cast<double>(mag / wsum * std::abs(sc));
    e.square_mag[j] = e.square[j];
    sum_m2 += m * m;
    sum_msq += q;
  }
  e.sum_mean_squared = static_cast<double>(sum_m2);
  e.sum_mean_of_squares = static_cast<double>(sum_msq);
  return e;
}

/// Relative error budget (times the magnitude) of a weighted mean summed in Acc over T towers:
/// the T products, T - 1 additions, the weight sum, the division and the scale, under 2T + 4
/// roundings of at most half an ulp of a value bounded by the magnitude, with a factor 2 of slack.
template <class Acc>
double fused_tolerance(std::size_t towers) {
  return static_cast<double>(2 * towers + 4) * std::numeric_limits<Acc>::epsilon();
}

/// Whether got (rounded to O from an accumulator result within tol * magnitude of want) is
/// right: NaN where want is NaN, exactly want where want is infinite, else within
/// [round_to<O>(want - err), round_to<O>(want + err)] (rounding is monotonic).
template <class O>
bool matches(O got, double want, double magnitude, double tol) {
  const double g = as_double(got);
  if (std::isnan(want)) return std::isnan(g);
  if (std::isinf(want)) return g == want;
  const double err = tol * magnitude + std::numeric_limits<double>::denorm_min();
  return round_to<O>(want - err) <= g && g <= round_to<O>(want + err);
}

/// The first element of got[begin, end) that does not match e (means, or squares), or end.
template <class O>
std::size_t first_fused_mismatch(const O* got, const fused_expectation& e, bool squares, double tol) {
  for (std::size_t j = e.begin; j < e.end; ++j) {
    const std::size_t r = j - e.begin;
    if (!matches(got[j], squares ? e.square[r] : e.mean[r], squares ? e.square_mag[r] : e.mean_mag[r], tol)) return j;
  }
  return e.end;
}

/// Error bound of the fused statistics of e: each mean within tol * magnitude before being
/// squared and summed in double, each mean of squares within tol * its magnitude.
struct statistics_bound {
  double mean_squared = 0, mean_of_squares = 0;
};
inline statistics_bound statistics_error(const fused_expectation& e, double tol) {
  statistics_bound b;
  const double u = std::numeric_limits<double>::epsilon();
  for (std::size_t r = 0; r < e.mean.size(); ++r) {
    const double d = tol * e.mean_mag[r];
    b.mean_squared += d * (2 * std::abs(e.mean[r]) + d) + 4 * u * e.mean[r] * e.mean[r];
    b.mean_of_squares += tol * e.square_mag[r] + 4 * u * e.square[r];
  }
  const double n = static_cast<double>(e.mean.size());
  b.mean_squared += n * u * e.sum_mean_squared;  // the double summation
  b.mean_of_squares += n * u * e.sum_mean_of_squares;
  return b;
}

/// Towers of S gradients over variables of the given sizes, random in [-1, 1]; a variable
/// marked absent has a null entry on every tower (skipped). Entries point at the vectors.
template <class S>
struct fused_towers {
  using grads = std::vector<S>;
  std::vector<std::size_t> sizes;
  std::vector<bool> absent;
  std::vector<std::vector<grads>> data;  // [tower][variable]
  std::vector<std::vector<std::pair<const grads*, int>>> tg;

  fused_towers(std::size_t towers, std::vector<std::size_t> variable_sizes, std::vector<bool> absent_variables = {},
               std::uint32_t seed = 1)
      : sizes(std::move(variable_sizes)), absent(std::move(absent_variables)), data(towers), tg(towers) {
    absent.resize(sizes.size(), false);
    std::mt19937 gen(seed);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    for (auto& tower : data)
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        grads g(absent[i] ? 0 : sizes[i]);
        for (S& x : g) x = static_cast<S>(static_cast<float>(dist(gen)));
        tower.push_back(std::move(g));
      }
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i)
        tg[k].push_back({absent[i] ? nullptr : &data[k][i], static_cast<int>(i)});
  }

  [[nodiscard]] std::size_t towers() const { return data.size(); }
  [[nodiscard]] std::size_t variables() const { return sizes.size(); }
  [[nodiscard]] std::size_t flat_size() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) n += absent[i] ? 0 : sizes[i];
    return n;
  }

  [[nodiscard]] std::vector<const S*> tower_ptrs(std::size_t i) const {
    std::vector<const S*> p;
    for (const auto& tower : data) p.push_back(tower[i].data());
    return p;
  }

  /// Outputs of element type O shaped like the gradients (empty for skipped variables), filled.
  template <class O = S>
  [[nodiscard]] std::vector<std::vector<O>> outputs(O fill) const {
    std::vector<std::vector<O>> out;
    for (const auto& g : data[0]) out.push_back(std::vector<O>(g.size(), fill));
    return out;
  }

  /// Expectations for every variable (elements [0, n), or the part of the flat range
  /// [begin, end) that falls in it); skipped variables get an empty one.
  [[nodiscard]] std::vector<fused_expectation> expect(std::span<const double> weights, double scale,
                                                      std::size_t begin = 0,
                                                      std::size_t end = std::numeric_limits<std::size_t>::max()) const {
    std::vector<fused_expectation> all;
    std::size_t offset = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::size_t n = data[0][i].size();
      const std::size_t b = std::clamp(begin, offset, offset + n) - offset;
      const std::size_t e = std::clamp(end, offset, offset + n) - offset;
      all.push_back(expect_fused(tower_ptrs(i), b, std::max(b, e), weights, scale));
      offset += n;
    }
    return all;
  }
};

/// Whether two outputs are the same bit for bit.
template <class O>
bool same_bits_all(const std::vector<O>& a, const std::vector<O>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(O)) == 0);
}

/// Whether two sets of outputs are the same bit for bit.
template <class O>
bool same_bits_all(const std::vector<std::vector<O>>& a, const std::vector<std::vector<O>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_bits_all(a[i], b[i])) return false;
  return true;
}

template <class O>
std::string show(O x) {
  return std::to_string(as_double(x));
}

}  // namespace gradavg_test
