// The kernel chosen at run time (simd.hpp): built without instruction-set flags, so that this
// unit compiles every x86-64 level; each level the CPU runs is forced in turn and its results
// compared bit for bit with the baseline level's (SSE2), over every element type, output type,
// option, tail length, tower count and thread count below. The baseline's results are checked
// against a reference in long double, so that the comparison is not between two wrong answers.
#include <gradavg/gradavg.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "simd_levels.hpp"

namespace {

using gradavg_test::runnable_simd_levels;
using gradavg_test::simd_level_reset;

template <class S>
using towers_of = std::vector<std::vector<std::vector<S>>>;  // [tower][variable][element]

/// T towers of variables of the given sizes: values of a few magnitudes and signs, with exact
/// zeros, subnormal floats and (where `specials`) a NaN and an infinity in the last variable.
template <class S>
towers_of<S> make_towers(std::size_t towers, const std::vector<std::size_t>& sizes, bool specials, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> value(-4.0, 4.0);
  std::uniform_int_distribution<int> kind(0, 15);
  towers_of<S> t(towers);
  for (std::size_t k = 0; k < towers; ++k) {
    for (std::size_t size : sizes) {
      std::vector<S> v(size);
      for (auto& x : v) {
        const int what = kind(rng);
        double d = value(rng);
        if (what == 0) d = 0;
        if (what == 1) d *= 1e-3;
        if (what == 2) d *= 1e3;
        if (what == 3 && std::is_same_v<S, float>) d = 1e-40 * value(rng);  // subnormal float
        x = static_cast<S>(d);
      }
      t[k].push_back(std::move(v));
    }
  }
  if (specials && !sizes.empty() && sizes.back() >= 3) {
    t[0].back()[1] = static_cast<S>(std::numeric_limits<float>::quiet_NaN());
    t[towers - 1].back()[2] = static_cast<S>(std::numeric_limits<float>::infinity());
  }
  return t;
}

template <class O>
struct run_result {
  std::vector<std::vector<O>> means, squares;
  gradavg::summary summary;
  std::vector<gradavg::variable_statistics> per_variable;
};

template <class O, class S>
run_result<O> run(const towers_of<S>& data, gradavg::options opts, bool squares) {
  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(data.size());
  for (std::size_t k = 0; k < data.size(); ++k)
    for (std::size_t i = 0; i < data[k].size(); ++i)
      tg[k].push_back({std::span<const S>(data[k][i]), static_cast<int>(i)});
  run_result<O> r;
  std::vector<std::span<O>> m, q;
  for (const auto& v : data[0]) {
    r.means.emplace_back(v.size(), O(-7));
    r.squares.emplace_back(v.size(), O(-7));
  }
  for (std::size_t i = 0; i < data[0].size(); ++i) {
    m.push_back(std::span<O>(r.means[i]));
    q.push_back(std::span<O>(r.squares[i]));
  }
  r.per_variable.resize(data[0].size());
  opts.compute.per_variable = r.per_variable;
  if (squares)
    r.summary = gradavg::average_gradients_into(tg, m, q, opts);
  else
    r.summary = gradavg::average_gradients_into(tg, m, opts);
  return r;
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class O>
bool same_bits(const std::vector<std::vector<O>>& a, const std::vector<std::vector<O>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(O)) != 0))
      return false;
  return true;
}

/// The weighted, scaled mean of one element in long double, and its error bound for the
/// accumulator's unit roundoff u and the output's rounding (half an ulp of the output type).
template <class S>
std::pair<long double, long double> reference(const towers_of<S>& data, std::size_t i, std::size_t j,
                                              const gradavg::options& opts, long double u) {
  long double sum = 0, magnitude = 0, weights = 0;
  for (std::size_t k = 0; k < data.size(); ++k) {
    const long double w = opts.compute.weights.empty() ? 1.0L : opts.compute.weights[k];
    const long double g = std::is_same_v<S, double> ? static_cast<long double>(data[k][i][j])
                                                    : static_cast<long double>(static_cast<float>(data[k][i][j]));
    sum += w * opts.compute.scale * g;
    magnitude += std::fabs(w * opts.compute.scale * g);
    weights += w;
  }
  const long double n = static_cast<long double>(data.size());
  return {sum / weights, (2 * n + 4) * u * magnitude / weights};
}

/// The baseline's means against the long double reference, finite elements only.
template <class S, class O>
void check_against_reference(const towers_of<S>& data, const run_result<O>& r, const gradavg::options& opts) {
  const bool double_sums = std::is_same_v<S, double> || opts.compute.accumulate == gradavg::accumulation::double_precision;
  const long double u = double_sums ? std::ldexp(1.0L, -53) : std::ldexp(1.0L, -24);
  const long double output_ulp = std::is_same_v<O, double>        ? std::ldexp(1.0L, -52)
                                 : std::is_same_v<O, float>       ? std::ldexp(1.0L, -23)
                                 : std::is_same_v<O, Eigen::half> ? std::ldexp(1.0L, -10)
                                                                  : std::ldexp(1.0L, -7);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < data[0].size(); ++i) {
    for (std::size_t j = 0; j < data[0][i].size(); ++j) {
      const auto [expected, bound] = reference(data, i, j, opts, u);
      const long double got = static_cast<long double>(static_cast<double>(r.means[i][j]));
      if (!std::isfinite(static_cast<double>(expected)) || !std::isfinite(static_cast<double>(got))) continue;
      const long double tolerance = bound + output_ulp * std::fabs(expected) +
                                    static_cast<long double>(static_cast<double>(std::numeric_limits<O>::denorm_min()));
      if (std::fabs(got - expected) > tolerance && bad++ < 3)
        FAIL_CHECK("variable " << i << " element " << j << ": " << static_cast<double>(got) << " vs reference "
                               << static_cast<double>(expected));
    }
  }
  CHECK(bad == 0);
}

/// Every level this CPU runs gives the baseline's bits for these towers and options.
template <class S, class O>
void check_levels(const towers_of<S>& data, gradavg::options opts, bool squares) {
  simd_level_reset reset;
  const auto levels = runnable_simd_levels();
  REQUIRE(gradavg::force_simd_level(gradavg::simd_level::sse2));
  REQUIRE(gradavg::simd_level_in_use() == gradavg::simd_level::sse2);
  const auto baseline = run<O>(data, opts, squares);
  check_against_reference(data, baseline, opts);
  if (opts.compute.statistics) {
    // The sum of mean^2 against the outputs' own squares where the means are exact in O.
    if constexpr (std::is_same_v<O, S> && !std::is_same_v<S, Eigen::half> && !std::is_same_v<S, Eigen::bfloat16>) {
      if (opts.compute.accumulate == gradavg::accumulation::native && !baseline.summary.nonfinite()) {
        long double sum = 0;
        for (const auto& v : baseline.means)
          for (O x : v) sum += static_cast<long double>(x) * static_cast<long double>(x);
        CHECK(std::fabs(static_cast<long double>(baseline.summary.sum_mean_squared) - sum) <= 1e-12L * sum);
      }
    }
  }
  for (auto level : levels) {
    if (level == gradavg::simd_level::sse2) continue;
    REQUIRE(gradavg::force_simd_level(level));
    REQUIRE(gradavg::simd_level_in_use() == level);
    INFO("level " << gradavg::to_string(level) << " against sse2");
    const auto r = run<O>(data, opts, squares);
    CHECK(same_bits(r.means, baseline.means));
    if (squares) CHECK(same_bits(r.squares, baseline.squares));
    CHECK(r.summary.averaged == baseline.summary.averaged);
    CHECK(r.summary.nonfinite_variables == baseline.summary.nonfinite_variables);
    CHECK(same_bits(r.summary.sum_mean_squared, baseline.summary.sum_mean_squared));
    CHECK(same_bits(r.summary.sum_mean_of_squares, baseline.summary.sum_mean_of_squares));
    for (std::size_t i = 0; i < r.per_variable.size(); ++i) {
      INFO("variable " << i);
      CHECK(r.per_variable[i].nonfinite == baseline.per_variable[i].nonfinite);
      CHECK(same_bits(r.per_variable[i].sum_mean_squared, baseline.per_variable[i].sum_mean_squared));
      CHECK(same_bits(r.per_variable[i].sum_mean_of_squares, baseline.per_variable[i].sum_mean_of_squares));
    }
  }
}

/// Lengths around every step, block and packet size of every level, and one long enough to
/// prefetch (4 MiB and more moved) with 16 towers.
const std::vector<std::size_t> short_sizes = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 257};
const std::vector<std::size_t> long_sizes = {1023, 1024, 1025, 4099, 70001};

template <class S, class O>
void check_element_type() {
  const std::vector<double> weights17 = {0.5, 1, 2, 0, 3, 1, 1, 0.25, 4, 1, 1, 1, 2, 1, 1, 1, 7};
  for (std::size_t towers : {1, 2, 3, 4, 5, 16, 17, 33}) {
    INFO(towers << " towers");
    const auto data = make_towers<S>(towers, short_sizes, true, static_cast<unsigned>(towers));
    check_levels<S, O>(data, {}, false);
    check_levels<S, O>(data, {}, true);
    gradavg::options fused{.compute = {.on_nonfinite = gradavg::nonfinite_policy::report, .statistics = true}};
    check_levels<S, O>(data, fused, false);
    std::vector<double> weights(weights17.begin(),
                                weights17.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(towers, 17)));
    weights.resize(towers, 1.5);
    fused.compute.weights = weights;
    fused.compute.scale = 0.125;
    check_levels<S, O>(data, fused, true);
    if constexpr (std::is_same_v<S, float>) {
      fused.compute.accumulate = gradavg::accumulation::double_precision;
      check_levels<S, O>(data, fused, true);
    }
  }
  for (std::size_t towers : {2, 16}) {
    INFO(towers << " towers, long variables");
    const auto data = make_towers<S>(towers, long_sizes, false, 99);
    gradavg::options opts{.compute = {.statistics = true}, .run = {.threads = 3}};
    check_levels<S, O>(data, opts, true);
    opts.run.stores = gradavg::store_policy::streaming;
    check_levels<S, O>(data, opts, true);
    opts.run.threads = 1;
    opts.compute.statistics = false;
    check_levels<S, O>(data, opts, false);
  }
}

}  // namespace

TEST_CASE("every level this CPU runs gives the baseline's bits: float") { check_element_type<float, float>(); }
TEST_CASE("every level this CPU runs gives the baseline's bits: double") { check_element_type<double, double>(); }
TEST_CASE("every level this CPU runs gives the baseline's bits: half") {
  check_element_type<Eigen::half, Eigen::half>();
  check_element_type<Eigen::half, float>();
}
TEST_CASE("every level this CPU runs gives the baseline's bits: bfloat16") {
  check_element_type<Eigen::bfloat16, Eigen::bfloat16>();
  check_element_type<Eigen::bfloat16, float>();
}

TEST_CASE("the level can be forced down and reset, never up past the CPU") {
  simd_level_reset reset;
  const auto cpu = gradavg::cpu_simd_level();
  REQUIRE(cpu >= gradavg::simd_level::sse2);  // x86-64
  CHECK_FALSE(gradavg::force_simd_level(gradavg::simd_level::scalar));
  CHECK_FALSE(gradavg::force_simd_level(gradavg::simd_level::neon));
  for (auto level : runnable_simd_levels()) {
    CHECK(gradavg::force_simd_level(level));
    CHECK(gradavg::simd_level_in_use() == level);
  }
  if (cpu < gradavg::simd_level::avx512_bf16) {
    const auto before = gradavg::simd_level_in_use();
    CHECK_FALSE(gradavg::force_simd_level(gradavg::simd_level::avx512_bf16));
    CHECK(gradavg::simd_level_in_use() == before);
  }
  gradavg::reset_simd_level();
  const char* environment = std::getenv("GRADAVG_ISA");
  if (environment == nullptr) CHECK(gradavg::simd_level_in_use() == cpu);
}

// A name declared in the level's inline namespace carries it in its mangled name (the typeid
// name on GCC and Clang): units built for other levels then see other types.
namespace {
bool in_level_namespace(const std::type_info& type) {
  return std::string(type.name()).find(gradavg::isa_namespace) != std::string::npos;
}
}  // namespace

TEST_CASE("the vocabulary is one set of types for every level, the code one per level") {
  CHECK_FALSE(in_level_namespace(typeid(gradavg::options)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::summary)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::plan)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::compute_options)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::shape)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::element_type)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::simd_level)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::tensor_traits<std::vector<float>>)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::entry_traits<std::pair<std::vector<float>, int>>)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::variable_statistics)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::thread_pool)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::shape_error)));
  // The check can fail: the kernel's types are the level's.
  CHECK(in_level_namespace(typeid(gradavg::detail::fused_params<float>)));
}

TEST_CASE("GRADAVG_ISA lowers the level of a process", "[.environment]") {
  // Run by ctest with GRADAVG_ISA=sse2 (tests/CMakeLists.txt).
  const char* environment = std::getenv("GRADAVG_ISA");
  REQUIRE(environment != nullptr);
  CHECK(gradavg::to_string(gradavg::simd_level_in_use()) == std::string(environment));
  CHECK(gradavg::force_simd_level(gradavg::cpu_simd_level()));  // force still overrides it
  CHECK(gradavg::simd_level_in_use() == gradavg::cpu_simd_level());
  gradavg::reset_simd_level();
  CHECK(gradavg::to_string(gradavg::simd_level_in_use()) == std::string(environment));
}
