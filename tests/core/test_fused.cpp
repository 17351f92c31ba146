// The fused training step (float and double gradients): tower weights, scale, accumulation in
// double, non-finite detection and its policies, the statistics (global norm, clipping, noise
// estimate), per-variable results, partial element ranges, flat outputs, the option errors, both
// APIs, and bitwise equality of every output and statistic across thread counts and executors.
// Expected values come from fused_reference.hpp (long double, from the inputs) or, for the bound
// of accumulation in double, from an exact integer sum; other runs are compared bit for bit with
// runs checked that way.
#include <gradavg/eigen.hpp>
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "fused_reference.hpp"
#include "fused_support.hpp"
#include "support.hpp"

namespace {

using namespace gradavg_test;  // fused_reference.hpp, fused_support.hpp, support.hpp

/// McCandlish et al.'s estimates from the two sums, written out here in long double.
struct noise_reference {
  long double trace, gradient_squared, noise_scale;
};
noise_reference mccandlish(long double m2, long double msq, long double towers, long double samples) {
  const long double trace = samples * (msq - m2) / (towers - 1);
  const long double g2 = m2 - trace / samples;
  return {trace, g2, trace / g2};
}

/// The sweep behind the weights, scale and statistics cases, for gradients of type S.
template <class S>
void check_weights_scale_statistics(std::size_t towers, bool weighted, double scale) {
  std::vector<std::size_t> sizes;
  for (std::size_t n = 1; n <= 70; ++n) sizes.push_back(n);
  sizes.push_back(1000);
  std::vector<bool> absent(sizes.size(), false);
  absent[20] = true;  // a skipped variable among them
  const fused_towers<S> w(towers, sizes, absent, static_cast<std::uint32_t>(towers * 7 + (weighted ? 1 : 0)));
  const std::vector<double> weights = weighted ? uneven_weights(towers) : std::vector<double>{};

  gradavg::options opts;
  opts.compute.weights = weights;
  opts.compute.scale = scale;
  opts.compute.statistics = true;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
  const auto r = run_into(w, opts);
  const auto want = w.expect(weights, scale);
  const double tol = fused_tolerance<S>(towers);
  require_outputs_match(r.means, want, false, tol);
  require_outputs_match(r.squares, want, true, tol);
  require_statistics_match(r, want, tol, absent);

  CHECK(r.summary.averaged == sizes.size() - 1);
  CHECK(r.summary.skipped == 1);
  CHECK(r.summary.nonfinite_variables == 0);
  CHECK_FALSE(r.summary.nonfinite());
  CHECK(r.summary.towers == towers);
  // Towers of weight 0 hold no sample: the noise estimate counts the others.
  const auto weighted_towers = static_cast<std::size_t>(
      weights.empty() ? towers : std::count_if(weights.begin(), weights.end(), [](double x) { return x > 0; }));
  CHECK(r.summary.weighted_towers == weighted_towers);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    if (!absent[i]) CHECK_FALSE(r.per_variable[i].nonfinite);

  // Derived statistics against the reference's sums.
  long double m2 = 0, msq = 0, m2_bound = 0, msq_bound = 0;
  for (const auto& e : want) {
    m2 += e.sum_mean_squared;
    msq += e.sum_mean_of_squares;
    const auto b = gradavg_test::statistics_error(e, tol);
    m2_bound += b.mean_squared;
    msq_bound += b.mean_of_squares;
  }
  const double norm = std::sqrt(static_cast<double>(m2));
  CHECK(r.summary.global_norm() == Approx(norm).epsilon(1e-4));
  CHECK(r.summary.clip_coefficient(norm / 2) == Approx(0.5).epsilon(1e-4));
  CHECK(r.summary.clip_coefficient(norm * 2) == 1.0);
  const auto noise = r.summary.noise(32);
  if (weighted_towers < 2) {
    CHECK(std::isnan(noise.trace_covariance));
    CHECK(std::isnan(noise.gradient_squared));
    CHECK(std::isnan(noise.simple_noise_scale));
  } else {
    // The formulas applied to the reported sums (exact up to double rounding)...
    const auto from_sums = mccandlish(r.summary.sum_mean_squared, r.summary.sum_mean_of_squares,
                                      static_cast<long double>(weighted_towers), 32.0 * static_cast<double>(towers));
    CHECK(noise.trace_covariance == Approx(static_cast<double>(from_sums.trace)).epsilon(1e-12));
    CHECK(noise.gradient_squared == Approx(static_cast<double>(from_sums.gradient_squared)).epsilon(1e-12));
    CHECK(noise.simple_noise_scale == Approx(static_cast<double>(from_sums.noise_scale)).epsilon(1e-12));
    // ... and to the reference's sums, within the sums' error bounds carried through the formulas.
    const long double T = static_cast<long double>(weighted_towers), B = 32.0L * static_cast<long double>(towers);
    const auto ref = mccandlish(m2, msq, T, B);
    const long double trace_bound = B * (m2_bound + msq_bound) / (T - 1);
    const long double g2_bound = m2_bound + trace_bound / B;
    require_within(noise.trace_covariance, static_cast<double>(ref.trace), static_cast<double>(trace_bound),
                   "noise().trace_covariance");
    require_within(noise.gradient_squared, static_cast<double>(ref.gradient_squared), static_cast<double>(g2_bound),
                   "noise().gradient_squared");
    require_within(noise.simple_noise_scale, static_cast<double>(ref.noise_scale),
                   static_cast<double>(2 * (trace_bound + std::abs(ref.noise_scale) * g2_bound) /
                                       (std::abs(ref.gradient_squared) - g2_bound)),
                   "noise().simple_noise_scale");
    const auto v = r.summary.noise(r.per_variable[70], 32);  // the 1000-element variable
    const auto vref = mccandlish(want[70].sum_mean_squared, want[70].sum_mean_of_squares, T, B);
    const auto vb = gradavg_test::statistics_error(want[70], tol);
    require_within(v.trace_covariance, static_cast<double>(vref.trace),
                   static_cast<double>(B * (vb.mean_squared + vb.mean_of_squares) / (T - 1)),
                   "noise(per_variable).trace_covariance");
  }
}

}  // namespace

TEST_CASE("weights, scale and statistics against the reference: 1 to 70 elements, T in {1, 2, 3, 8, 17, 33}") {
  for (std::size_t towers : {1, 2, 3, 8, 17, 33}) {
    INFO("T = " << towers);
    {
      INFO("float, uneven weights, unscaled by a loss scale of 1024");
      check_weights_scale_statistics<float>(towers, true, 1.0 / 1024);
    }
    {
      INFO("float, no weights, scale 3");
      check_weights_scale_statistics<float>(towers, false, 3.0);
    }
    {
      INFO("double, uneven weights, scale -0.5");
      check_weights_scale_statistics<double>(towers, true, -0.5);
    }
  }
}

TEST_CASE("without weights, with scale 1, statistics and detection change no output bit") {
  for (std::size_t towers : {1, 3, 17}) {
    INFO("T = " << towers);
    const fused_towers<float> w(towers, {1, 15, 16, 17, 63, 64, 65, 4099}, {}, 3);
    const auto plain = run_into(w, {});
    gradavg::options opts;
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
    const auto fused = run_into(w, opts);
    CHECK(same_bits_all(plain.means, fused.means));
    CHECK(same_bits_all(plain.squares, fused.squares));
    // Statistics off: sums NaN, the derived statistics refused, per_variable sums untouched
    // (nonfinite is written: detection is on).
    opts.compute.statistics = false;
    const auto no_stats = run_into(w, opts);
    CHECK_FALSE(no_stats.summary.statistics);
    CHECK(std::isnan(no_stats.summary.sum_mean_squared));
    CHECK(std::isnan(no_stats.summary.sum_mean_of_squares));
    CHECK_THROWS_AS(no_stats.summary.global_norm(), gradavg::statistics_error);
    CHECK_THROWS_AS(no_stats.summary.clip_coefficient(1.0), gradavg::statistics_error);
    CHECK_THROWS_AS(no_stats.summary.noise(8), gradavg::statistics_error);
    CHECK_THROWS_AS(no_stats.summary.noise(no_stats.per_variable[0], 8), gradavg::statistics_error);
    CHECK(fused.summary.statistics);
    for (const auto& v : no_stats.per_variable) {
      CHECK_FALSE(v.nonfinite);
      CHECK(same_double_bits(v.sum_mean_squared, untouched_entry.sum_mean_squared));
      CHECK(same_double_bits(v.sum_mean_of_squares, untouched_entry.sum_mean_of_squares));
    }
    // Detection off: nonfinite untouched, statistics written.
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::ignore;
    const auto no_detection = run_into(w, opts);
    CHECK(no_detection.summary.nonfinite_variables == 0);
    for (const auto& v : no_detection.per_variable) {
      CHECK(v.nonfinite == untouched_entry.nonfinite);
      CHECK(v.sum_mean_squared >= 0);
    }
    // Statistics without a squares output: the same sums.
    const auto means_only = run_into(w, opts, false);
    CHECK(same_bits_all(means_only.means, fused.means));
    CHECK(same_double_bits(means_only.summary.sum_mean_of_squares, fused.summary.sum_mean_of_squares));
    CHECK(same_double_bits(means_only.summary.sum_mean_squared, fused.summary.sum_mean_squared));
  }
}

TEST_CASE("statistics of zero gradients and unknown sample counts") {
  fused_towers<float> w(4, {5, 33});
  for (auto& tower : w.data)
    for (auto& g : tower) std::fill(g.begin(), g.end(), 0.0f);
  gradavg::options opts;
  opts.compute.statistics = true;
  const auto r = run_into(w, opts);
  CHECK(r.summary.sum_mean_squared == 0);
  CHECK(r.summary.global_norm() == 0);
  CHECK(r.summary.clip_coefficient(1.0) == 1.0);
  CHECK(std::isnan(r.summary.noise(0).simple_noise_scale));  // sample count unknown
  CHECK(std::isnan(r.summary.noise(0).trace_covariance));
  for (double samples : {-1.0, nan_value, inf_value}) {
    INFO("samples_per_tower " << samples);
    CHECK_THROWS_AS(r.summary.noise(samples), gradavg::statistics_error);
    CHECK_THROWS_AS(r.summary.noise(r.per_variable[0], samples), gradavg::statistics_error);
  }
}

TEST_CASE("clip_coefficient: min(1, max_norm / norm), 1 for a zero norm, NaN for a non-finite one") {
  // One variable whose mean over two towers is (3, 4, 0, 0): norm 5.
  fused_towers<float> w(2, {4});
  for (auto& tower : w.data) tower[0] = {3.0f, 4.0f, 0.0f, 0.0f};
  const auto r = run_into(w, {.compute = {.statistics = true}});
  REQUIRE(r.summary.global_norm() == 5.0);
  CHECK(r.summary.clip_coefficient(10.0) == 1.0);
  CHECK(r.summary.clip_coefficient(5.0) == 1.0);
  CHECK(r.summary.clip_coefficient(2.5) == 0.5);
  CHECK(r.summary.clip_coefficient(std::numeric_limits<double>::min()) > 0);

  for (auto& tower : w.data) std::fill(tower[0].begin(), tower[0].end(), 0.0f);
  const auto zero = run_into(w, {.compute = {.statistics = true}});
  CHECK(zero.summary.global_norm() == 0.0);
  CHECK(zero.summary.clip_coefficient(1.0) == 1.0);
  CHECK(zero.summary.clip_coefficient(1e-300) == 1.0);

  w.data[1][0][2] = std::numeric_limits<float>::infinity();
  CHECK(std::isnan(run_into(w, {.compute = {.statistics = true}}).summary.clip_coefficient(1.0)));

  // A max_norm that would flip or void the gradient is refused, whatever the norm.
  for (const auto* s : {&r.summary, &zero.summary})
    for (double bad : {-1.0, 0.0, -0.0, nan_value, -inf_value}) {
      INFO("max_norm " << bad);
      const std::string message =
          message_of<gradavg::statistics_error>([&] { static_cast<void>(s->clip_coefficient(bad)); });
      CHECK(contains(message, "max_norm must be > 0"));
    }
  // +Inf is PyTorch's max_norm=inf: no clipping, whatever the finite norm; NaN for a non-finite one.
  CHECK(r.summary.clip_coefficient(inf_value) == 1.0);
  CHECK(zero.summary.clip_coefficient(inf_value) == 1.0);
  CHECK(std::isnan(run_into(w, {.compute = {.statistics = true}}).summary.clip_coefficient(inf_value)));
}

TEST_CASE("noise: a sample count that overflows is a statistics_error, a huge finite one gives finite estimates") {
  fused_towers<float> w(4, {5, 33}, {}, 41);
  const auto r = run_into(w, {.compute = {.statistics = true}});
  for (double samples : {1e308, std::numeric_limits<double>::max()}) {
    INFO("samples_per_tower " << samples);
    const std::string m = message_of<gradavg::statistics_error>([&] { static_cast<void>(r.summary.noise(samples)); });
    CHECK(contains(m, "overflows"));
    CHECK_THROWS_AS(r.summary.noise(r.per_variable[1], samples), gradavg::statistics_error);
  }
  // B = 4e300: the estimate of |G|^2 does not depend on B and stays that of a small B; tr(Sigma)
  // scales with B (against the reference in long double, which has the range).
  const double s1 = r.summary.sum_mean_squared, s2 = r.summary.sum_mean_of_squares;
  const auto small = r.summary.noise(32), huge = r.summary.noise(1e300);
  const noise_reference want = mccandlish(s1, s2, 4, 4e300L);
  CHECK(std::isfinite(huge.gradient_squared));
  CHECK(huge.gradient_squared == small.gradient_squared);
  CHECK(huge.gradient_squared == Approx(static_cast<double>(want.gradient_squared)).epsilon(1e-12));
  CHECK(huge.trace_covariance == Approx(static_cast<double>(want.trace)).epsilon(1e-12));
  CHECK(huge.simple_noise_scale == Approx(static_cast<double>(want.noise_scale)).epsilon(1e-12));
}

TEST_CASE("the noise estimate is unbiased for towers of equal, unequal and zero weight") {
  // Synthetic steps with a known answer: tower k's gradient is the mean of b_k samples of mean G
  // and covariance Sigma = 4 I over 64 elements (tr Sigma = 256, |G|^2 = 64 * 0.2^2 = 2.56),
  // drawn as G + sqrt(4 / b_k) z with z standard normal, and tower k weighs b_k. A weight-0
  // tower holds no sample: its gradient is noise of another scale, which must not matter.
  // Over 4000 steps the mean of each estimate must lie within 5 standard errors (from the
  // estimates' own spread) of the truth.
  constexpr std::size_t n = 64, steps = 4000;
  constexpr double sigma2 = 4.0, g = 0.2;
  const double true_trace = static_cast<double>(n) * sigma2, true_g2 = static_cast<double>(n) * g * g;
  struct config {
    const char* name;
    std::vector<double> samples;
  };
  for (const config& c : {config{"equal", {32, 32, 32, 32}}, config{"unequal", {64, 16, 48, 8, 24}},
                          config{"two towers", {10, 30}}, config{"a tower of weight 0", {64, 64, 32, 0}},
                          config{"weight 0 first and last", {0, 40, 40, 80, 0}}}) {
    INFO(c.name);
    const std::size_t towers = c.samples.size();
    double total = 0;
    for (double b : c.samples) total += b;
    const auto weighted = static_cast<std::size_t>(
        std::count_if(c.samples.begin(), c.samples.end(), [](double b) { return b > 0; }));
    std::mt19937_64 gen(1000 * towers + static_cast<std::uint64_t>(total));
    std::normal_distribution<double> z;
    std::vector<std::vector<double>> data(towers, std::vector<double>(n));
    std::vector<std::vector<std::pair<const std::vector<double>*, int>>> tg(towers), without_empty;
    for (std::size_t k = 0; k < towers; ++k) {
      tg[k].push_back({&data[k], 0});
      if (c.samples[k] > 0) without_empty.push_back(tg[k]);
    }
    std::vector<double> nonzero_samples;
    for (double b : c.samples)
      if (b > 0) nonzero_samples.push_back(b);
    std::vector<std::vector<double>> means{std::vector<double>(n)};
    const gradavg::options opts{.compute = {.weights = c.samples, .statistics = true}};
    const gradavg::options opts_without_empty{.compute = {.weights = nonzero_samples, .statistics = true}};
    double trace_sum = 0, trace_sq = 0, g2_sum = 0, g2_sq = 0;
    std::size_t unlike_without_empty = 0;
    for (std::size_t step = 0; step < steps; ++step) {
      for (std::size_t k = 0; k < towers; ++k) {
        const double sd = c.samples[k] > 0 ? std::sqrt(sigma2 / c.samples[k]) : 100.0;
        for (double& x : data[k]) x = g + sd * z(gen);
      }
      const gradavg::summary s = gradavg::average_gradients_into(tg, means, opts);
      REQUIRE(s.weighted_towers == weighted);
      const gradavg::noise_estimate e = s.noise(total / static_cast<double>(towers));
      trace_sum += e.trace_covariance;
      trace_sq += e.trace_covariance * e.trace_covariance;
      g2_sum += e.gradient_squared;
      g2_sq += e.gradient_squared * e.gradient_squared;
      if (weighted != towers && step < 50) {
        // The same samples without the empty towers: the same estimates.
        const gradavg::noise_estimate same =
            gradavg::average_gradients_into(without_empty, means, opts_without_empty)
                .noise(total / static_cast<double>(weighted));
        if (e.trace_covariance != Approx(same.trace_covariance).epsilon(1e-12) ||
            e.gradient_squared != Approx(same.gradient_squared).epsilon(1e-12))
          ++unlike_without_empty;
      }
    }
    const double count = static_cast<double>(steps);
    const double trace_mean = trace_sum / count, g2_mean = g2_sum / count;
    const double trace_se = std::sqrt((trace_sq / count - trace_mean * trace_mean) / count);
    const double g2_se = std::sqrt((g2_sq / count - g2_mean * g2_mean) / count);
    INFO("trace_covariance " << trace_mean << " +- " << trace_se << " (true " << true_trace << "), gradient_squared "
                             << g2_mean << " +- " << g2_se << " (true " << true_g2 << ")");
    CHECK(unlike_without_empty == 0);
    CHECK(std::abs(trace_mean - true_trace) <= 5 * trace_se);
    CHECK(std::abs(g2_mean - true_g2) <= 5 * g2_se);
    CHECK(trace_se < 0.02 * true_trace);  // the test can tell a bias of a few percent
    CHECK(g2_se < 0.02 * true_g2);
  }
}

TEST_CASE("the scale meets every input before any sum: a sum overflows where the scaled, weighted sum does") {
  // Two float gradients of 3e38: their sum (6e38) overflows float although their mean fits.
  fused_towers<float> w(2, {3});
  for (auto& tower : w.data) std::fill(tower[0].begin(), tower[0].end(), 3e38f);
  const auto unscaled = run_into(w, {.compute = {.on_nonfinite = gradavg::nonfinite_policy::report}});
  CHECK(std::isinf(unscaled.means[0][0]));
  CHECK(unscaled.summary.nonfinite_variables == 0);  // finite inputs: an overflowed sum, not a bad input
  // Scaled by 0.25 before the sum: 1.5e38, then halved; exact, as 0.25 is a power of two.
  const auto scaled = run_into(w, {.compute = {.scale = 0.25}});
  CHECK(scaled.means[0][0] == 0.25f * 3e38f);
  // Weights enter the same way: w_k * scale meets g_k before the sum, the weight sum divides after.
  const double heavy[] = {4.0, 4.0};
  CHECK(std::isinf(run_into(w, {.compute = {.weights = heavy, .scale = 0.25}}).means[0][0]));
  const double light[] = {0.25, 0.25};
  CHECK(run_into(w, {.compute = {.weights = light}}).means[0][0] == 3e38f);
  // Summed in double, the same sum fits.
  CHECK(run_into(w, {.compute = {.accumulate = gradavg::accumulation::double_precision}}).means[0][0] == 3e38f);

  // Squares: (1e19)^2 = 1e38 on four towers sums to 4e38 unscaled; scale 0.5 squared first: 1e38.
  fused_towers<float> sq(4, {2});
  for (auto& tower : sq.data) std::fill(tower[0].begin(), tower[0].end(), 1e19f);
  CHECK(std::isinf(run_into(sq, {}).squares[0][0]));
  const float want = static_cast<float>(0.25 * 1e19 * 1e19);
  const float got = run_into(sq, {.compute = {.scale = 0.5}}).squares[0][0];
  CHECK(std::abs(got - want) <= 2 * std::numeric_limits<float>::epsilon() * want);

  // bfloat16 inputs near its (float's) largest value, summed in float.
  fused_towers<Eigen::bfloat16> b(2, {3});
  for (auto& tower : b.data) std::fill(tower[0].begin(), tower[0].end(), Eigen::bfloat16(3e38f));
  CHECK(std::isinf(run_into<float>(b, {}).means[0][0]));
  CHECK(run_into<float>(b, {.compute = {.scale = 0.25}}).means[0][0] == 0.25f * static_cast<float>(Eigen::bfloat16(3e38f)));
}

namespace {

/// Counts the means and squares of a weighted, scaled float call outside the documented bound:
/// with u the accumulator's unit roundoff, m = |scale| sum w_k |g_k| / sum w_k and
/// q = scale^2 sum w_k g_k^2 / sum w_k, the mean within 0.5 ulp + (2T + 4) u m of
/// scale sum w_k g_k / sum w_k, the square within 0.5 ulp + (2T + 4) u q of q. The reference is
/// long double (unit roundoff 2^-64): its own error, below (2T + 8) 2^-64 of the same magnitudes,
/// is added to the bound.
std::pair<std::size_t, std::size_t> outside_bound(const std::vector<std::vector<float>>& data,
                                                  const std::vector<double>& weights, double scale,
                                                  const std::vector<float>& means, const std::vector<float>& squares,
                                                  long double u) {
  const long double T = static_cast<long double>(data.size());
  const long double ref_u = std::ldexp(1.0L, -64);
  auto ulp = [](float r) { return std::ldexp(1.0L, std::max(std::ilogb(r), -126) - 23); };
  std::size_t bad_means = 0, bad_squares = 0;
  for (std::size_t j = 0; j < means.size(); ++j) {
    long double sum = 0, mag = 0, sq = 0, wsum = 0;
    for (std::size_t k = 0; k < data.size(); ++k) {
      const long double x = data[k][j], wk = weights[k];
      sum += wk * x;
      mag += wk * std::abs(x);
      sq += wk * x * x;
      wsum += wk;
    }
    const long double c = scale;
    const long double exact = c * sum / wsum, m = std::abs(c) * mag / wsum, q = c * c * sq / wsum;
    const long double slack = (2 * T + 4) * u + (2 * T + 8) * ref_u;
    if (!(std::abs(static_cast<long double>(means[j]) - exact) <= 0.5L * ulp(means[j]) + slack * m)) ++bad_means;
    if (!(std::abs(static_cast<long double>(squares[j]) - q) <= 0.5L * ulp(squares[j]) + slack * q)) ++bad_squares;
  }
  return {bad_means, bad_squares};
}

}  // namespace

TEST_CASE("the accuracy bound with weights and scale: (2T + 4) u |scale| times the weighted mean of |g_k|") {
  // Floats of magnitude in [2^-30, 1) and both signs (cancellation), uneven non-dyadic weights with
  // zeros, scales that are not powers of two.
  for (std::size_t towers : {1, 2, 3, 17, 100, 1024}) {
    const std::size_t n = 67;
    std::mt19937_64 gen(towers + 5);
    std::vector<std::vector<float>> data(towers, std::vector<float>(n));
    for (auto& g : data)
      for (float& x : g) {
        const int e = static_cast<int>(gen() % 30) - 30;
        const auto m = static_cast<double>((gen() % (std::uint64_t{1} << 23)) | (std::uint64_t{1} << 23));
        x = static_cast<float>(std::ldexp(m, e - 23) * ((gen() & 1) ? -1 : 1));
      }
    std::vector<double> weights(towers);
    for (std::size_t k = 0; k < towers; ++k)
      weights[k] = k % 5 == 1 ? 0.0 : 1.0 + static_cast<double>(gen() % 1000) / 7;
    std::vector<std::vector<std::pair<const std::vector<float>*, int>>> tg(towers);
    for (std::size_t k = 0; k < towers; ++k) tg[k].push_back({&data[k], 0});
    for (double scale : {1.0 / 3, -1000.0, 0.1}) {
      for (auto accumulate : {gradavg::accumulation::double_precision, gradavg::accumulation::native}) {
        const bool in_double = accumulate == gradavg::accumulation::double_precision;
        INFO("T = " << towers << ", scale " << scale << (in_double ? ", in double" : ", in float"));
        std::vector<std::vector<float>> means{std::vector<float>(n, -1.0f)}, squares = means;
        gradavg::average_gradients_into(tg, means, squares,
                                        {.compute = {.accumulate = accumulate, .weights = weights, .scale = scale}});
        const auto [bad_means, bad_squares] =
            outside_bound(data, weights, scale, means[0], squares[0], std::ldexp(1.0L, in_double ? -53 : -24));
        CHECK(bad_means == 0);
        CHECK(bad_squares == 0);
      }
    }
  }
}

TEST_CASE("accumulation in double: within half an ulp plus T 2^-53 of the exact mean, T up to 1024") {
  // Inputs: floats of magnitude in [2^-30, 1), so x 2^53 is an integer below 2^53 and the sum of
  // 1024 of them is exact in int64_t. Summed in double, each of T - 1 additions and the division
  // is off by at most 2^-53 of the sum of magnitudes, so d = mean in double satisfies
  // |d - exact| <= T 2^-53 mag with mag = sum |x| / T; rounding d once to float adds half an ulp:
  //   |result - exact| <= 0.5 ulp(result) + T 2^-53 mag.
  // The mean of squares (x^2 exact in double, the reference in long double) likewise, with one
  // more rounding: |result - ref| <= 0.5 ulp(result) + (T + 2) 2^-53 sqmag.
  // Summed in float (accumulation::native), the means miss this bound from T = 3 on.
  for (std::size_t towers : {1, 2, 3, 17, 100, 1024}) {
    INFO("T = " << towers);
    const std::size_t n = 67;
    std::mt19937_64 gen(towers);
    std::vector<std::vector<float>> data(towers, std::vector<float>(n));
    for (auto& g : data)
      for (float& x : g) {
        const int e = static_cast<int>(gen() % 30) - 30;                              // [-30, -1]
        const auto m = static_cast<double>((gen() % (std::uint64_t{1} << 23)) | (std::uint64_t{1} << 23));  // 24 bits
        x = static_cast<float>(std::ldexp(m, e - 23) * ((gen() & 1) ? -1 : 1));
      }
    std::vector<std::vector<std::pair<const std::vector<float>*, int>>> tg(towers);
    for (std::size_t k = 0; k < towers; ++k) tg[k].push_back({&data[k], 0});
    std::vector<std::vector<float>> means{std::vector<float>(n, -1.0f)}, squares = means;
    gradavg::options opts;
    opts.compute.accumulate = gradavg::accumulation::double_precision;
    gradavg::average_gradients_into(tg, means, squares, opts);

    const long double T = static_cast<long double>(towers);
    const long double two53 = std::ldexp(1.0L, 53);
    std::size_t bad_means = 0, bad_squares = 0;
    for (std::size_t j = 0; j < n; ++j) {
      std::int64_t exact = 0;  // sum x 2^53
      long double mag = 0, sq = 0;
      for (const auto& g : data) {
        exact += static_cast<std::int64_t>(std::ldexp(static_cast<long double>(g[j]), 53));
        mag += std::abs(static_cast<long double>(g[j]));
        sq += static_cast<long double>(g[j]) * g[j];
      }
      auto ulp = [](float r) { return std::ldexp(1.0L, std::max(std::ilogb(r), -126) - 23); };
      const float r = means[0][j];
      // |r - exact / (T 2^53)| scaled by T 2^53: r T 2^53 is exact in long double.
      const long double err = std::abs(static_cast<long double>(r) * T * two53 - static_cast<long double>(exact));
      // mag here is sum |x| = T times the mean magnitude.
      const long double bound = (0.5L * ulp(r) + mag / two53) * T * two53;
      if (!(err <= bound) && bad_means++ == 0)
        UNSCOPED_INFO("first bad mean " << j << ": got " << r << ", exact "
                                        << static_cast<double>(static_cast<long double>(exact) / T / two53));
      const float q = squares[0][j];
      const long double qerr = std::abs(static_cast<long double>(q) - sq / T);
      if (!(qerr <= 0.5L * ulp(q) + (T + 2) * (sq / T) / two53) && bad_squares++ == 0)
        UNSCOPED_INFO("first bad square " << j << ": got " << q << ", want " << static_cast<double>(sq / T));
    }
    CHECK(bad_means == 0);
    CHECK(bad_squares == 0);
  }
}

TEST_CASE("accumulation in double with weights and scale, and its statistics") {
  // Weighted: the products and the weight sum add T + 1 roundings in double, the scale one more:
  // within 0.5 ulp + (2T + 4) 2^-53 mag of the long double reference.
  for (std::size_t towers : {3, 33, 200}) {
    INFO("T = " << towers);
    const fused_towers<float> w(towers, {1, 16, 67, 300}, {}, 11);
    const std::vector<double> weights = uneven_weights(towers);
    gradavg::options opts;
    opts.compute.accumulate = gradavg::accumulation::double_precision;
    opts.compute.weights = weights;
    opts.compute.scale = 0.125;
    opts.compute.statistics = true;
    const auto r = run_into(w, opts);
    const auto want = w.expect(weights, 0.125);
    const double tol = fused_tolerance<double>(towers);  // the accumulator's error, before rounding to float
    require_outputs_match(r.means, want, false, tol);
    require_outputs_match(r.squares, want, true, tol);
    require_statistics_match(r, want, tol, w.absent);
  }
}

// ---- Non-finite inputs. ----------------------------------------------------------------------


TEST_CASE("non-finite inputs at the first, last and packet-boundary elements, in any tower, beside a skipped variable") {
  // Variables 1 and 3 are the neighbours of the skipped variable 2.
  const std::vector<std::size_t> sizes{70, 5, 9, 70, 1};
  const std::vector<bool> absent{false, false, true, false, false};
  const std::vector<std::pair<std::size_t, std::vector<std::size_t>>> where{
      {0, {0, 7, 8, 15, 16, 31, 32, 63, 64, 69}}, {1, {0, 4}}, {3, {0, 15, 16, 69}}, {4, {0}}};
  for (std::size_t towers : {1, 3, 17, 33}) {
    INFO("T = " << towers);
    fused_towers<float> w(towers, sizes, absent, 5);
    std::vector<std::size_t> poisoned_towers{0, towers - 1};
    if (towers > 16) poisoned_towers.push_back(16);  // the first tower of the second group of 16
    for (const auto policy : {gradavg::nonfinite_policy::report, gradavg::nonfinite_policy::zero}) {
      gradavg::options opts;
      opts.compute.on_nonfinite = policy;
      opts.compute.statistics = true;
      const auto clean = run_into(w, opts);
      CHECK(clean.summary.nonfinite_variables == 0);
      require_statistics_match(clean, w.expect({}, 1.0), fused_tolerance<float>(towers), absent);
      for (std::size_t tower : poisoned_towers)
        for (const auto& [variable, elements] : where)
          for (std::size_t element : elements)
            for (double value : {nan_value, inf_value, -inf_value}) {
              const poison p{tower, variable, element, value};
              require_poison_handled(clean, run_poisoned(w, p, opts), p, policy, absent);
            }
    }
    // Ignored (the default), with statistics or without: nothing detected, nothing reported.
    const poison p{towers - 1, 3, 16, nan_value};
    for (bool statistics : {false, true}) {
      INFO("policy ignore, statistics " << statistics);
      const auto ignored = run_poisoned(w, p, {.compute = {.on_nonfinite = gradavg::nonfinite_policy::ignore, .statistics = statistics}});
      CHECK(ignored.summary.nonfinite_variables == 0);
      CHECK_FALSE(ignored.summary.nonfinite());
      CHECK(std::isnan(ignored.means[3][16]));
      CHECK(ignored.per_variable[3].nonfinite == untouched_entry.nonfinite);
    }
  }
}

TEST_CASE("a non-finite input on a tower of weight 0 is still detected") {
  fused_towers<float> w(5, {40, 3}, {}, 9);
  const std::vector<double> weights{1, 0, 2, 3, 0};
  gradavg::options opts;
  opts.compute.weights = weights;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
  opts.compute.statistics = true;
  const auto clean = run_into(w, opts);
  for (double value : {nan_value, -nan_value, inf_value, -inf_value}) {  // -NaN: the sign is not kept either
    const poison p{4, 0, 17, value};
    require_poison_handled(clean, run_poisoned(w, p, opts), p, gradavg::nonfinite_policy::report, {false, false}, true);
  }
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  const auto clean_zero = run_into(w, opts);
  const poison p{1, 1, 2, inf_value};
  require_poison_handled(clean_zero, run_poisoned(w, p, opts), p, gradavg::nonfinite_policy::zero, {false, false}, true);
}

TEST_CASE("non-finite inputs at chunk boundaries, with 3 and 8 threads and a pool") {
  // 17 towers of 1000 + 110000 + 3000 floats with means and squares: about 8.7 MB, 8 chunks of at
  // least 1 MiB. Chunks split the flat range at multiples of 1024 elements near total * c / chunks:
  // the positions are both sides of both such multiples for each c, and of each variable boundary.
  const std::size_t towers = 17;
  const std::vector<std::size_t> sizes{1000, 110000, 3000};
  const std::vector<bool> absent(3, false);
  fused_towers<float> w(towers, sizes, absent, 13);
  const std::size_t total = w.flat_size();
  auto positions = [total](std::size_t chunks) {
    std::vector<std::size_t> flat{0, 999, 1000, 110999, 111000, total - 1};
    for (std::size_t c = 1; c < chunks; ++c)
      for (std::size_t b : {total * c / chunks / 1024 * 1024, (total * c / chunks / 1024 + 1) * 1024}) {
        flat.push_back(b - 1);
        flat.push_back(b);
      }
    return flat;
  };
  gradavg::thread_pool pool(3);
  for (const auto policy : {gradavg::nonfinite_policy::report, gradavg::nonfinite_policy::zero}) {
    gradavg::options opts;
    opts.compute.on_nonfinite = policy;
    opts.compute.statistics = true;
    const auto clean = run_into(w, opts);
    for (std::size_t threads : {3, 8, 0}) {
      INFO("threads = " << (threads == 0 ? "pool of 3" : std::to_string(threads)));
      opts.run.threads = threads == 0 ? gradavg::default_threads : threads;
      opts.run.pool = threads == 0 ? &pool : nullptr;
      for (std::size_t flat : positions(threads == 8 ? 8 : 3)) {
        std::size_t variable = 0, element = flat;
        while (element >= sizes[variable]) element -= sizes[variable++];
        const poison p{flat % 2 == 0 ? std::size_t{16} : std::size_t{0}, variable, element,
                       flat % 3 == 0 ? nan_value : (flat % 3 == 1 ? inf_value : -inf_value)};
        require_poison_handled(clean, run_poisoned(w, p, opts), p, policy, absent);
      }
    }
  }
}

TEST_CASE("several non-finite variables are counted once each") {
  fused_towers<float> w(3, {10, 10, 10, 10}, {false, true, false, false}, 21);
  w.data[0][0][3] = std::numeric_limits<float>::quiet_NaN();
  w.data[1][0][4] = std::numeric_limits<float>::infinity();  // same variable again
  w.data[2][3][9] = -std::numeric_limits<float>::infinity();
  const auto r = run_into(w, {.compute = {.on_nonfinite = gradavg::nonfinite_policy::zero}});
  CHECK(r.summary.nonfinite_variables == 2);
  CHECK(r.per_variable[0].nonfinite);
  CHECK(is_untouched(r.per_variable[1]));
  CHECK_FALSE(r.per_variable[2].nonfinite);
  CHECK(r.per_variable[3].nonfinite);
  for (float x : r.means[3]) CHECK(std::bit_cast<std::uint32_t>(x) == 0u);
}

TEST_CASE("overflow of a sum of finite inputs is not a non-finite input") {
  fused_towers<float> w(4, {20});
  for (auto& tower : w.data) std::fill(tower[0].begin(), tower[0].end(), std::numeric_limits<float>::max());
  const auto r = run_into(w, {.compute = {.on_nonfinite = gradavg::nonfinite_policy::zero}});
  CHECK(r.summary.nonfinite_variables == 0);
  CHECK_FALSE(r.per_variable[0].nonfinite);
  CHECK(std::isinf(r.squares[0][0]));  // what IEEE arithmetic gives, not zeroed
}

TEST_CASE("a non-finite input beside sums that overflowed is still found, in the same step or after") {
  // The sums of finite inputs overflow on elements [0, 40) of variable 0 (in every group of 16
  // towers); one NaN or +-Inf input sits in the same step, in a later step, in a later group of
  // towers or in the next variable. Overflow alone is not reported (the case above, and below).
  const float big = std::numeric_limits<float>::max();
  for (std::size_t towers : {4, 17, 33}) {
    for (bool weighted : {false, true}) {
      INFO("T = " << towers << (weighted ? ", weighted" : ""));
      fused_towers<float> w(towers, {300, 50}, {}, 31);
      for (auto& tower : w.data) std::fill(tower[0].begin(), tower[0].begin() + 40, big);
      const std::vector<double> weights = weighted ? uneven_weights(towers) : std::vector<double>{};
      gradavg::options opts{.compute = {.weights = weights, .on_nonfinite = gradavg::nonfinite_policy::report, .statistics = true}};
      const auto overflowed = run_into(w, opts);
      CHECK(overflowed.summary.nonfinite_variables == 0);
      CHECK(std::isinf(overflowed.means[0][0]));
      const std::vector<poison> poisons{{towers - 1, 0, 3, nan_value},     {0, 0, 39, inf_value},
                                        {towers / 2, 0, 41, -inf_value},  {towers - 1, 0, 299, nan_value},
                                        {towers - 1, 1, 0, inf_value}};
      for (const poison& p : poisons) {
        INFO("tower " << p.tower << ", variable " << p.variable << ", element " << p.element);
        const auto r = run_poisoned(w, p, opts);
        CHECK(r.summary.nonfinite_variables == 1);
        CHECK(r.per_variable[p.variable].nonfinite);
        CHECK_FALSE(r.per_variable[1 - p.variable].nonfinite);
      }
    }
  }
}

// ---- Partial ranges and flat outputs. ----------------------------------------------------------

TEST_CASE("buckets of the flat range: together the same outputs as one full call, nothing outside written") {
  const std::vector<std::size_t> sizes{37, 1, 4, 200, 64, 9000};
  const std::vector<bool> absent{false, false, true, false, false, false};
  const fused_towers<float> w(5, sizes, absent, 17);
  const std::size_t total = w.flat_size();  // 9302
  const std::vector<double> weights{1, 2, 0.5, 3, 1};
  gradavg::options opts;
  opts.compute.weights = weights;
  opts.compute.scale = 0.25;
  opts.compute.statistics = true;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
  const auto full = run_into(w, opts);
  const double tol = fused_tolerance<float>(5);
  require_outputs_match(full.means, w.expect(weights, 0.25), false, tol);

  // Cut points: inside a variable, at variable boundaries, an empty bucket, the end.
  const std::vector<std::size_t> cuts{0, 10, 37, 38, 38, 100, 238, 239, 302, 5000, total};
  for (std::size_t threads : {1, 3}) {
    INFO("threads = " << threads);
    fused_run<float> together = run_into(w, {});  // outputs to fill bucket by bucket
    for (auto& m : together.means) std::fill(m.begin(), m.end(), sentinel_value<float>);
    for (auto& m : together.squares) std::fill(m.begin(), m.end(), sentinel_value<float>);
    for (std::size_t b = 0; b + 1 < cuts.size(); ++b) {
      INFO("bucket [" << cuts[b] << ", " << cuts[b + 1] << ")");
      opts.run.threads = threads;
      opts.compute.range = {cuts[b], cuts[b + 1]};
      const auto bucket = run_into(w, opts);
      const auto want = w.expect(weights, 0.25, cuts[b], cuts[b + 1]);
      // In range: bitwise the full call's; outside: the sentinel.
      require_outputs_match(bucket.means, want, false, tol);
      require_outputs_match(bucket.squares, want, true, tol);
      std::size_t in_range_variables = 0;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        if (absent[i] || want[i].end == want[i].begin) continue;
        ++in_range_variables;
        const std::size_t b0 = want[i].begin, n = want[i].end - want[i].begin;
        CHECK(std::memcmp(bucket.means[i].data() + b0, full.means[i].data() + b0, n * sizeof(float)) == 0);
        CHECK(std::memcmp(bucket.squares[i].data() + b0, full.squares[i].data() + b0, n * sizeof(float)) == 0);
        CHECK_FALSE(bucket.per_variable[i].nonfinite);
      }
      CHECK(bucket.summary.averaged == in_range_variables);
      require_statistics_match(bucket, want, tol, absent);

      // The same bucket into outputs shared by every bucket.
      opts.compute.per_variable = {};
      gradavg::average_gradients_into(w.tg, together.means, together.squares, opts);
    }
    CHECK(same_bits_all(together.means, full.means));
    CHECK(same_bits_all(together.squares, full.squares));
  }
}

TEST_CASE("a range is clamped to the flat total, and non-finite inputs outside it are not seen") {
  fused_towers<float> w(3, {50, 50}, {}, 19);
  gradavg::options opts;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  opts.compute.statistics = true;
  w.data[1][0][10] = std::numeric_limits<float>::quiet_NaN();  // outside [20, 70)
  opts.compute.range = {20, 70};
  const auto r = run_into(w, opts);
  CHECK(r.summary.nonfinite_variables == 0);
  CHECK_FALSE(r.per_variable[0].nonfinite);
  CHECK(r.means[0][10] == sentinel_value<float>);
  w.data[1][1][19] = std::numeric_limits<float>::infinity();  // flat 69: inside
  const auto r2 = run_into(w, opts);
  CHECK(r2.summary.nonfinite_variables == 1);
  CHECK(r2.per_variable[1].nonfinite);
  for (std::size_t j = 0; j < 20; ++j) CHECK(std::bit_cast<std::uint32_t>(r2.means[1][j]) == 0u);
  for (std::size_t j = 20; j < 50; ++j) CHECK(r2.means[1][j] == sentinel_value<float>);
  w.data[1][1][19] = 0.5f;
  w.data[1][0][10] = 0.5f;

  opts.compute.range = {60, std::numeric_limits<std::size_t>::max() - 1};  // end clamped to 100
  const auto tail = run_into(w, opts);
  CHECK(tail.summary.averaged == 1);
  CHECK(tail.summary.shard.begin == 60);  // the elements written: the range, clamped
  CHECK(tail.summary.shard.end == 100);
  CHECK(is_untouched(tail.per_variable[0]));
  require_outputs_match(tail.means, w.expect({}, 1.0, 60, 100), false, fused_tolerance<float>(3));
  opts.compute.range = {100, 100};
  const auto none = run_into(w, opts);
  CHECK(none.summary.averaged == 0);
  CHECK(none.summary.sum_mean_squared == 0);
  CHECK(is_untouched(none.per_variable[0]));
  CHECK(is_untouched(none.per_variable[1]));
  opts.compute.range = {150, 200};  // both clamped to 100
  const auto past = run_into(w, opts);
  CHECK(past.summary.averaged == 0);
  CHECK(past.summary.shard.begin == 100);
  CHECK(past.summary.shard.end == 100);
}

TEST_CASE("zero policy on a bucket over many segments: only the bucket's elements of the flagged variable are zeroed") {
  // 703,000 elements: the flat range is cut into segments larger than the split granularity.
  fused_towers<float> w(2, {3000, 700000}, {}, 47);
  w.data[1][1][400000] = std::numeric_limits<float>::quiet_NaN();
  gradavg::options opts;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  opts.compute.statistics = true;
  opts.compute.range = {2000, 600000};
  for (std::size_t threads : {1, 3}) {
    INFO("threads = " << threads);
    opts.run.threads = threads;
    const auto r = run_into(w, opts);
    CHECK(r.summary.nonfinite_variables == 1);
    CHECK_FALSE(r.per_variable[0].nonfinite);
    CHECK(r.per_variable[1].nonfinite);
    const auto want0 = expect_fused<float>(w.tower_ptrs(0), 2000, 3000, {}, 1.0);  // variable 0's part
    CHECK(first_fused_mismatch(r.means[0].data(), want0, false, fused_tolerance<float>(2)) == 3000);
    CHECK(std::count(r.means[0].begin(), r.means[0].begin() + 2000, sentinel_value<float>) == 2000);
    const auto& m = r.means[1];
    CHECK(std::count_if(m.begin(), m.begin() + 597000, [](float x) { return std::bit_cast<std::uint32_t>(x) != 0; }) == 0);
    CHECK(std::count_if(m.begin() + 597000, m.end(), [](float x) { return x != sentinel_value<float>; }) == 0);
    CHECK(r.summary.sum_mean_squared == Approx(want0.sum_mean_squared).epsilon(1e-6));
  }
}

TEST_CASE("in place (means into tower 0's gradients) with every fused option: the same bits as out of place") {
  for (std::size_t threads : {1, 3}) {
    INFO("threads = " << threads);
    fused_towers<float> w(5, {7, 64, 300000, 33}, {}, 53);
    w.data[3][3][5] = -std::numeric_limits<float>::infinity();
    const std::vector<double> weights{1, 2, 0, 4, 1};
    gradavg::options opts;
    opts.compute.weights = weights;
    opts.compute.scale = 0.5;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
    opts.compute.statistics = true;
    opts.run.threads = threads;
    const auto apart = run_into(w, opts, false);
    std::vector<gradavg::variable_statistics> entries(4, untouched_entry);
    opts.compute.per_variable = entries;
    std::vector<std::vector<float>*> in_place;
    for (auto& g : w.data[0]) in_place.push_back(&g);
    const auto s = gradavg::average_gradients_into(w.tg, in_place, opts);
    CHECK(same_bits_all(w.data[0], apart.means));
    CHECK(s.nonfinite_variables == 1);
    CHECK(entries[3].nonfinite);
    CHECK(same_double_bits(s.sum_mean_squared, apart.summary.sum_mean_squared));
  }
}

TEST_CASE("outputs and statistics do not depend on the outputs' alignment, with streaming stores or not") {
  for (std::size_t towers : {1, 3, 17}) {
    const fused_towers<float> w(towers, {1000}, {}, 59);
    gradavg::options opts;
    opts.compute.scale = 0.3;
    opts.compute.statistics = true;
    const auto first = run_into(w, opts);
    for (bool streaming : {false, true})
      for (std::size_t offset = 0; offset < 16; ++offset) {
        INFO("T = " << towers << ", streaming " << streaming << ", outputs " << offset << " floats past 64 bytes");
        gradavg_test::buffer<float> mean(1000, offset, -1.0f), square(1000, offset, -1.0f);
        std::vector<std::span<float>> means{std::span(mean.data(), 1000)}, squares{std::span(square.data(), 1000)};
        opts.run.stores = streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
        const auto s = gradavg::average_gradients_into(w.tg, means, squares, opts);
        CHECK(std::memcmp(mean.data(), first.means[0].data(), 1000 * sizeof(float)) == 0);
        CHECK(std::memcmp(square.data(), first.squares[0].data(), 1000 * sizeof(float)) == 0);
        CHECK(same_double_bits(s.sum_mean_squared, first.summary.sum_mean_squared));
        CHECK(same_double_bits(s.sum_mean_of_squares, first.summary.sum_mean_of_squares));
        CHECK(mean.surroundings_intact());
      }
  }
}

TEST_CASE("flat outputs for matrix gradients are accepted, a transposed shape is not") {
  Eigen::MatrixXf a0 = Eigen::MatrixXf::Random(3, 4), a1 = Eigen::MatrixXf::Random(3, 4);
  using row_major = Eigen::Matrix<float, 3, 4, Eigen::RowMajor>;
  const row_major b0 = row_major::Random(), b1 = row_major::Random();
  const std::vector<std::vector<std::pair<const Eigen::MatrixXf*, int>>> ta{{{&a0, 0}}, {{&a1, 0}}};
  const std::vector<std::vector<std::pair<const row_major*, int>>> tb{{{&b0, 0}}, {{&b1, 0}}};
  const std::vector<double> weights{1, 3};
  gradavg::options opts;
  opts.compute.weights = weights;
  opts.compute.scale = 2;

  // One flat bucket buffer holding both variables' means, in each gradient's storage order.
  std::vector<float> bucket(24, -1.0f), bucket_squares(24, -1.0f);
  std::vector<std::span<float>> means{std::span(bucket).first(12)}, squares{std::span(bucket_squares).first(12)};
  gradavg::average_gradients_into(ta, means, squares, opts);
  std::vector<std::span<float>> means_b{std::span(bucket).subspan(12)};
  gradavg::average_gradients_into(tb, means_b, opts);
  const double tol = fused_tolerance<float>(2);
  const auto wa = expect_fused<float>({a0.data(), a1.data()}, 0, 12, weights, 2.0);
  const auto wb = expect_fused<float>({b0.data(), b1.data()}, 0, 12, weights, 2.0);
  CHECK(gradavg_test::first_fused_mismatch(bucket.data(), wa, false, tol) == 12);
  CHECK(gradavg_test::first_fused_mismatch(bucket_squares.data(), wa, true, tol) == 12);
  CHECK(gradavg_test::first_fused_mismatch(bucket.data() + 12, wb, false, tol) == 12);
  CHECK(bucket_squares[12] == -1.0f);

  // A flat gradient into a 3x4 matrix, and a 12x1 column vector output: accepted.
  const std::vector<float> g0(12, 1.0f), g1(12, 3.0f);
  const std::vector<std::vector<std::pair<const std::vector<float>*, int>>> tv{{{&g0, 0}}, {{&g1, 0}}};
  Eigen::MatrixXf m(3, 4);
  Eigen::VectorXf v(12);
  std::vector<Eigen::MatrixXf*> into_m{&m};
  std::vector<Eigen::VectorXf*> into_v{&v};
  gradavg::average_gradients_into(tv, into_m, opts);
  gradavg::average_gradients_into(tv, into_v, opts);
  CHECK((m.array() == 5.0f).all());  // (1 + 3 * 3) / 4 * 2
  CHECK((v.array() == 5.0f).all());

  // Transposed (4x3 for 3x4), the other storage order, or another count: rejected, untouched.
  Eigen::MatrixXf t = Eigen::MatrixXf::Constant(4, 3, -2.0f);
  std::vector<Eigen::MatrixXf*> into_t{&t};
  CHECK_THROWS_AS(gradavg::average_gradients_into(ta, into_t, opts), gradavg::output_error);
  CHECK((t.array() == -2.0f).all());
  row_major r = row_major::Constant(-2.0f);
  std::vector<row_major*> into_r{&r};
  CHECK_THROWS_AS(gradavg::average_gradients_into(ta, into_r, opts), gradavg::output_error);
  CHECK((r.array() == -2.0f).all());
  std::vector<float> short_flat(11, -2.0f);
  std::vector<std::span<float>> into_short{std::span(short_flat)};
  CHECK_THROWS_AS(gradavg::average_gradients_into(ta, into_short, opts), gradavg::output_error);
  CHECK(short_flat == std::vector<float>(11, -2.0f));
}

// ---- Validation. ------------------------------------------------------------------------------

namespace {

/// Three towers of three variables; requires both APIs to throw E for opts and the _into call
/// to leave outputs and per_variable entries bitwise untouched; returns the message.
template <class E>
std::string both_throw(gradavg::options opts, bool allocating_too = true) {
  const fused_towers<float> w(3, {5, 3, 8}, {}, 23);
  auto r = run_into(w, {});
  for (auto* outs : {&r.means, &r.squares})
    for (auto& o : *outs) std::fill(o.begin(), o.end(), -42.0f);
  const auto means_before = r.means, squares_before = r.squares;
  std::vector<gradavg::variable_statistics> entries(3, untouched_entry);
  if (opts.compute.per_variable.empty()) opts.compute.per_variable = entries;
  std::string msg = message_of<E>([&] { gradavg::average_gradients_into(w.tg, r.means, r.squares, opts); });
  CHECK(same_bits_all(r.means, means_before));
  CHECK(same_bits_all(r.squares, squares_before));
  for (const auto& e : entries) CHECK(is_untouched(e));
  std::string means_only = message_of<E>([&] { gradavg::average_gradients_into(w.tg, r.means, opts); });
  CHECK(means_only == msg);
  CHECK(same_bits_all(r.means, means_before));
  if (allocating_too) {
    CHECK_THROWS_AS(gradavg::average_gradients(w.tg, gradavg::include_square, opts), E);
  }
  return msg;
}

}  // namespace

TEST_CASE("bad weights (wrong count, NaN, infinite, negative, zero or infinite sum) name the tower") {
  STATIC_REQUIRE(std::is_base_of_v<gradavg::option_error, gradavg::weight_error>);
  STATIC_REQUIRE(std::is_base_of_v<gradavg::error, gradavg::option_error>);
  const std::vector<double> two{1, 1}, four{1, 1, 1, 1};
  CHECK(contains(both_throw<gradavg::weight_error>({.compute = {.weights = two}}), "2"));
  CHECK(contains(both_throw<gradavg::weight_error>({.compute = {.weights = four}}), "4"));
  const std::vector<double> nan_1{1, nan_value, 1}, inf_0{inf_value, 1, 1}, negative_2{1, 1, -0.5};
  CHECK(contains(both_throw<gradavg::weight_error>({.compute = {.weights = nan_1}}), "tower 1"));
  CHECK(contains(both_throw<gradavg::weight_error>({.compute = {.weights = inf_0}}), "tower 0"));
  CHECK(contains(both_throw<gradavg::weight_error>({.compute = {.weights = negative_2}}), "tower 2"));
  const std::vector<double> zeros{0, 0, 0}, huge{1e308, 1e308, 1e308};
  both_throw<gradavg::weight_error>({.compute = {.weights = zeros}});
  both_throw<gradavg::weight_error>({.compute = {.weights = huge}});
  const std::vector<double> negative_zero{-0.0, 1, 1};  // -0 is not negative: accepted
  const fused_towers<float> w(3, {5});
  CHECK_NOTHROW(run_into(w, {.compute = {.weights = negative_zero}}));
}

TEST_CASE("weights and scale must be representable in the accumulator type") {
  // Summed in float: a weight or scale beyond FLT_MAX, or a weight sum below FLT_MIN (a divisor that
  // would round to 0 or a subnormal), is an error; summed in double the same options are valid.
  const std::vector<double> large{1e39, 1, 1}, tiny{1e-50, 0, 0};
  CHECK(contains(both_throw<gradavg::weight_error>({.compute = {.weights = large}}), "tower 0"));
  both_throw<gradavg::weight_error>({.compute = {.weights = tiny}});
  both_throw<gradavg::option_error>({.compute = {.scale = 1e39}});
  both_throw<gradavg::option_error>({.compute = {.scale = -1e39}});
  const fused_towers<float> w(3, {5, 40});
  for (const auto& weights : {large, tiny}) {
    INFO("weights " << weights[0] << ", " << weights[1] << ", " << weights[2] << ", accumulated in double");
    gradavg::options opts;
    opts.compute.accumulate = gradavg::accumulation::double_precision;
    opts.compute.weights = weights;
    const auto r = run_into(w, opts);
    require_outputs_match(r.means, w.expect(weights, 1.0), false, fused_tolerance<double>(3));
    require_outputs_match(r.squares, w.expect(weights, 1.0), true, fused_tolerance<double>(3));
  }
  const fused_towers<double> d(3, {5, 40});
  const auto r = run_into(d, {.compute = {.scale = 1e39}});
  require_outputs_match(r.means, d.expect({}, 1e39), false, fused_tolerance<double>(3));
}

TEST_CASE("bad scale, begin > end, per_variable of the wrong size") {
  for (double scale : {nan_value, inf_value, -inf_value}) {
    INFO("scale " << scale);
    both_throw<gradavg::option_error>({.compute = {.scale = scale}});
  }
  gradavg::options reversed;
  reversed.compute.range = {5, 4};
  both_throw<gradavg::option_error>(reversed, false);
  std::vector<gradavg::variable_statistics> two(2, untouched_entry), four(4, untouched_entry);
  both_throw<gradavg::option_error>({.compute = {.per_variable = two}});
  both_throw<gradavg::option_error>({.compute = {.per_variable = four}});
  for (const auto& e : two) CHECK(is_untouched(e));
  for (const auto& e : four) CHECK(is_untouched(e));
  // The allocating API holds whole variables: any range but the default is an error there.
  const fused_towers<float> w(3, {5, 3, 8});
  gradavg::options bucket;
  bucket.compute.range = {0, 5};
  CHECK_THROWS_AS(gradavg::average_gradients(w.tg, bucket), gradavg::option_error);
  bucket.compute.range = {0, 16};
  CHECK_THROWS_AS(gradavg::average_gradients(w.tg, bucket), gradavg::option_error);
}

TEST_CASE("an option that holds none of its enumeration's values is an option_error naming it") {
  // Integers cast to the options' enumerations, one past the last named value and far beyond it.
  for (unsigned bad : {2u, 3u, 7u, 255u}) {
    INFO("value " << bad);
    const auto as = [&]<class E>(E) { return static_cast<E>(static_cast<std::underlying_type_t<E>>(bad)); };
    gradavg::options opts;  // accumulation has two values, the others three
    opts.compute.accumulate = as(gradavg::accumulation{});
    CHECK(contains(both_throw<gradavg::option_error>(opts), "options.compute.accumulate"));
    if (bad >= 3) {
      opts = {};
      opts.compute.on_nonfinite = as(gradavg::nonfinite_policy{});
      CHECK(contains(both_throw<gradavg::option_error>(opts), "options.compute.on_nonfinite"));
      opts = {};
      opts.run.stores = as(gradavg::store_policy{});
      CHECK(contains(both_throw<gradavg::option_error>(opts), "options.run.stores"));
      opts = {};
      opts.check.aliasing = as(gradavg::alias_check{});
      CHECK(contains(both_throw<gradavg::option_error>(opts), "options.check.aliasing"));
    }
  }
  // A plan's later call checks them too, and the plan is emptied by the failure.
  const fused_towers<float> w(3, {5, 3, 8}, {}, 23);
  auto means = w.outputs<float>(0.0f);
  gradavg::plan plan;
  gradavg::average_gradients_into(plan, w.tg, means);
  const auto before = means;
  gradavg::options bad;
  bad.compute.on_nonfinite = static_cast<gradavg::nonfinite_policy>(7);
  CHECK_THROWS_AS(gradavg::average_gradients_into(plan, w.tg, means, bad), gradavg::option_error);
  CHECK(same_bits_all(means, before));
  CHECK_FALSE(plan.ready());
}

TEST_CASE("weights held in an output are an aliasing_error naming the variable, in a gradient they are read") {
  fused_towers<double> w(3, {5, 3, 8}, {}, 29);
  w.data[1][2][0] = 0.5;  // the weights read from a gradient at the end
  w.data[1][2][1] = 1.5;
  w.data[1][2][2] = 1.0;
  auto r = run_into(w, {});
  for (auto* outs : {&r.means, &r.squares})
    for (auto& o : *outs) std::fill(o.begin(), o.end(), 2.0);  // also the weights below: 2, 2, 2
  const auto means_before = r.means, squares_before = r.squares;
  for (std::size_t variable : {0u, 2u})
    for (auto* outs : {&r.means, &r.squares}) {
      const std::span<const double> inside((*outs)[variable].data() + 1, 3);
      INFO("weights inside variable " << variable << "'s " << (outs == &r.means ? "means" : "squares"));
      for (auto aliasing : {gradavg::alias_check::all, gradavg::alias_check::same_variable}) {
        gradavg::options opts;
        opts.compute.weights = inside;
        opts.check.aliasing = aliasing;
        const std::string m = message_of<gradavg::aliasing_error>(
            [&] { gradavg::average_gradients_into(w.tg, r.means, r.squares, opts); });
        CHECK(contains(m, "variable #" + std::to_string(variable)));
        CHECK(contains(m, outs == &r.means ? "the means output overlaps options.compute.weights"
                                           : "the squares output overlaps options.compute.weights"));
        CHECK(same_bits_all(r.means, means_before));
        CHECK(same_bits_all(r.squares, squares_before));
        // With a plan: proved over other weights first, then the same buffers with these.
        gradavg::plan plan;
        const std::vector<double> apart{2, 2, 2};
        opts.compute.weights = apart;
        auto means = r.means, squares = r.squares;
        gradavg::average_gradients_into(plan, w.tg, means, squares, opts);
        means = means_before;  // the same buffers, holding the weights 2, 2, 2 again
        squares = squares_before;
        const auto planned_means = means;
        opts.compute.weights = std::span<const double>(((outs == &r.means ? means : squares)[variable]).data() + 1, 3);
        CHECK_THROWS_AS(gradavg::average_gradients_into(plan, w.tg, means, squares, opts), gradavg::aliasing_error);
        CHECK(same_bits_all(means, planned_means));
      }
    }
  // Weights read from a gradient buffer: nothing is written there, so the call is valid, and
  // gives what the same weights in a buffer of their own give.
  const std::vector<double> copied(w.data[1][2].begin(), w.data[1][2].begin() + 3);
  gradavg::options in_gradient;
  in_gradient.compute.weights = std::span<const double>(w.data[1][2].data(), 3);
  gradavg::options own;
  own.compute.weights = copied;
  require_same_bits(run_into(w, in_gradient), run_into(w, own));
}

TEST_CASE("the allocating API honours every option and reports the summary") {
  const std::vector<std::size_t> sizes{3, 70, 4, 1025};
  const std::vector<bool> absent{false, false, true, false};
  fused_towers<float> w(6, sizes, absent, 29);
  w.data[5][3][700] = std::numeric_limits<float>::infinity();
  const std::vector<double> weights{1, 2, 3, 4, 5, 6};
  gradavg::options opts;
  opts.compute.weights = weights;
  opts.compute.scale = 0.5;
  opts.compute.statistics = true;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  const auto into = run_into(w, opts);
  std::vector<gradavg::variable_statistics> entries(4, untouched_entry);
  opts.compute.per_variable = entries;
  const auto result = gradavg::average_gradients(w.tg, gradavg::include_square, opts);

  REQUIRE(result.gradients.size() == 3);
  REQUIRE(result.squares.size() == 3);
  const std::size_t kept[] = {0, 1, 3};
  for (std::size_t s = 0; s < 3; ++s) {
    const std::size_t i = kept[s];
    INFO("variable " << i);
    CHECK(result.gradients[s].second == static_cast<int>(i));
    CHECK(same_bits_all(result.gradients[s].first, into.means[i]));
    CHECK(same_bits_all(result.squares[s].first, into.squares[i]));
    CHECK(entries[i].nonfinite == (i == 3));
  }
  const auto& zeroed = result.gradients[2].first;
  CHECK(std::count_if(zeroed.begin(), zeroed.end(), [](float x) { return std::bit_cast<std::uint32_t>(x) != 0u; }) == 0);
  CHECK(is_untouched(entries[2]));
  CHECK(result.report.averaged == 3);
  CHECK(result.report.skipped == 1);
  CHECK(result.report.nonfinite_variables == 1);
  CHECK(result.report.towers == 6);
  // Variable 3 is zeroed: its statistics are 0 and the summary holds variables 0 and 1 only.
  const fused_run<float> as_run{{}, {}, entries, result.report};
  require_statistics_match(as_run, w.expect(weights, 0.5), fused_tolerance<float>(6), absent, {3});
}

// ---- Threads. -----------------------------------------------------------------------------------


TEST_CASE("bitwise identical outputs and statistics for 1, 2, 3 and 8 threads and a thread_pool") {
  // Sizes: 8 chunks of at least 1 MiB at T = 3 (20 bytes an element) need 420,000 elements.
  const std::vector<std::size_t> sizes{3, 100003, 17, 250001, 1, 65536, 8, 40000};
  const std::vector<bool> absent{false, false, false, false, false, false, true, false};
  SECTION("float, T = 3, weights, scale, detection") {
    const fused_towers<float> w(3, sizes, absent, 31);
    const std::vector<double> weights{3, 1, 2};
    gradavg::options opts;
    opts.compute.weights = weights;
    opts.compute.scale = 1.0 / 3;
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
    require_same_for_every_thread_count(w, opts, fused_tolerance<float>(3));
  }
  SECTION("float, T = 17, accumulated in double") {
    const fused_towers<float> w(17, {5, 70001, 33, 40000}, {}, 37);
    gradavg::options opts;
    opts.compute.accumulate = gradavg::accumulation::double_precision;
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
    require_same_for_every_thread_count(w, opts, fused_tolerance<double>(17));
  }
  SECTION("double, T = 33, weights") {
    const fused_towers<double> w(33, {1, 20000, 63, 9000}, {}, 41);
    const std::vector<double> weights = uneven_weights(33);
    gradavg::options opts;
    opts.compute.weights = weights;
    opts.compute.scale = 4;
    opts.compute.statistics = true;
    require_same_for_every_thread_count(w, opts, fused_tolerance<double>(33));
  }
  SECTION("a bucket of the range, T = 8") {
    const fused_towers<float> w(8, {1000, 200000, 7}, {}, 43);
    gradavg::options opts;
    opts.compute.statistics = true;
    opts.compute.range = {500, 180000};
    opts.run.threads = 1;
    const auto serial = run_into(w, opts);
    require_statistics_match(serial, w.expect({}, 1.0, 500, 180000), fused_tolerance<float>(8), w.absent);
    for (std::size_t threads : {2, 3, 8}) {
      INFO("threads = " << threads);
      opts.run.threads = threads;
      require_same_bits(serial, run_into(w, opts));
    }
  }
}
