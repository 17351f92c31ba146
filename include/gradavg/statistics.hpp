// gradavg: what an averaging call reports — counts, non-finite inputs, and the statistics fused
// into the pass (global norm, gradient-noise estimate). Plain data, shared by every SIMD level.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace gradavg {

/// Gradient-noise estimate from one step's means and means of squares over T towers
/// (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A.1, with the
/// towers' gradients as the small batches and their weighted mean as the big one). With B the
/// total sample count and tower k's count b_k proportional to its weight:
///   trace_covariance  = B (sum_mean_of_squares - sum_mean_squared) / (T - 1)   estimates tr(Sigma)
///   gradient_squared  = sum_mean_squared - trace_covariance / B                  estimates |G|^2
///   simple_noise_scale = trace_covariance / gradient_squared                     B_simple
/// Unbiased for tr(Sigma) and |G|^2 (not their ratio). NaN where T < 2 or B is unknown (0).
struct noise_estimate {
  double trace_covariance = std::numeric_limits<double>::quiet_NaN();
  double gradient_squared = std::numeric_limits<double>::quiet_NaN();
  double simple_noise_scale = std::numeric_limits<double>::quiet_NaN();
};

/// The noise estimate from the two sums of one variable or of all (see noise_estimate).
[[nodiscard]] inline noise_estimate estimate_noise(double sum_mean_squared, double sum_mean_of_squares,
                                                   std::size_t towers, double total_samples) noexcept {
  noise_estimate e;
  if (towers < 2 || !(total_samples > 0)) return e;
  const double t = static_cast<double>(towers);
  e.trace_covariance = total_samples * (sum_mean_of_squares - sum_mean_squared) / (t - 1);
  e.gradient_squared = sum_mean_squared - e.trace_covariance / total_samples;
  e.simple_noise_scale = e.trace_covariance / e.gradient_squared;
  return e;
}

/// One variable's results (options::per_variable[i]). For a skipped variable, or a variable
/// with no element in options::range, every member is left as it was.
struct variable_statistics {
  /// An input element of this variable (within the range) was NaN or +-Inf; written when
  /// options::on_nonfinite is not ignore.
  bool nonfinite = false;
  /// sum over its elements of mean^2 (the squared L2 norm of its averaged gradient) and of the
  /// mean of squares; written when options::statistics. Both after options::scale, in double.
  double sum_mean_squared = 0;
  double sum_mean_of_squares = 0;
};

/// What an averaging call reports.
struct summary {
  std::size_t averaged = 0;  ///< variables written
  std::size_t skipped = 0;   ///< variables absent on every tower, outputs left untouched

  /// Variables with at least one NaN or +-Inf input element (0 when detection is off).
  std::size_t nonfinite_variables = 0;

  /// With options::statistics, over every averaged element (in options::range): the sum of
  /// mean^2 and of the mean of squares, accumulated in double, bitwise the same for any thread
  /// count. NaN or Inf when an input was; 0 otherwise when statistics are off.
  double sum_mean_squared = 0;
  double sum_mean_of_squares = 0;

  /// T, and the total sample count B (options::samples_per_tower * T; 0 when unknown).
  std::size_t towers = 0;
  double total_samples = 0;

  /// Some input element was NaN or +-Inf: skip the step (and lower the loss scale).
  [[nodiscard]] bool nonfinite() const noexcept { return nonfinite_variables != 0; }

  /// L2 norm of the averaged gradient over every averaged variable.
  [[nodiscard]] double global_norm() const noexcept { return std::sqrt(sum_mean_squared); }

  /// Factor by which clipping to max_norm multiplies every mean: min(1, max_norm / norm), 1 for a
  /// zero norm, NaN for a non-finite norm. Apply it in the optimizer's update (one multiply per
  /// element the optimizer reads anyway) rather than in a pass of its own over the means.
  [[nodiscard]] double clip_coefficient(double max_norm) const noexcept {
    const double norm = global_norm();
    if (!std::isfinite(norm)) return std::numeric_limits<double>::quiet_NaN();
    return norm > max_norm ? max_norm / norm : 1.0;
  }

  /// The gradient-noise estimate over every averaged variable (needs T >= 2 and samples).
  [[nodiscard]] noise_estimate noise() const noexcept {
    return estimate_noise(sum_mean_squared, sum_mean_of_squares, towers, total_samples);
  }

  /// The same for one variable's statistics.
  [[nodiscard]] noise_estimate noise(const variable_statistics& v) const noexcept {
    return estimate_noise(v.sum_mean_squared, v.sum_mean_of_squares, towers, total_samples);
  }
};

}  // namespace gradavg
