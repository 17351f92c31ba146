// The kernel's paths — register groups and the accumulator block (more than 16 towers), packet
// steps and scalar tails, streaming stores with unaligned outputs — agree with the reference
// and, bit for bit, with each other.
#include <gradavg/gradavg.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "fused_reference.hpp"
#include "reference.hpp"
#include "support.hpp"

TEMPLATE_TEST_CASE("every kernel path gives the same bits, within tolerance of the reference", "", float, double) {
  using S = TestType;
  const std::size_t tower_count = GENERATE(1, 2, 3, 15, 16, 17, 32, 33, 40);
  const std::size_t n = GENERATE(0, 1, 15, 16, 17, 1023, 1025, 4099);
  INFO("towers " << tower_count << ", n " << n);

  // Inputs at a different misalignment per tower.
  std::vector<std::vector<S>> storage;
  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
  std::vector<const S*> ptrs;
  for (std::size_t k = 0; k < tower_count; ++k) {
    storage.push_back(gradavg_test::random_values<S>(n + 3, static_cast<std::uint32_t>(7 * k + n)));
    const S* start = storage.back().data() + k % 4;
    tg[k].push_back({std::span<const S>(start, n), 0});
    ptrs.push_back(start);
  }
  const gradavg_test::reference<S> want(ptrs, n);

  std::vector<S> base_mean(n), base_square(n);
  {
    std::vector<std::span<S>> m{std::span<S>(base_mean)}, q{std::span<S>(base_square)};
    gradavg::average_gradients_into(tg, m, q);
  }
  CHECK(gradavg_test::first_mismatch(base_mean.data(), want.mean, gradavg_test::magnitude<S>(ptrs, n, false),
                                     tower_count) == n);
  CHECK(gradavg_test::first_mismatch(base_square.data(), want.square, gradavg_test::magnitude<S>(ptrs, n, true),
                                     tower_count) == n);

  for (const bool streaming : {false, true})
    for (std::size_t offset = 0; offset < 4; ++offset) {
      INFO("streaming " << streaming << ", output offset " << offset);
      std::vector<S> mean_storage(n + 4, S(-1)), square_storage(n + 4, S(-1));
      std::vector<std::span<S>> m{std::span<S>(mean_storage.data() + offset, n)};
      std::vector<std::span<S>> q{std::span<S>(square_storage.data() + (offset + 1) % 4, n)};
      const auto stores = streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
      gradavg::average_gradients_into(tg, m, q, {.run = {.stores = stores}});
      CHECK(gradavg_test::same_bits(m[0].data(), base_mean.data(), n));
      CHECK(gradavg_test::same_bits(q[0].data(), base_square.data(), n));
      CHECK(mean_storage[offset + n] == S(-1));  // nothing written past the end
      if (offset > 0) CHECK(mean_storage[offset - 1] == S(-1));
    }
}

TEST_CASE("mean alone equals the mean computed alongside squares") {
  const std::size_t tower_count = 20, n = 3001;
  std::vector<std::vector<float>> data;
  std::vector<std::vector<std::pair<const std::vector<float>*, int>>> tg(tower_count);
  for (std::size_t k = 0; k < tower_count; ++k) data.push_back(gradavg_test::random_values<float>(n, 50 + k));
  for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({&data[k], 0});
  std::vector<std::vector<float>> alone{std::vector<float>(n)}, with{std::vector<float>(n)}, sq{std::vector<float>(n)};
  gradavg::average_gradients_into(tg, alone);
  gradavg::average_gradients_into(tg, with, sq);
  CHECK(alone[0] == with[0]);
}

TEMPLATE_TEST_CASE("a NaN result is the default quiet NaN on every path, thread count and store kind", "", float,
                   double) {
  using S = TestType;
  using bits_t = std::conditional_t<sizeof(S) == 4, std::uint32_t, std::uint64_t>;
  auto bits = [](S x) { return std::bit_cast<bits_t>(x); };
  auto nan_with_payload = [&bits](bits_t payload, bool quiet) {
    constexpr int mantissa_bits = std::numeric_limits<S>::digits - 1;
    const bits_t quiet_bit = bits_t{1} << (mantissa_bits - 1);
    const bits_t exponent = bits(std::numeric_limits<S>::infinity());
    return std::bit_cast<S>(static_cast<bits_t>(exponent | (quiet ? quiet_bit : bits_t{0}) | ((payload | 1) & (quiet_bit - 1))));
  };
  const std::size_t tower_count = GENERATE(2, 3, 17);
  // Large enough for four chunks of at least 1 MiB; n % 16 != 0 leaves a tail.
  const std::size_t n = (std::size_t{3} << 20) / ((tower_count + 2) * sizeof(S)) * 4 + 13;
  INFO("towers " << tower_count << ", n " << n);

  std::vector<std::vector<S>> data;
  for (std::size_t k = 0; k < tower_count; ++k)
    data.push_back(gradavg_test::random_values<S>(n, static_cast<std::uint32_t>(900 + k)));
  // NaNs of different payloads (quiet and signalling, both signs) meet at the first, last,
  // packet-boundary, tail and chunk-boundary-ish positions; +inf + -inf makes one elsewhere.
  std::vector<std::size_t> nan_at{0, 1, 15, 16, 17, 63, 64, n / 4, n / 4 + 1, n / 3, n / 2 - 1, n / 2, n - 13, n - 2, n - 1};
  for (std::size_t k = 0; k < tower_count; ++k)
    for (std::size_t p = 0; p < nan_at.size(); ++p)
      if ((k + p) % 2 == 0 || k + 1 == tower_count) {
        S nan = nan_with_payload(static_cast<bits_t>(k * 977 + p * 31), (k + p) % 3 != 0);
        data[k][nan_at[p]] = (k % 2 == 0) ? nan : -nan;
      }
  const std::size_t inf_at = n / 5;
  data[0][inf_at] = std::numeric_limits<S>::infinity();
  data[1][inf_at] = -std::numeric_limits<S>::infinity();
  nan_at.push_back(inf_at);

  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
  std::vector<const S*> ptrs;
  for (std::size_t k = 0; k < tower_count; ++k) {
    tg[k].push_back({std::span<const S>(data[k]), 0});
    ptrs.push_back(data[k].data());
  }
  const gradavg_test::reference<S> want(ptrs, n);

  const bits_t quiet_nan = bits(std::numeric_limits<S>::quiet_NaN());
  gradavg::thread_pool pool(4);
  for (const std::size_t threads : {1, 2, 3, 4})
    for (const bool streaming : {false, true}) {
      INFO("threads " << threads << ", streaming " << streaming);
      std::vector<S> mean(n), square(n);
      std::vector<std::span<S>> m{std::span<S>(mean)}, q{std::span<S>(square)};
      const auto stores = streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
      gradavg::average_gradients_into(tg, m, q, {.run = {.threads = threads, .stores = stores, .pool = &pool}});
      std::size_t nan_means = 0, nan_squares = 0, wrong = 0;
      for (std::size_t j = 0; j < n; ++j) {
        // Squares of +inf and -inf add up to +inf: only the means are NaN there.
        nan_means += std::isnan(want.mean[j]);
        nan_squares += std::isnan(want.square[j]);
        wrong += std::isnan(want.mean[j]) ? bits(mean[j]) != quiet_nan : std::isnan(mean[j]);
        wrong += std::isnan(want.square[j]) ? bits(square[j]) != quiet_nan : std::isnan(square[j]);
      }
      CHECK(nan_means == nan_at.size());
      CHECK(nan_squares + 1 == nan_at.size());
      CHECK(wrong == 0);
    }
}

TEMPLATE_TEST_CASE("an element rounds alike in a tail and inside whole steps", "", float, double) {
  // The same inputs averaged as a short variable (all tail) and as part of a long one (whole
  // packet steps): every element's mean and square must be the same bits. Squares differ where a
  // target's tail and packet paths disagree on fusing the multiply-add.
  using S = TestType;
  const std::size_t tower_count = GENERATE(2, 5, 17);
  constexpr std::size_t long_n = 64;
  std::vector<std::vector<S>> data;
  for (std::size_t k = 0; k < tower_count; ++k)
    data.push_back(gradavg_test::random_values<S>(long_n, static_cast<std::uint32_t>(300 + k)));
  auto average = [&](std::size_t n, std::vector<S>& mean, std::vector<S>& square) {
    std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
    for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({std::span<const S>(data[k].data(), n), 0});
    std::vector<std::span<S>> m{std::span<S>(mean.data(), n)}, q{std::span<S>(square.data(), n)};
    gradavg::average_gradients_into(tg, m, q);
  };
  std::vector<S> long_mean(long_n), long_square(long_n);
  average(long_n, long_mean, long_square);
  for (std::size_t n = 1; n < 32; ++n) {
    INFO("towers " << tower_count << ", short variable of " << n);
    std::vector<S> mean(n), square(n);
    average(n, mean, square);
    CHECK(gradavg_test::same_bits(mean.data(), long_mean.data(), n));
    CHECK(gradavg_test::same_bits(square.data(), long_square.data(), n));
  }
}

// Calls that move prefetch_min_bytes or more run whole steps that prefetch the towers' data
// ahead (detail/kernel.hpp); smaller ones do not. Both must give every element's bits: a large
// call's means are checked against the scalar sum in tower order, its squares (and statistics)
// against the long-double reference, and all against the same elements averaged as buckets too
// small to prefetch (options.compute.range).
TEMPLATE_TEST_CASE("calls large enough to prefetch give the reference's bits and those of small calls", "", float,
                   double, Eigen::half, Eigen::bfloat16) {
  using S = TestType;
  using Acc = std::conditional_t<std::is_same_v<S, double>, double, float>;
  const std::size_t tower_count = GENERATE(4, 17);
  const bool streaming = GENERATE(false, true);
  const bool fused = GENERATE(false, true);
  const std::size_t bytes_per_element = (tower_count + 2) * sizeof(S);  // towers, mean, square
  const std::size_t n = gradavg::detail::prefetch_min_bytes / bytes_per_element + 1001;  // whole steps and a tail
  constexpr std::size_t bucket = 4096;
  REQUIRE(gradavg::detail::prefetch_pays(n, bytes_per_element));
  REQUIRE_FALSE(gradavg::detail::prefetch_pays(bucket, bytes_per_element));
  INFO("towers " << tower_count << ", n " << n << ", streaming " << streaming << ", fused " << fused);

  std::vector<std::vector<S>> data;
  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
  for (std::size_t k = 0; k < tower_count; ++k) {
    data.push_back(gradavg_test::random_values<S>(n, static_cast<std::uint32_t>(900 + k)));
    tg[k].push_back({std::span<const S>(data[k]), 0});
  }
  gradavg::options opts{.run = {.stores = streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular}};
  if (fused) {
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
  }
  std::vector<S> mean(n), square(n);
  gradavg::summary r;
  {
    std::vector<std::span<S>> m{std::span<S>(mean)}, q{std::span<S>(square)};
    r = gradavg::average_gradients_into(tg, m, q, opts);
    CHECK_FALSE(r.nonfinite());
  }

  // The squares (and, fused, the statistics) against the long-double reference of the inputs.
  std::vector<const S*> tower_ptrs;
  for (const auto& d : data) tower_ptrs.push_back(d.data());
  const auto want = gradavg_test::expect_fused<S>(tower_ptrs, 0, n, {}, 1.0);
  const double tol = gradavg_test::fused_tolerance<Acc>(tower_count);
  CHECK(gradavg_test::first_fused_mismatch(square.data(), want, true, tol) == n);
  if (fused) {
    const auto bound = gradavg_test::statistics_error(want, tol);
    CHECK(std::abs(r.sum_mean_squared - want.sum_mean_squared) <= bound.mean_squared);
    CHECK(std::abs(r.sum_mean_of_squares - want.sum_mean_of_squares) <= bound.mean_of_squares);
  }

  std::size_t wrong = 0;
  for (std::size_t j = 0; j < n; ++j) {
    Acc sum = 0;
    for (std::size_t k = 0; k < tower_count; ++k) sum += static_cast<Acc>(data[k][j]);
    const S want = static_cast<S>(sum / static_cast<Acc>(tower_count));
    wrong += gradavg_test::same_bits(&mean[j], &want, 1) ? 0 : 1;
  }
  CHECK(wrong == 0);

  std::vector<S> bucket_mean(n), bucket_square(n);
  for (std::size_t begin = 0; begin < n; begin += bucket) {
    std::vector<std::span<S>> m{std::span<S>(bucket_mean)}, q{std::span<S>(bucket_square)};
    gradavg::options part = opts;
    part.compute.range = {begin, begin + bucket};
    gradavg::average_gradients_into(tg, m, q, part);
  }
  CHECK(gradavg_test::same_bits(mean.data(), bucket_mean.data(), n));
  CHECK(gradavg_test::same_bits(square.data(), bucket_square.data(), n));
}

// The kernel multiplies by 1/d instead of dividing by d when d is a power of two whose reciprocal
// is normal. That is exact only if it gives the quotient's bits for every input: checked against
// the scalar sum in tower order followed by a true division, on values whose quotients are
// subnormal, tiny, huge, zero of either sign, and on divisors either side of the exact cases.
TEMPLATE_TEST_CASE("a mean is the in-order sum divided by the divisor, bit for bit, whatever the divisor", "", float,
                   double) {
  using S = TestType;
  using limits = std::numeric_limits<S>;
  const std::size_t n = 67;  // whole steps and a tail
  // x rounded to S on its own: keeps the compiler from contracting a product into a later sum.
  auto rounded = [](S x) {
    volatile S stored = x;
    return static_cast<S>(stored);
  };
  // Tower values: mixed signs and magnitudes, including subnormal and near-overflow sums.
  auto tower_values = [&](std::size_t k, std::size_t towers) {
    std::vector<S> v = gradavg_test::random_values<S>(n, static_cast<std::uint32_t>(101 + k));
    const S huge = limits::max() / static_cast<S>(2 * towers);
    for (std::size_t j = 0; j < n; ++j) {
      switch (j % 6) {
        case 0: v[j] *= limits::min(); break;             // sums near the subnormal range
        case 1: v[j] *= limits::denorm_min() * S(7); break;  // subnormal inputs
        case 2: v[j] *= huge; break;                      // sums near overflow
        case 3: v[j] = (k % 2 == 0 ? S(1) : S(-1)) * S(0); break;  // zeros of both signs
        default: break;                                   // ordinary values
      }
    }
    return v;
  };

  SECTION("plain mean and squares, T towers") {
    const std::size_t tower_count = GENERATE(1, 2, 3, 4, 5, 8, 16, 17, 32, 64);
    INFO("towers " << tower_count);
    std::vector<std::vector<S>> data;
    std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
    for (std::size_t k = 0; k < tower_count; ++k) data.push_back(tower_values(k, tower_count));
    for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({std::span<const S>(data[k]), 0});
    // Squares: each x*x rounded, then added, at every instruction-set level (never fused).
    std::vector<S> want_mean(n), want_square(n), fused_square(n);
    for (std::size_t j = 0; j < n; ++j) {
      S sum = data[0][j], square = rounded(data[0][j] * data[0][j]), fused = square;
      for (std::size_t k = 1; k < tower_count; ++k) {
        sum = sum + data[k][j];
        square = rounded(data[k][j] * data[k][j]) + square;
        fused = std::fma(data[k][j], data[k][j], fused);
      }
      want_mean[j] = sum / static_cast<S>(tower_count);
      want_square[j] = square / static_cast<S>(tower_count);
      fused_square[j] = fused / static_cast<S>(tower_count);
    }
    std::vector<std::vector<S>> mean{std::vector<S>(n)}, square{std::vector<S>(n)};
    gradavg::average_gradients_into(tg, mean, square);
    CHECK(gradavg_test::same_bits(mean[0].data(), want_mean.data(), n));
    CHECK(gradavg_test::same_bits(square[0].data(), want_square.data(), n));
    // The data tells the two apart: a fused multiply-add would fail the check above.
    if (tower_count > 1) CHECK_FALSE(gradavg_test::same_bits(fused_square.data(), want_square.data(), n));
  }

  SECTION("zeros of one sign on every tower keep it, in register groups and the accumulator block") {
    const std::size_t tower_count = GENERATE(2, 16, 17, 33);
    const bool weighted = GENERATE(false, true);
    INFO("towers " << tower_count << (weighted ? ", weighted" : ""));
    std::vector<std::vector<S>> data;
    std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
    std::vector<double> weights(tower_count, weighted ? 1.5 : 1.0);
    for (std::size_t k = 0; k < tower_count; ++k) {
      std::vector<S> v = gradavg_test::random_values<S>(n, static_cast<std::uint32_t>(500 + k));
      for (std::size_t j = 0; j < n; ++j) {
        if (j % 3 == 0) v[j] = -S(0);  // -0 on every tower: the sum is -0
        if (j % 3 == 1) v[j] = S(0);
      }
      data.push_back(std::move(v));
    }
    for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({std::span<const S>(data[k]), 0});
    std::vector<S> want(n);
    for (std::size_t j = 0; j < n; ++j) {
      S sum = rounded(data[0][j] * static_cast<S>(weights[0]));
      for (std::size_t k = 1; k < tower_count; ++k) sum = rounded(data[k][j] * static_cast<S>(weights[k])) + sum;
      want[j] = sum / static_cast<S>(weights[0] * static_cast<double>(tower_count));
    }
    for (std::size_t j = 0; j < n; j += 3) REQUIRE(std::signbit(want[j]));
    std::vector<std::vector<S>> mean{std::vector<S>(n)}, square{std::vector<S>(n)};
    if (weighted)
      gradavg::average_gradients_into(tg, mean, square, {.compute = {.weights = weights, .statistics = true}});
    else
      gradavg::average_gradients_into(tg, mean, square);
    CHECK(gradavg_test::same_bits(mean[0].data(), want.data(), n));
  }

  SECTION("weighted mean, weight sums at and around the exact cases") {
    // Weight sums: powers of two (2^-20, 4, 2^60, the largest finite one: its reciprocal is
    // subnormal), and ones that are not powers of two.
    const S top = std::ldexp(S(1), limits::max_exponent - 2);  // the largest power of two / 2
    const std::vector<std::vector<double>> weight_sets{
        {std::ldexp(1.0, -21), std::ldexp(1.0, -21)},
        {1.0, 1.0, 2.0},
        {std::ldexp(1.0, 59), std::ldexp(1.0, 59)},
        {static_cast<double>(top), static_cast<double>(top)},
        {1.0, 2.0},
        {0.1, 0.7, 0.2}};
    for (const std::vector<double>& weights : weight_sets) {
      const std::size_t tower_count = weights.size();
      INFO("weights " << weights[0] << ", ..., towers " << tower_count);
      std::vector<std::vector<S>> data;
      std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(tower_count);
      for (std::size_t k = 0; k < tower_count; ++k) data.push_back(gradavg_test::random_values<S>(n, 300 + k));
      for (std::size_t k = 0; k < tower_count; ++k)
        for (std::size_t j = 0; j < n; j += 5) data[k][j] *= limits::min();  // subnormal quotients
      for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({std::span<const S>(data[k]), 0});
      double weight_sum = 0;
      for (double w : weights) weight_sum += w;
      // Each w_k g_k rounded, then added, at every instruction-set level (never fused).
      std::vector<S> want(n);
      for (std::size_t j = 0; j < n; ++j) {
        S sum = rounded(data[0][j] * static_cast<S>(weights[0]));
        for (std::size_t k = 1; k < tower_count; ++k) sum = rounded(data[k][j] * static_cast<S>(weights[k])) + sum;
        want[j] = sum / static_cast<S>(weight_sum);
      }
      std::vector<std::vector<S>> mean{std::vector<S>(n)};
      gradavg::average_gradients_into(tg, mean, {.compute = {.weights = weights}});
      CHECK(gradavg_test::same_bits(mean[0].data(), want.data(), n));
    }
  }
}

TEST_CASE("store_policy::automatic streams from streaming_threshold_bytes on, with the same bits") {
  gradavg::options opts;
  CHECK(opts.run.stores == gradavg::store_policy::automatic);
  CHECK(!gradavg::detail::streams(opts, gradavg::streaming_threshold_bytes - 1));
  CHECK(gradavg::detail::streams(opts, gradavg::streaming_threshold_bytes));
  opts.run.stores = gradavg::store_policy::regular;
  CHECK(!gradavg::detail::streams(opts, std::size_t{1} << 40));
  opts.run.stores = gradavg::store_policy::streaming;
  CHECK(gradavg::detail::streams(opts, 1));

  // Two towers and a mean of 16 Mi floats move 192 MiB: automatic streams, below it regular.
  const std::size_t n = std::size_t{16} << 20;
  const std::vector<float> a = gradavg_test::random_values<float>(n, 3), b = gradavg_test::random_values<float>(n, 4);
  const std::vector<std::vector<std::pair<std::span<const float>, int>>> tg{{{std::span<const float>(a), 0}},
                                                                            {{std::span<const float>(b), 0}}};
  REQUIRE(3 * n * sizeof(float) >= gradavg::streaming_threshold_bytes);
  std::vector<float> automatic(n), regular(n);
  std::vector<std::span<float>> m_automatic{std::span<float>(automatic)}, m_regular{std::span<float>(regular)};
  gradavg::average_gradients_into(tg, m_automatic, {.run = {.threads = 2}});
  gradavg::average_gradients_into(tg, m_regular, {.run = {.threads = 2, .stores = gradavg::store_policy::regular}});
  CHECK(gradavg_test::same_bits(automatic.data(), regular.data(), n));
  for (const std::size_t i : {std::size_t{0}, n / 3, n - 1}) CHECK(automatic[i] == (a[i] + b[i]) / 2);
}
