// gradavg: what an averaging call reports — counts, non-finite inputs, and the statistics fused
// into the pass (global norm, gradient-noise estimate). Plain data, shared by every SIMD level.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>

#include "errors.hpp"

namespace gradavg {

/// A range [begin, end) of the flat element range of all variables: variables in their order,
/// each contributing its tower-0 gradient's element count (0 when absent), elements in storage
/// order. The default covers everything; end is clamped to the total.
struct element_range {
  std::size_t begin = 0;
  std::size_t end = std::numeric_limits<std::size_t>::max();
};

/// Gradient-noise estimate from one step's means and means of squares (McCandlish et al. 2018,
/// "An Empirical Model of Large-Batch Training", appendix A.1, with the towers' gradients as the
/// small batches and their weighted mean as the big one), for towers of unequal sample counts.
///
/// Model: tower k's gradient g_k is the mean of b_k independent per-sample gradients of mean G
/// and covariance Sigma, and its weight w_k is proportional to b_k (B = sum b_k; a weight-0 tower
/// holds no sample). Then the weighted mean gbar = sum_k (b_k / B) g_k has
///   E |gbar|^2                      = |G|^2 + tr(Sigma) / B
///   E sum_k (b_k / B) |g_k|^2       = |G|^2 + T+ tr(Sigma) / B
/// with T+ the number of towers of positive weight (each contributes b_k / B * tr(Sigma) / b_k).
/// With S1 = sum_mean_squared (|gbar|^2) and S2 = sum_mean_of_squares (the weighted mean of the
/// |g_k|^2), the estimates
///   trace_covariance   = B (S2 - S1) / (T+ - 1)          estimates tr(Sigma)
///   gradient_squared   = S1 - trace_covariance / B         estimates |G|^2
///   simple_noise_scale = trace_covariance / gradient_squared   B_simple
/// are unbiased for tr(Sigma) and |G|^2 (not their ratio) for any b_k; with equal weights
/// (T+ = T, b_k = B / T) they are the paper's A.1 estimators with B_big = B, B_small = B / T.
/// NaN where T+ < 2 or B is unknown (0).
struct noise_estimate {
  double trace_covariance = std::numeric_limits<double>::quiet_NaN();
  double gradient_squared = std::numeric_limits<double>::quiet_NaN();
  double simple_noise_scale = std::numeric_limits<double>::quiet_NaN();
};

/// The noise estimate from the two sums of one variable or of all (see noise_estimate), over
/// weighted_towers = T+ towers of positive weight holding total_samples = B samples.
[[nodiscard]] inline noise_estimate estimate_noise(double sum_mean_squared, double sum_mean_of_squares,
                                                   std::size_t weighted_towers, double total_samples) noexcept {
  noise_estimate e;
  if (weighted_towers < 2 || !(total_samples > 0)) return e;
  const double t = static_cast<double>(weighted_towers);
  // tr(Sigma) / B, formed without B: gradient_squared stays finite for any finite sums and B.
  const double per_sample = (sum_mean_of_squares - sum_mean_squared) / (t - 1);
  e.trace_covariance = total_samples * per_sample;
  e.gradient_squared = sum_mean_squared - per_sample;
  e.simple_noise_scale = total_samples * (per_sample / e.gradient_squared);
  return e;
}

/// One variable's results (options.compute.per_variable[i]). For a skipped variable, or a variable
/// with no element in options.compute.range, every member is left as it was; so are the sums when
/// options.compute.statistics is off (their defaults, NaN, say "not computed").
struct variable_statistics {
  /// An input element of this variable (within the range) was NaN or +-Inf; written when
  /// options.compute.on_nonfinite is not ignore.
  bool nonfinite = false;
  /// sum over its elements of mean^2 (the squared L2 norm of its averaged gradient) and of the mean
  /// of squares; written when options.compute.statistics. Both after options.compute.scale, in
  /// double.
  double sum_mean_squared = std::numeric_limits<double>::quiet_NaN();
  double sum_mean_of_squares = std::numeric_limits<double>::quiet_NaN();
};

/// What an averaging call reports.
struct summary {
  std::size_t averaged = 0;  ///< variables written
  std::size_t skipped = 0;   ///< variables absent on every tower, outputs left untouched

  /// Variables with at least one NaN or +-Inf input element (0 when detection is off).
  std::size_t nonfinite_variables = 0;

  /// options.compute.statistics was set: the sums below were computed, and so can global_norm(),
  /// clip_coefficient() and noise(), which throw statistics_error otherwise.
  bool statistics = false;

  /// With options.compute.statistics, over every averaged element (in options.compute.range): the
  /// sum of mean^2 and of the mean of squares, accumulated in double, bitwise the same for any
  /// thread count. NaN or Inf when an input was. NaN when statistics are off.
  double sum_mean_squared = std::numeric_limits<double>::quiet_NaN();
  double sum_mean_of_squares = std::numeric_limits<double>::quiet_NaN();

  /// T (every process's towers, across processes), and T+, the towers of positive weight (T
  /// without options.compute.weights): weight-0 towers hold no sample of the noise estimate.
  std::size_t towers = 0;
  std::size_t weighted_towers = 0;

  /// The flat elements (element_range) whose means and squares this call wrote on this process:
  /// options.compute.range clamped to the averaged elements, or across processes with
  /// output_mode::sharded this rank's shard of it (shard_of), the elements its optimizer updates.
  /// A libtorch module helper's report: its averaged parameters' elements end to end, {0, n}.
  element_range shard = {0, 0};

  /// Some input element was NaN or +-Inf: skip the step (and lower the loss scale).
  [[nodiscard]] bool nonfinite() const noexcept { return nonfinite_variables != 0; }

  /// L2 norm of the averaged gradient over every averaged variable (in options.compute.range).
  [[nodiscard]] double global_norm() const {
    require_statistics("global_norm()");
    return std::sqrt(sum_mean_squared);
  }

  /// Factor by which clipping to max_norm multiplies every mean: min(1, max_norm / norm), 1 for a
  /// zero norm, NaN for a non-finite norm. max_norm must be > 0 (statistics_error); +Inf means no
  /// clipping (PyTorch's clip_grad_norm_(max_norm=inf)): 1 for a finite norm. Apply it in the
  /// optimizer's update (one multiply per element the optimizer reads anyway) rather than in a
  /// pass of its own over the means.
  [[nodiscard]] double clip_coefficient(double max_norm) const {
    if (std::isnan(max_norm) || !(max_norm > 0))
      throw statistics_error("gradavg: clip_coefficient(max_norm): max_norm must be > 0 (+inf: no clipping), not " +
                             std::to_string(max_norm));
    const double norm = global_norm();
    if (!std::isfinite(norm)) return std::numeric_limits<double>::quiet_NaN();
    return norm > max_norm ? max_norm / norm : 1.0;
  }

  /// The gradient-noise estimate over every averaged variable, for a step of
  /// samples_per_tower * T samples in all (every tower, weight-0 ones included; with weights,
  /// tower k's count is taken as proportional to w_k). samples_per_tower must be finite and
  /// >= 0, and samples_per_tower * T finite (statistics_error); 0: unknown, the estimate is NaN.
  /// Needs T+ >= 2.
  [[nodiscard]] noise_estimate noise(double samples_per_tower) const {
    require_statistics("noise()");
    return estimate_noise(sum_mean_squared, sum_mean_of_squares, weighted_towers, total_samples(samples_per_tower));
  }

  /// The same for one variable's statistics (of this call).
  [[nodiscard]] noise_estimate noise(const variable_statistics& v, double samples_per_tower) const {
    require_statistics("noise(variable_statistics)");
    return estimate_noise(v.sum_mean_squared, v.sum_mean_of_squares, weighted_towers, total_samples(samples_per_tower));
  }

 private:
  double total_samples(double samples_per_tower) const {
    if (!std::isfinite(samples_per_tower) || samples_per_tower < 0)
      throw statistics_error("gradavg: summary::noise(samples_per_tower): samples_per_tower must be finite and >= 0, "
                             "not " + std::to_string(samples_per_tower));
    const double total = samples_per_tower * static_cast<double>(towers);
    if (!std::isfinite(total))
      throw statistics_error("gradavg: summary::noise(samples_per_tower): samples_per_tower (" +
                             std::to_string(samples_per_tower) + ") times the " + std::to_string(towers) +
                             " towers overflows; the step's sample count must be finite");
    return total;
  }

  void require_statistics(const char* what) const {
    if (!statistics)
      throw statistics_error(std::string("gradavg: summary::") + what +
                             " needs the statistics, and this call did not compute them "
                             "(set options.compute.statistics)");
  }
};

}  // namespace gradavg
