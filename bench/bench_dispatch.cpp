// The kernel chosen at run time against the kernel compiled for this machine: the same gradavg
// calls from a unit built without instruction-set flags (as distributions, vcpkg and most CMake
// projects build) and from a unit built with -march=native, linked into this one program
// (dispatch_unit.hpp) and timed by alternation (rounds.hpp). Every contender writes the same
// output buffers; its outputs (and sum of mean^2) are checked bit for bit against the native
// unit's before the rounds; a mismatch skips the point with its message.
//
// Points: paired_dispatch/<float|half|bfloat16>/T:<T>/P:<P>/<op>/threads:1, T in {2, 4, 8, 16},
// P = 64Ki (in cache) and --dispatch_elements (default 16Mi: from memory), op:
//   mean      means only
//   mean_nt   means only, options.run.stores = store_policy::streaming
//   mean_sq   means and squares
//   all       weights (uneven) + scale 2^-10 + non-finite report + statistics, means only
//             (with squares too in the V:1000x64 points)
// and paired_dispatch/float/T:4/V:1000x64/<mean_sq|all>/threads:1: many small variables.
// Contenders:
//   native          the -march=native unit
//   portable        the unit without flags, at the level it picks (this CPU's widest)
//   portable_avx512 the same, forced to AVX-512 without BF16 (when the CPU has AVX-512 BF16)
//   portable_avx2   the same, forced to AVX2 (when the CPU has AVX-512)
//   portable_sse2   the same, forced to SSE2
//   v3_avx2         the -march=x86-64-v3 unit forced to AVX2 (when the CPU has AVX-512): an AVX2
//                   machine's build, against which portable_avx2 is an AVX2 machine's portable one
// Counters: <c>.over.native = median over rounds of t(c) / t(native); portable_avx2.over.v3_avx2
// likewise; GBps.<c> (bytes credited
// as bench_fused.cpp does: (T+1)·P elements, (T+2)·P with squares).
// Flags (before Google Benchmark's own): --dispatch_rounds=N (default 11), --dispatch_elements=N.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "dispatch_unit.hpp"
#include "rounds.hpp"

namespace gradavg_bench {
namespace {

using dispatch::tower_list;

enum class dispatch_op { mean, mean_nt, mean_sq, all };

const char* op_name(dispatch_op op) {
  switch (op) {
    case dispatch_op::mean:
      return "mean";
    case dispatch_op::mean_nt:
      return "mean_nt";
    case dispatch_op::mean_sq:
      return "mean_sq";
    case dispatch_op::all:
      return "all";
  }
  return "";
}

template <class S>
const char* type_name() {
  if constexpr (std::is_same_v<S, float>)
    return "float";
  else if constexpr (std::is_same_v<S, Eigen::half>)
    return "half";
  else
    return "bfloat16";
}

template <class S>
dispatch::average_fn<S> entry(const dispatch::unit& u) {
  if constexpr (std::is_same_v<S, float>)
    return u.average_float;
  else if constexpr (std::is_same_v<S, Eigen::half>)
    return u.average_half;
  else
    return u.average_bfloat16;
}

/// The towers of one point: T gradients of P values in [-1, 1), as V variables of P / V each.
template <class S>
struct point_data {
  std::vector<aligned_buffer<S>> storage;
  tower_list<S> towers;
  std::vector<double> weights;

  point_data(std::size_t towers_count, std::size_t elements, std::size_t variables) {
    std::uint64_t state = 0x9e3779b97f4a7c15u ^ (towers_count * 131 + elements);
    for (std::size_t k = 0; k < towers_count; ++k) {
      storage.emplace_back(elements);
      S* p = storage.back().data();
      for (std::size_t i = 0; i < elements; ++i) {
        state = state * 6364136223846793005u + 1442695040888963407u;
        p[i] = static_cast<S>(static_cast<float>(static_cast<double>(state >> 40) / double(1u << 23) - 1.0));
      }
      towers.emplace_back();
      const std::size_t size = elements / variables;
      for (std::size_t i = 0; i < variables; ++i)
        towers.back().push_back({std::span<const S>(p + i * size, size), static_cast<int>(i)});
      weights.push_back(k + 1 == towers_count ? 20.0 : 32.0);
    }
  }
};

/// The outputs every contender writes (the same addresses for all: the overlap check's work
/// depends on them), and each contender's sum of mean^2.
template <class S>
struct point_outputs {
  aligned_buffer<S> mean, square;
  std::vector<std::span<S>> mean_spans, square_spans;
};

template <class S>
void dispatch_point(benchmark::State& state, std::size_t towers, std::size_t elements, std::size_t variables,
                    dispatch_op op) {
  comparison cmp;
  auto& data = cmp.hold<point_data<S>>(towers, elements, variables);
  gradavg::options opts;
  if (op == dispatch_op::all) {
    opts.compute.weights = data.weights;
    opts.compute.scale = 1.0 / 1024;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
    opts.compute.statistics = true;
  }
  opts.run.stores = (op == dispatch_op::mean_nt) ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
  const bool squares = op == dispatch_op::mean_sq || (op == dispatch_op::all && variables > 1);
  const double bytes = static_cast<double>((towers + (squares ? 2 : 1)) * elements * sizeof(S));

  struct named {
    const char* name;
    dispatch::unit unit;
    int forced;  // a simd_level to force around each call, or -1
  };
  const auto cpu = gradavg::cpu_simd_level();
  std::vector<named> units = {{"native", dispatch::native_unit(), -1}, {"portable", dispatch::portable_unit(), -1}};
  if (cpu == gradavg::simd_level::avx512_bf16)
    units.push_back({"portable_avx512", dispatch::portable_unit(), static_cast<int>(gradavg::simd_level::avx512)});
  if (cpu >= gradavg::simd_level::avx512)
    units.push_back({"portable_avx2", dispatch::portable_unit(), static_cast<int>(gradavg::simd_level::avx2)});
  if (cpu > gradavg::simd_level::sse2)
    units.push_back({"portable_sse2", dispatch::portable_unit(), static_cast<int>(gradavg::simd_level::sse2)});
  if (cpu >= gradavg::simd_level::avx512)
    units.push_back({"v3_avx2", dispatch::v3_unit(), static_cast<int>(gradavg::simd_level::avx2)});

  auto& out = cmp.hold<point_outputs<S>>();
  const std::size_t size = elements / variables;
  out.mean = aligned_buffer<S>(elements);
  for (std::size_t i = 0; i < variables; ++i) out.mean_spans.emplace_back(out.mean.data() + i * size, size);
  if (squares) {
    out.square = aligned_buffer<S>(elements);
    for (std::size_t i = 0; i < variables; ++i) out.square_spans.emplace_back(out.square.data() + i * size, size);
  }
  std::vector<S> reference_mean, reference_square;
  double reference_statistic = 0;
  for (const named& u : units) {
    const auto fn = entry<S>(u.unit);
    const int forced = u.forced;
    auto& statistic = cmp.hold<double>(0.0);
    auto r = make_fn_runner([&data, &out, &statistic, &opts, fn, forced] {
      if (forced >= 0) gradavg::force_simd_level(static_cast<gradavg::simd_level>(forced));
      statistic = fn(data.towers, out.mean_spans, out.square_spans, opts);
      if (forced >= 0) gradavg::reset_simd_level();
    });
    const S unwritten = static_cast<S>(std::numeric_limits<float>::quiet_NaN());  // shows an output left unwritten
    std::fill_n(out.mean.data(), elements, unwritten);
    if (squares) std::fill_n(out.square.data(), elements, unwritten);
    r->run();
    if (reference_mean.empty()) {
      reference_mean.assign(out.mean.data(), out.mean.data() + elements);
      if (squares) reference_square.assign(out.square.data(), out.square.data() + elements);
      reference_statistic = statistic;
    } else {
      const bool same =
          std::memcmp(out.mean.data(), reference_mean.data(), elements * sizeof(S)) == 0 &&
          (!squares || std::memcmp(out.square.data(), reference_square.data(), elements * sizeof(S)) == 0) &&
          std::memcmp(&statistic, &reference_statistic, sizeof(double)) == 0;
      if (!same) {
        state.SkipWithError((std::string(u.name) + " differs from native").c_str());
        return;
      }
    }
    cmp.contenders.emplace_back(u.name, std::move(r), bytes);
  }
  run_rounds(state, cmp);
  const contender* native = cmp.find("native");
  for (const contender& c : cmp.contenders)
    if (&c != native) state.counters[c.name + ".over.native"] = time_ratio(c, *native);
  if (const contender* v3 = cmp.find("v3_avx2"))
    state.counters["portable_avx2.over.v3_avx2"] = time_ratio(*cmp.find("portable_avx2"), *v3);
}

template <class S>
void register_point(const std::string& name, std::size_t rounds, std::size_t towers, std::size_t elements,
                    std::size_t variables, dispatch_op op) {
  benchmark::RegisterBenchmark(name.c_str(),
                               [=](benchmark::State& s) { dispatch_point<S>(s, towers, elements, variables, op); })
      ->Iterations(static_cast<benchmark::IterationCount>(rounds))
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

template <class S>
void register_type(std::size_t elements, std::size_t rounds) {
  for (std::size_t size : {std::size_t{65536}, elements})
    for (std::size_t towers : {2, 4, 8, 16})
      for (dispatch_op op : {dispatch_op::mean, dispatch_op::mean_nt, dispatch_op::mean_sq, dispatch_op::all}) {
        const std::string name = std::string("paired_dispatch/") + type_name<S>() + "/T:" + std::to_string(towers) +
                                 "/P:" + std::to_string(size) + "/" + op_name(op) + "/threads:1";
        register_point<S>(name, rounds, towers, size, 1, op);
      }
}

}  // namespace
}  // namespace gradavg_bench

int main(int argc, char** argv) {
  using namespace gradavg_bench;
  const std::size_t rounds = take_count_flag(argc, argv, "--dispatch_rounds=", 11);
  const std::size_t elements = take_count_flag(argc, argv, "--dispatch_elements=", std::size_t{1} << 24);
  for (dispatch_op op : {dispatch_op::mean_sq, dispatch_op::all})
    register_point<float>(std::string("paired_dispatch/float/T:4/V:1000x64/") + op_name(op) + "/threads:1", rounds, 4,
                          64000, 1000, op);
  register_type<float>(elements, rounds);
  register_type<Eigen::half>(elements, rounds);
  register_type<Eigen::bfloat16>(elements, rounds);
  benchmark::AddCustomContext("dispatch_rounds", std::to_string(rounds));
  benchmark::AddCustomContext("native_level", std::string(gradavg::to_string(dispatch::native_unit().level_in_use())));
  benchmark::AddCustomContext("portable_level",
                              std::string(gradavg::to_string(dispatch::portable_unit().level_in_use())));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
