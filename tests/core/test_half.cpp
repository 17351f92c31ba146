// 16-bit gradients: Eigen::half and Eigen::bfloat16 in std::vector, std::span and Eigen::Matrix,
// summed in float, written as the 16-bit type or as float (mixed precision). Every output is the
// long double reference (fused_reference.hpp) rounded once, to nearest even, by the test's own
// rounding; with weights, scale, statistics and non-finite detection; bitwise the same for any
// thread count.
#include <gradavg/eigen.hpp>
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <bit>
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

#include "catch.hpp"
#include "fused_reference.hpp"
#include "fused_support.hpp"
#include "support.hpp"

namespace {

using namespace gradavg_test;  // fused_reference.hpp, fused_support.hpp, support.hpp
using half = Eigen::half;
using bf16 = Eigen::bfloat16;

/// The sweep of sizes around the packet widths (1 to 70 elements, and 1000) with a skipped
/// variable, T towers, uneven weights, a loss scale, statistics and detection: outputs of type O.
template <class S, class O>
void check_sweep(std::size_t towers) {
  INFO("T = " << towers << ", outputs " << (std::is_same_v<O, float> ? "float" : "16-bit"));
  std::vector<std::size_t> sizes;
  for (std::size_t n = 1; n <= 70; ++n) sizes.push_back(n);
  sizes.push_back(1000);
  std::vector<bool> absent(sizes.size(), false);
  absent[33] = true;
  const fused_towers<S> w(towers, sizes, absent, static_cast<std::uint32_t>(100 + towers));
  const std::vector<double> weights = uneven_weights(towers);
  gradavg::options opts;
  opts.compute.weights = weights;
  opts.compute.scale = 1.0 / 8;
  opts.compute.statistics = true;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
  const auto r = run_into<O>(w, opts);
  const auto want = w.expect(weights, opts.compute.scale);
  const double tol = fused_tolerance<float>(towers);  // summed in float, then rounded once to O
  require_outputs_match(r.means, want, false, tol);
  require_outputs_match(r.squares, want, true, tol);
  require_statistics_match(r, want, tol, absent);
  CHECK(r.summary.averaged == sizes.size() - 1);
  CHECK(r.summary.nonfinite_variables == 0);

  // Without weights and scale: the plain mean, rounded once.
  const auto plain = run_into<O>(w, {});
  require_outputs_match(plain.means, w.expect({}, 1.0), false, tol);
  require_outputs_match(plain.squares, w.expect({}, 1.0), true, tol);
}

/// w's gradients as (std::span<const S>, variable) entries, averaged into std::span<O> outputs.
template <class O, class S>
fused_run<O> run_spans(const fused_towers<S>& w, gradavg::options opts) {
  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(w.towers());
  for (std::size_t k = 0; k < w.towers(); ++k)
    for (std::size_t i = 0; i < w.variables(); ++i)
      tg[k].push_back({std::span<const S>(w.data[k][i]), static_cast<int>(i)});
  fused_run<O> r;
  r.means = w.template outputs<O>(sentinel_value<O>);
  r.squares = w.template outputs<O>(sentinel_value<O>);
  std::vector<std::span<O>> means, squares;
  for (std::size_t i = 0; i < w.variables(); ++i) {
    means.push_back(std::span<O>(r.means[i]));
    squares.push_back(std::span<O>(r.squares[i]));
  }
  r.per_variable.assign(w.variables(), untouched_entry);
  opts.compute.per_variable = r.per_variable;
  r.summary = gradavg::average_gradients_into(tg, means, squares, opts);
  return r;
}

/// w's gradients copied into column-major Eigen matrices of (n / 3) x 3 where n divides by 3 and
/// n x 1 otherwise, averaged into Eigen matrices of O; the results copied back in storage order.
template <class O, class S>
fused_run<O> run_matrices(const fused_towers<S>& w, gradavg::options opts) {
  using in_matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;
  using out_matrix = Eigen::Matrix<O, Eigen::Dynamic, Eigen::Dynamic>;
  auto shape = [](std::size_t n) {
    return n % 3 == 0 ? std::pair<Eigen::Index, Eigen::Index>(static_cast<Eigen::Index>(n / 3), 3)
                      : std::pair<Eigen::Index, Eigen::Index>(static_cast<Eigen::Index>(n), 1);
  };
  std::vector<std::vector<in_matrix>> grads(w.towers());
  std::vector<std::vector<std::pair<const in_matrix*, int>>> tg(w.towers());
  for (std::size_t k = 0; k < w.towers(); ++k) {
    for (std::size_t i = 0; i < w.variables(); ++i) {
      const auto [rows, cols] = shape(w.sizes[i]);
      grads[k].push_back(Eigen::Map<const in_matrix>(w.data[k][i].data(), rows, cols));
    }
    for (std::size_t i = 0; i < w.variables(); ++i) tg[k].push_back({&grads[k][i], static_cast<int>(i)});
  }
  std::vector<out_matrix> means, squares;
  for (std::size_t i = 0; i < w.variables(); ++i) {
    const auto [rows, cols] = shape(w.sizes[i]);
    means.push_back(out_matrix::Constant(rows, cols, sentinel_value<O>));
    squares.push_back(out_matrix::Constant(rows, cols, sentinel_value<O>));
  }
  fused_run<O> r;
  r.per_variable.assign(w.variables(), untouched_entry);
  opts.compute.per_variable = r.per_variable;
  r.summary = gradavg::average_gradients_into(tg, means, squares, opts);
  for (std::size_t i = 0; i < w.variables(); ++i) {
    r.means.emplace_back(means[i].data(), means[i].data() + means[i].size());
    r.squares.emplace_back(squares[i].data(), squares[i].data() + squares[i].size());
  }
  return r;
}

/// The span and Eigen families against the reference and bitwise against std::vector's results.
template <class S, class O>
void check_families(std::size_t towers) {
  INFO("T = " << towers << ", outputs " << (std::is_same_v<O, float> ? "float" : "16-bit"));
  const fused_towers<S> w(towers, {1, 7, 16, 33, 64, 65, 300}, {}, static_cast<std::uint32_t>(200 + towers));
  const std::vector<double> weights = uneven_weights(towers);
  gradavg::options opts;
  opts.compute.weights = weights;
  opts.compute.scale = 4;
  opts.compute.statistics = true;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  const auto want = w.expect(weights, 4);
  const double tol = fused_tolerance<float>(towers);
  const auto vectors = run_into<O>(w, opts);
  const auto spans = run_spans<O>(w, opts);
  const auto matrices = run_matrices<O>(w, opts);
  {
    INFO("std::span");
    require_outputs_match(spans.means, want, false, tol);
    require_outputs_match(spans.squares, want, true, tol);
    require_statistics_match(spans, want, tol, w.absent);
    require_same_bits(vectors, spans);
  }
  {
    INFO("Eigen::Matrix");
    require_outputs_match(matrices.means, want, false, tol);
    require_outputs_match(matrices.squares, want, true, tol);
    require_same_bits(vectors, matrices);
  }
}

/// Values of 16-bit type S near its largest finite one.
template <class S>
double largest_finite() {
  return as_double(std::numeric_limits<S>::max());
}

}  // namespace

TEST_CASE("the test's round-to-nearest-even: halfway cases, and agreement with Eigen's conversion of floats") {
  const double inf = std::numeric_limits<double>::infinity();
  auto to_half = [](double x) { return round_to<half>(x); };
  auto to_bf16 = [](double x) { return round_to<bf16>(x); };
  // Half: 11 significand bits; ulp(1) = 2^-10; subnormals down to 2^-24; largest 65504.
  CHECK(to_half(1 + std::ldexp(1, -11)) == 1.0);                          // halfway, to even (down)
  CHECK(to_half(1 + 3 * std::ldexp(1, -11)) == 1 + std::ldexp(1, -9));    // halfway, to even (up)
  CHECK(to_half(1 + std::ldexp(1, -11) + std::ldexp(1, -30)) == 1 + std::ldexp(1, -10));  // above halfway
  CHECK(to_half(2049) == 2048);
  CHECK(to_half(2051) == 2052);
  CHECK(to_half(-2051) == -2052);
  CHECK(to_half(65519) == 65504);
  CHECK(to_half(65520) == inf);  // halfway to 65536: to even, which overflows
  CHECK(to_half(-65520) == -inf);
  CHECK(to_half(std::ldexp(1, -25)) == 0);                       // halfway between 0 and 2^-24
  CHECK(to_half(3 * std::ldexp(1, -25)) == std::ldexp(1, -23));  // halfway between 2^-24 and 2^-23
  CHECK(to_half(std::ldexp(1, -25) + std::ldexp(1, -40)) == std::ldexp(1, -24));
  CHECK(to_half(std::ldexp(1, -14) - std::ldexp(1, -25)) == std::ldexp(1, -14));  // subnormal to normal
  CHECK(to_half(0.1) == 0.0999755859375);
  CHECK(std::signbit(to_half(-0.0)));
  CHECK(std::signbit(to_half(-std::ldexp(1, -26))));  // rounds to -0
  CHECK(std::isnan(to_half(std::numeric_limits<double>::quiet_NaN())));
  // bfloat16: 8 significand bits, float's exponent range.
  CHECK(to_bf16(1 + std::ldexp(1, -8)) == 1.0);
  CHECK(to_bf16(1 + 3 * std::ldexp(1, -8)) == 1 + std::ldexp(1, -6));
  CHECK(to_bf16(0x1.fep127 + std::ldexp(1, 119)) == inf);  // halfway above the largest: to even, overflows
  CHECK(to_bf16(0x1.fep127 + std::ldexp(1, 118)) == 0x1.fep127);
  CHECK(to_bf16(std::ldexp(1, -134)) == 0);                        // halfway to the least subnormal 2^-133
  CHECK(to_bf16(3 * std::ldexp(1, -134)) == std::ldexp(1, -132));  // halfway between 2^-133 and 2^-132
  CHECK(to_bf16(0.1) == 0.10009765625);
  CHECK(round_to<float>(1 + std::ldexp(1, -24)) == 1.0);

  // Eigen converts a float to half and bfloat16 with nearest-even rounding too: both agree on
  // floats of every exponent (random bit patterns), NaNs aside.
  std::mt19937 gen(7);
  std::size_t disagree_half = 0, disagree_bf16 = 0;
  for (int n = 0; n < 200000; ++n) {
    const auto f = std::bit_cast<float>(static_cast<std::uint32_t>(gen()));
    if (std::isnan(f)) continue;
    const double x = f;
    if (!same_double_bits(to_half(x), as_double(half(f))) && disagree_half++ == 0)
      UNSCOPED_INFO("half: " << x << " -> " << to_half(x) << ", Eigen " << as_double(half(f)));
    if (!same_double_bits(to_bf16(x), as_double(bf16(f))) && disagree_bf16++ == 0)
      UNSCOPED_INFO("bfloat16: " << x << " -> " << to_bf16(x) << ", Eigen " << as_double(bf16(f)));
  }
  CHECK(disagree_half == 0);
  CHECK(disagree_bf16 == 0);
}

TEST_CASE("half and bfloat16 gradients in std::vector: 16-bit and float outputs, weights, scale, statistics") {
  for (std::size_t towers : {1, 2, 3, 8, 17, 33}) {
    check_sweep<half, half>(towers);
    check_sweep<half, float>(towers);
    check_sweep<bf16, bf16>(towers);
    check_sweep<bf16, float>(towers);
  }
}

TEST_CASE("half and bfloat16 gradients in std::span and Eigen::Matrix") {
  for (std::size_t towers : {3, 17}) {
    check_families<half, half>(towers);
    check_families<half, float>(towers);
    check_families<bf16, bf16>(towers);
    check_families<bf16, float>(towers);
  }
}

TEST_CASE("the allocating API with 16-bit gradients returns 16-bit results") {
  const fused_towers<half> w(5, {3, 40, 130}, {}, 300);
  gradavg::options opts;
  opts.compute.scale = 0.5;
  opts.compute.statistics = true;
  const auto result = gradavg::average_gradients(w.tg, gradavg::include_square, opts);
  STATIC_REQUIRE(std::is_same_v<decltype(result.gradients[0].first), std::vector<half>>);
  const auto into = run_into<half>(w, opts);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(same_bits_all(result.gradients[i].first, into.means[i]));
    CHECK(same_bits_all(result.squares[i].first, into.squares[i]));
  }
  const auto want = w.expect({}, 0.5);
  CHECK(result.report.sum_mean_squared ==
        Approx(want[0].sum_mean_squared + want[1].sum_mean_squared + want[2].sum_mean_squared).epsilon(1e-5));
}

TEST_CASE("16-bit inputs at the top of their range: a half sum never overflows float, a bfloat16 sum may (unflagged)") {
  // 33 towers of the largest half: the float sum (2.2e6) is far from overflow; the mean is 65504
  // again, the mean of squares 4.3e9 (finite in float, +Inf in half: a result, not an input).
  fused_towers<half> h(33, {70});
  for (auto& tower : h.data)
    for (half& x : tower[0]) x = std::numeric_limits<half>::max();
  h.data[32][0][5] = half(-65504.0f);
  gradavg::options opts;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  opts.compute.statistics = true;
  const auto to_half = run_into<half>(h, opts);
  const auto to_float = run_into<float>(h, opts);
  const auto want = h.expect({}, 1.0);
  const double tol = fused_tolerance<float>(33);
  require_outputs_match(to_half.means, want, false, tol);
  require_outputs_match(to_half.squares, want, true, tol);  // rounds to +Inf: matches() rounds the reference too
  require_outputs_match(to_float.means, want, false, tol);
  require_outputs_match(to_float.squares, want, true, tol);
  CHECK(std::isinf(as_double(to_half.squares[0][0])));
  CHECK(as_double(to_half.means[0][0]) == largest_finite<half>());
  CHECK(to_half.summary.nonfinite_variables == 0);
  require_statistics_match(to_half, want, tol, h.absent);  // statistics from the float means, before rounding

  // Unscaled by a loss scale of 2^16: the same values, the scale folded into each input's weight.
  opts.compute.scale = 1.0 / 65536;
  const auto unscaled = run_into<half>(h, opts);
  require_outputs_match(unscaled.means, h.expect({}, opts.compute.scale), false, tol);
  require_outputs_match(unscaled.squares, h.expect({}, opts.compute.scale), true, tol);

  // bfloat16 reaches float's range: two towers of 2^127 * 1.5 sum to +Inf in float. Reported as a
  // result, not as a non-finite input: the variable is not flagged and not zeroed.
  fused_towers<bf16> b(2, {20});
  for (auto& tower : b.data)
    for (bf16& x : tower[0]) x = bf16(0x1.8p127f);
  opts.compute.scale = 1;
  const auto big = run_into<bf16>(b, opts);
  CHECK(big.summary.nonfinite_variables == 0);
  CHECK_FALSE(big.per_variable[0].nonfinite);
  CHECK(as_double(big.means[0][0]) == std::numeric_limits<double>::infinity());
  // With a scale (a loss scale being undone) the inputs are scaled before they are summed: the
  // same inputs unscaled by 2^16 do not overflow.
  opts.compute.scale = 1.0 / 65536;
  const auto unscaled_big = run_into<bf16>(b, opts);
  CHECK(as_double(unscaled_big.means[0][0]) == 0x1.8p127 / 65536);
  CHECK(unscaled_big.summary.nonfinite_variables == 0);
}

TEST_CASE("bfloat16 means in float's subnormal range round to nearest even, not to zero") {
  // bfloat16 has float's exponent range, so a float mean below 2^-126 still has bfloat16 values
  // (down to 2^-133); a conversion that flushes subnormal floats to zero would lose them. T = 1,
  // 2, 4: every float sum and quotient is exact here, so the only rounding is to bfloat16. Four
  // of every five elements are subnormal multiples of 2^-133 (halfway cases among their means),
  // the fifth normal, so that packets mix the two.
  for (std::size_t towers : {1u, 2u, 4u}) {
    for (bool streaming : {false, true}) {
      INFO("T = " << towers << ", streaming stores " << streaming);
      fused_towers<bf16> w(towers, {1000, 61});
      std::vector<std::vector<double>> sums(2);
      for (std::size_t v = 0; v < 2; ++v) {
        sums[v].assign(w.sizes[v], 0.0);
        for (std::size_t k = 0; k < towers; ++k) {
          for (std::size_t j = 0; j < w.sizes[v]; ++j) {
            const double sign = (j + k) % 3 == 0 ? -1.0 : 1.0;
            const double x = j % 5 == 4 ? sign * static_cast<double>(j % 7 + 1) / 4
                                        : sign * std::ldexp(static_cast<double>(1 + (7 * j + 3 * k) % 127), -133);
            w.data[k][v][j] = bf16(static_cast<float>(x));
            REQUIRE(as_double(w.data[k][v][j]) == x);
            sums[v][j] += x;
          }
        }
      }
      gradavg::options opts;
      opts.run.stores = streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
      const auto to_bf16 = run_into<bf16>(w, opts, false);
      const auto to_float = run_into<float>(w, opts, false);
      std::size_t wrong = 0, subnormal_results = 0;
      for (std::size_t v = 0; v < 2; ++v) {
        for (std::size_t j = 0; j < w.sizes[v]; ++j) {
          const double mean = sums[v][j] / static_cast<double>(towers);
          const double want = round_to<bf16>(mean);
          if (want != 0 && std::fabs(want) < std::numeric_limits<float>::min()) ++subnormal_results;
          if (as_double(to_bf16.means[v][j]) != want || as_double(to_float.means[v][j]) != mean) {
            if (wrong++ < 5) {
              UNSCOPED_INFO("variable " << v << ", element " << j << ": mean " << mean << ", want " << want << ", got "
                                        << as_double(to_bf16.means[v][j]) << " and " << to_float.means[v][j]);
            }
          }
        }
      }
      CHECK(subnormal_results > 500);
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("16-bit gradients are summed in float: a scale or weight beyond float's range is an error") {
  const fused_towers<bf16> w(2, {9});
  auto r = run_into<bf16>(w, {});
  const auto before = r.means;
  const std::vector<double> large{1, 1e39};
  CHECK_THROWS_AS(gradavg::average_gradients_into(w.tg, r.means, {.compute = {.scale = 1e39}}), gradavg::option_error);
  const auto msg = message_of<gradavg::weight_error>([&] { gradavg::average_gradients_into(w.tg, r.means, {.compute = {.weights = large}}); });
  CHECK(contains(msg, "tower 1"));
  CHECK(same_bits_all(r.means, before));
  CHECK_THROWS_AS(gradavg::average_gradients(w.tg, {.compute = {.scale = 1e39}}), gradavg::option_error);
}

TEST_CASE("16-bit non-finite inputs: NaN and +-Inf at packet boundaries, in a tower past 16, beside a skipped variable") {
  const std::vector<std::size_t> sizes{70, 9, 3, 70};
  const std::vector<bool> absent{false, false, true, false};
  const std::vector<std::pair<std::size_t, std::vector<std::size_t>>> where{
      {0, {0, 7, 8, 15, 16, 31, 32, 63, 64, 69}}, {1, {0, 8}}, {3, {0, 31, 32, 69}}};
  for (std::size_t towers : {3, 17, 33}) {
    INFO("T = " << towers);
    fused_towers<half> h(towers, sizes, absent, 400);
    fused_towers<bf16> b(towers, sizes, absent, 401);
    for (const auto policy : {gradavg::nonfinite_policy::report, gradavg::nonfinite_policy::zero}) {
      gradavg::options opts;
      opts.compute.on_nonfinite = policy;
      opts.compute.statistics = true;
      const auto clean_h = run_into<half>(h, opts);
      const auto clean_hf = run_into<float>(h, opts);
      const auto clean_b = run_into<bf16>(b, opts);
      for (std::size_t tower : {std::size_t{0}, towers - 1, std::min<std::size_t>(16, towers - 1)})
        for (const auto& [variable, elements] : where)
          for (std::size_t element : elements)
            for (double value : {nan_value, inf_value, -inf_value}) {
              const poison p{tower, variable, element, value};
              require_poison_handled(clean_h, run_poisoned<half>(h, p, opts), p, policy, absent);
              require_poison_handled(clean_hf, run_poisoned<float>(h, p, opts), p, policy, absent);
              require_poison_handled(clean_b, run_poisoned<bf16>(b, p, opts), p, policy, absent);
            }
    }
  }
}

TEST_CASE("16-bit results are bitwise identical for 1, 2, 3 and 8 threads and a thread_pool") {
  SECTION("half, T = 3, half outputs") {
    // 10 bytes an element (3 towers, mean and square of 2 bytes): 8 chunks of 1 MiB need 840,000.
    const fused_towers<half> w(3, {3, 400003, 17, 500001, 1, 7}, {false, false, false, false, false, true}, 500);
    const std::vector<double> weights{1, 2, 1};
    gradavg::options opts;
    opts.compute.weights = weights;
    opts.compute.scale = 1.0 / 128;
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
    require_same_for_every_thread_count<half>(w, opts, fused_tolerance<float>(3));
  }
  SECTION("bfloat16, T = 17, float outputs") {
    const fused_towers<bf16> w(17, {5, 120000, 33, 40000}, {}, 501);
    gradavg::options opts;
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
    require_same_for_every_thread_count<float>(w, opts, fused_tolerance<float>(17));
  }
  SECTION("bfloat16, T = 5 and 20, bfloat16 outputs") {
    // Sizes off the 32-element step, a variable absent on every tower; 20 towers: the blocked path.
    for (std::size_t towers : {5u, 20u}) {
      INFO("T = " << towers);
      const fused_towers<bf16> w(towers, {7, 150001, 31, 170003}, {false, false, true, false},
                                 static_cast<std::uint32_t>(502 + towers));
      gradavg::options opts;
      opts.compute.statistics = true;
      opts.compute.scale = 0.5;
      opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
      require_same_for_every_thread_count<bf16>(w, opts, fused_tolerance<float>(towers));
    }
  }
}

namespace {

/// Streaming stores against ordinary ones into outputs of type O at every offset of a 64-byte
/// line: the same bits, nothing written outside the outputs. T = 3 (one group of towers) and 20
/// (the blocked path); plain, and with statistics (which keep the steps where they are).
template <class S, class O>
void check_streaming(const gradavg::options& base) {
  const std::size_t n = 1000;
  for (std::size_t towers : {3u, 20u}) {
    std::vector<std::vector<S>> data(towers);
    std::mt19937 rng(static_cast<std::uint32_t>(towers));
    std::uniform_real_distribution<float> value(-4.0f, 4.0f);
    for (auto& tower : data)
      for (std::size_t j = 0; j < n; ++j) tower.push_back(static_cast<S>(value(rng)));
    std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(towers);
    for (std::size_t k = 0; k < towers; ++k) tg[k].push_back({std::span<const S>(data[k]), 0});
    for (bool statistics : {false, true}) {
      gradavg::options opts = base;
      opts.compute.statistics = statistics;
      std::vector<O> want_mean(n), want_square(n);
      {
        std::vector<std::span<O>> m{std::span<O>(want_mean)}, q{std::span<O>(want_square)};
        gradavg::average_gradients_into(tg, m, q, opts);
      }
      opts.run.stores = gradavg::store_policy::streaming;
      constexpr std::size_t line = 64 / sizeof(O);
      for (std::size_t offset = 0; offset < line; ++offset) {
        INFO("T = " << towers << ", statistics " << statistics << ", output offset " << offset);
        std::vector<O> mean_storage(n + 2 * line, O(-3.0f)), square_storage(n + 2 * line, O(-3.0f));
        const std::size_t square_offset = (offset + 5) % line;
        std::vector<std::span<O>> m{std::span<O>(mean_storage.data() + offset, n)};
        std::vector<std::span<O>> q{std::span<O>(square_storage.data() + square_offset, n)};
        gradavg::average_gradients_into(tg, m, q, opts);
        CHECK(same_bits(m[0].data(), want_mean.data(), n));
        CHECK(same_bits(q[0].data(), want_square.data(), n));
        for (std::size_t j = 0; j < offset; ++j) CHECK(mean_storage[j] == O(-3.0f));
        for (std::size_t j = offset + n; j < mean_storage.size(); ++j) CHECK(mean_storage[j] == O(-3.0f));
        for (std::size_t j = square_offset + n; j < square_storage.size(); ++j) CHECK(square_storage[j] == O(-3.0f));
      }
    }
  }
}

}  // namespace

TEST_CASE("streaming stores into 16-bit outputs and float outputs of double sums: the same bits") {
  check_streaming<half, half>({});
  check_streaming<bf16, bf16>({});
  check_streaming<half, float>({});
  check_streaming<bf16, float>({});
  check_streaming<float, float>({.compute = {.accumulate = gradavg::accumulation::double_precision}});
}

namespace {

template <class S>
S from_bits(std::uint16_t b) {
  return std::bit_cast<S>(b);
}

/// NaN inputs of every kind (quiet, signalling, either sign, with payloads) and +Inf meeting -Inf,
/// at spread positions of variables around the packet widths: every NaN result, means and
/// squares, is O's default quiet NaN bit for bit, and no other result is NaN, for ordinary and
/// streaming stores and 1 and 2 threads. Which results are NaN is read off the inputs: a mean
/// where an input is NaN or +Inf meets -Inf, a square where an input is NaN.
template <class S, class O>
void check_nan_bits(std::size_t towers) {
  INFO("T = " << towers << ", outputs " << (std::is_same_v<O, float> ? "float" : "16-bit"));
  // Quiet and signalling NaNs with payloads, positive and negative.
  const std::vector<std::uint16_t> nan_bits =
      std::is_same_v<S, half> ? std::vector<std::uint16_t>{0x7e00, 0xfe00, 0x7e15, 0xfd01, 0x7c01}
                              : std::vector<std::uint16_t>{0x7fc0, 0xffc0, 0x7fc5, 0xff81, 0x7f81};
  fused_towers<S> w(towers, {1, 15, 16, 17, 32, 33, 70, 1000}, {}, static_cast<std::uint32_t>(600 + towers));
  for (std::size_t i = 0; i < w.variables(); ++i) {
    const std::size_t n = w.sizes[i];
    for (std::size_t c = 0; c < nan_bits.size(); ++c) w.data[towers - 1][i][(c * 16 + i) % n] = from_bits<S>(nan_bits[c]);
    if (towers >= 2) {
      w.data[0][i][n - 1] = std::numeric_limits<S>::infinity();
      w.data[1][i][n - 1] = -std::numeric_limits<S>::infinity();
    }
  }
  const auto default_nan = std::bit_cast<std::conditional_t<sizeof(O) == 2, std::uint16_t, std::uint32_t>>(
      std::numeric_limits<O>::quiet_NaN());
  auto require_nan_bits = [&default_nan](O x, bool nan) {
    if (nan)
      REQUIRE(std::bit_cast<decltype(default_nan)>(x) == default_nan);
    else
      REQUIRE(!Eigen::numext::isnan(x));
  };
  for (const bool streaming : {false, true})
    for (const std::size_t threads : {std::size_t{1}, std::size_t{2}}) {
      INFO("streaming " << streaming << ", threads " << threads);
      const auto stores = streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
      const auto r = run_into<O>(w, {.run = {.threads = threads, .stores = stores}});
      for (std::size_t i = 0; i < w.variables(); ++i)
        for (std::size_t j = 0; j < w.sizes[i]; ++j) {
          INFO("variable " << i << ", element " << j);
          bool any_nan = false, pos_inf = false, neg_inf = false;
          for (std::size_t k = 0; k < towers; ++k) {
            const S x = w.data[k][i][j];
            any_nan = any_nan || Eigen::numext::isnan(x);
            pos_inf = pos_inf || x == std::numeric_limits<S>::infinity();
            neg_inf = neg_inf || x == -std::numeric_limits<S>::infinity();
          }
          require_nan_bits(r.means[i][j], any_nan || (pos_inf && neg_inf));
          require_nan_bits(r.squares[i][j], any_nan);
        }
    }
}

}  // namespace

TEST_CASE("16-bit NaN results are the output type's default quiet NaN, bit for bit, whatever NaN went in") {
  for (std::size_t towers : {1, 2, 3, 17}) {
    check_nan_bits<half, half>(towers);
    check_nan_bits<bf16, bf16>(towers);
    check_nan_bits<half, float>(towers);
    check_nan_bits<bf16, float>(towers);
  }
}
