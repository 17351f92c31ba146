// The same bits on every CPU: a fixed table of cases (element types, output types, tower counts,
// tails, weights, scale, statistics, non-finite inputs), each summarised by a 64-bit FNV-1a hash
// of every output byte and every statistic, checked in (tests/support/bit_patterns.inc) as the x86-64
// baseline level (SSE2) computed it. Every level this machine runs must give those bits: on
// x86-64 each level in turn (forced), on aarch64 NEON (the arm stage, under qemu). The values
// themselves are checked against references by the other tests; this one pins them across
// instruction sets, architectures and versions.
//
// GRADAVG_WRITE_BIT_PATTERNS=1 prints the table as computed here (to regenerate it after an
// intended change of results: run at SSE2, GRADAVG_ISA=sse2, and replace the file).
#include <gradavg/gradavg.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "simd_levels.hpp"

namespace {

struct expected_pattern {
  const char* name;
  std::uint64_t hash;
};

constexpr expected_pattern expected_patterns[] = {
#include "bit_patterns.inc"
};

struct fnv1a {
  std::uint64_t value = 0xcbf29ce484222325u;
  void add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) value = (value ^ p[i]) * 0x100000001b3u;
  }
  template <class T>
  void add(const T& x) {
    add(&x, sizeof x);
  }
};

/// Deterministic values from integers alone (no library distribution): multiples of 2^-23 in
/// [-1, 1), times a magnitude picked per element; some exact zeros.
struct value_source {
  std::uint64_t state;
  double next() {
    state += 0x9e3779b97f4a7c15u;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    z ^= z >> 31;
    const double unit = static_cast<double>(z >> 41) / static_cast<double>(1u << 22) - 1.0;
    switch (z & 7u) {
      case 0:
        return 0.0;
      case 1:
        return unit * 0x1p-12;
      case 2:
        return unit * 0x1p10;
      default:
        return unit;
    }
  }
};

template <class S>
std::vector<std::vector<std::vector<S>>> make_towers(std::size_t towers, const std::vector<std::size_t>& sizes,
                                                     bool specials, std::uint64_t seed) {
  value_source source{seed};
  std::vector<std::vector<std::vector<S>>> t(towers);
  for (auto& tower : t)
    for (std::size_t n : sizes) {
      std::vector<S> v(n);
      for (auto& x : v) x = static_cast<S>(static_cast<float>(source.next()));
      tower.push_back(std::move(v));
    }
  if (specials) {
    t[0].back()[0] = static_cast<S>(std::numeric_limits<float>::quiet_NaN());
    t[towers - 1].back()[1] = static_cast<S>(-std::numeric_limits<float>::infinity());
  }
  return t;
}

/// One case's hash: means, squares, per-variable and total statistics.
template <class S, class O>
std::uint64_t case_hash(std::size_t towers, const std::vector<std::size_t>& sizes, bool specials,
                        gradavg::options opts) {
  const auto data = make_towers<S>(towers, sizes, specials, towers * 1000 + sizes.size());
  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < sizes.size(); ++i)
      tg[k].push_back({std::span<const S>(data[k][i]), static_cast<int>(i)});
  std::vector<std::vector<O>> means, squares;
  std::vector<std::span<O>> m, q;
  for (std::size_t n : sizes) {
    means.emplace_back(n);
    squares.emplace_back(n);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    m.push_back(std::span<O>(means[i]));
    q.push_back(std::span<O>(squares[i]));
  }
  std::vector<gradavg::variable_statistics> per_variable(sizes.size());
  opts.compute.per_variable = per_variable;
  const gradavg::summary s = gradavg::average_gradients_into(tg, m, q, opts);
  fnv1a h;
  for (const auto& v : means) h.add(v.data(), v.size() * sizeof(O));
  for (const auto& v : squares) h.add(v.data(), v.size() * sizeof(O));
  h.add(s.averaged);
  h.add(s.nonfinite_variables);
  if (opts.compute.statistics) {
    h.add(s.sum_mean_squared);
    h.add(s.sum_mean_of_squares);
    for (const auto& v : per_variable) {
      h.add(v.sum_mean_squared);
      h.add(v.sum_mean_of_squares);
    }
  }
  return h.value;
}

template <class S, class O>
void add_cases(std::vector<std::pair<std::string, std::uint64_t>>& out, const char* type) {
  const std::vector<std::size_t> sizes = {1, 5, 16, 33, 100, 1031, 4099};
  for (std::size_t towers : {1, 3, 4, 17}) {
    const std::string prefix = std::string(type) + "/T:" + std::to_string(towers);
    out.emplace_back(prefix + "/plain", case_hash<S, O>(towers, sizes, false, {}));
    std::vector<double> weights;
    for (std::size_t k = 0; k < towers; ++k) weights.push_back(k % 3 == 1 ? 0.0 : 1.0 + 0.5 * static_cast<double>(k));
    if (towers == 1) weights[0] = 2.0;
    gradavg::options fused{.compute = {.scale = 0.375, .on_nonfinite = gradavg::nonfinite_policy::report, .statistics = true}};
    fused.compute.weights = weights;
    out.emplace_back(prefix + "/fused", case_hash<S, O>(towers, sizes, false, fused));
    out.emplace_back(prefix + "/nonfinite", case_hash<S, O>(towers, sizes, true, fused));
    if constexpr (std::is_same_v<S, float>) {
      fused.compute.accumulate = gradavg::accumulation::double_precision;
      out.emplace_back(prefix + "/fused_double", case_hash<S, O>(towers, sizes, false, fused));
    }
  }
}

std::vector<std::pair<std::string, std::uint64_t>> computed_patterns() {
  std::vector<std::pair<std::string, std::uint64_t>> out;
  add_cases<float, float>(out, "float");
  add_cases<double, double>(out, "double");
  add_cases<Eigen::half, Eigen::half>(out, "half");
  add_cases<Eigen::half, float>(out, "half_to_float");
  add_cases<Eigen::bfloat16, Eigen::bfloat16>(out, "bfloat16");
  add_cases<Eigen::bfloat16, float>(out, "bfloat16_to_float");
  return out;
}

void check_against_table() {
  const auto computed = computed_patterns();
  if (std::getenv("GRADAVG_WRITE_BIT_PATTERNS") != nullptr)
    for (const auto& [name, hash] : computed)
      std::printf("{\"%s\", 0x%016llxull},\n", name.c_str(), static_cast<unsigned long long>(hash));
  REQUIRE(computed.size() == std::size(expected_patterns));
  for (std::size_t i = 0; i < computed.size(); ++i) {
    INFO("case " << computed[i].first);
    REQUIRE(computed[i].first == expected_patterns[i].name);
    CHECK(computed[i].second == expected_patterns[i].hash);
  }
}

}  // namespace

TEST_CASE("every case gives the checked-in bits at every level this machine runs") {
  const auto cpu = gradavg::cpu_simd_level();
  if (cpu < gradavg::simd_level::sse2) {  // not x86-64: the one compiled level
    INFO("level " << gradavg::to_string(gradavg::simd_level_in_use()));
    check_against_table();
    return;
  }
  gradavg_test::simd_level_reset reset;
  for (auto level : gradavg_test::runnable_simd_levels()) {
    REQUIRE(gradavg::force_simd_level(level));
    INFO("level " << gradavg::to_string(gradavg::simd_level_in_use()));
    check_against_table();
  }
}
