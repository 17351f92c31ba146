// The kernel chosen at run time against the kernel compiled for this machine: the same gradavg
// calls from a unit built without instruction-set flags (as distributions, vcpkg and most CMake
// projects build) and from a unit built with -march=native, linked into this one program
// (dispatch_unit.hpp) and timed by alternation (rounds.hpp). Every contender's outputs (and sum
// of mean^2) are checked bit for bit against the native unit's before the rounds; a mismatch
// skips the point with its message.
//
// Points: paired_dispatch/<float|half|bfloat16>/T:<T>/P:<P>/<op>/threads:1, T in {2, 4, 8, 16},
// P = 64Ki (in cache) and --dispatch_elements (default 16Mi: from memory), op:
//   mean      means only
//   mean_sq   means and squares
//   all       weights (uneven) + scale 2^-10 + non-finite report + statistics, means only
// Contenders:
//   native          the -march=native unit
//   portable        the unit without flags, at the level it picks (this CPU's widest)
//   portable_avx2   the same, forced to AVX2 (when the CPU has AVX-512)
//   portable_sse2   the same, forced to SSE2
// Counters: <c>.over.native = median over rounds of t(c) / t(native); GBps.<c> (bytes credited
// as bench_fused.cpp does: (T+1)·P elements, (T+2)·P with squares).
// Flags (before Google Benchmark's own): --dispatch_rounds=N (default 11), --dispatch_elements=N.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dispatch_unit.hpp"
#include "rounds.hpp"

namespace gradavg_bench {
namespace {

using dispatch::tower_list;

enum class dispatch_op { mean, mean_sq, all };

const char* op_name(dispatch_op op) {
  return op == dispatch_op::mean ? "mean" : op == dispatch_op::mean_sq ? "mean_sq" : "all";
}

template <class S>
const char* type_name() {
  if constexpr (std::is_same_v<S, float>) return "float";
  else if constexpr (std::is_same_v<S, Eigen::half>) return "half";
  else return "bfloat16";
}

template <class S>
dispatch::average_fn<S> entry(const dispatch::unit& u) {
  if constexpr (std::is_same_v<S, float>) return u.average_float;
  else if constexpr (std::is_same_v<S, Eigen::half>) return u.average_half;
  else return u.average_bfloat16;
}

/// The towers of one point: T gradients of P values in [-1, 1), one variable each.
template <class S>
struct point_data {
  std::vector<aligned_buffer<S>> storage;
  tower_list<S> towers;
  std::vector<double> weights;

  point_data(std::size_t towers_count, std::size_t elements) {
    std::uint64_t state = 0x9e3779b97f4a7c15u ^ (towers_count * 131 + elements);
    for (std::size_t k = 0; k < towers_count; ++k) {
      storage.emplace_back(elements);
      S* p = storage.back().data();
      for (std::size_t i = 0; i < elements; ++i) {
        state = state * 6364136223846793005u + 1442695040888963407u;
        p[i] = static_cast<S>(static_cast<float>(static_cast<double>(state >> 40) / double(1u << 23) - 1.0));
      }
      towers.push_back({{std::span<const S>(p, elements), 0}});
      weights.push_back(k + 1 == towers_count ? 20.0 : 32.0);
    }
  }
};

/// One contender's outputs and call.
template <class S>
struct contender_state {
  aligned_buffer<S> mean, square;
  std::span<S> mean_span, square_span;
  double statistic = 0;
};

template <class S>
void dispatch_point(benchmark::State& state, std::size_t towers, std::size_t elements, dispatch_op op) {
  comparison cmp;
  auto& data = cmp.hold<point_data<S>>(towers, elements);
  gradavg::options opts;
  if (op == dispatch_op::all) {
    opts.weights = data.weights;
    opts.scale = 1.0 / 1024;
    opts.on_nonfinite = gradavg::nonfinite_policy::report;
    opts.statistics = true;
  }
  const bool squares = op == dispatch_op::mean_sq;
  const double bytes = static_cast<double>((towers + (squares ? 2 : 1)) * elements * sizeof(S));

  struct named {
    const char* name;
    dispatch::unit unit;
    int forced;  // a simd_level to force around each call, or -1
  };
  const auto cpu = gradavg::cpu_simd_level();
  std::vector<named> units = {{"native", dispatch::native_unit(), -1}, {"portable", dispatch::portable_unit(), -1}};
  if (cpu == gradavg::simd_level::avx512)
    units.push_back({"portable_avx2", dispatch::portable_unit(), static_cast<int>(gradavg::simd_level::avx2)});
  if (cpu > gradavg::simd_level::sse2)
    units.push_back({"portable_sse2", dispatch::portable_unit(), static_cast<int>(gradavg::simd_level::sse2)});

  const contender_state<S>* reference = nullptr;
  for (const named& u : units) {
    auto& st = cmp.hold<contender_state<S>>();
    st.mean = aligned_buffer<S>(elements);
    st.mean_span = std::span<S>(st.mean.data(), elements);
    if (squares) {
      st.square = aligned_buffer<S>(elements);
      st.square_span = std::span<S>(st.square.data(), elements);
    }
    const auto fn = entry<S>(u.unit);
    const int forced = u.forced;
    auto r = make_fn_runner([&data, &st, &opts, fn, forced, squares] {
      if (forced >= 0) gradavg::force_simd_level(static_cast<gradavg::simd_level>(forced));
      st.statistic = fn(data.towers, std::span<std::span<S>>(&st.mean_span, 1),
                        squares ? std::span<std::span<S>>(&st.square_span, 1) : std::span<std::span<S>>(), opts);
      if (forced >= 0) gradavg::reset_simd_level();
    });
    r->run();
    if (reference == nullptr) {
      reference = &st;
    } else {
      const bool same = std::memcmp(st.mean.data(), reference->mean.data(), elements * sizeof(S)) == 0 &&
                        (!squares || std::memcmp(st.square.data(), reference->square.data(), elements * sizeof(S)) == 0) &&
                        std::memcmp(&st.statistic, &reference->statistic, sizeof(double)) == 0;
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
}

template <class S>
void register_type(std::size_t elements, std::size_t rounds) {
  for (std::size_t size : {std::size_t{65536}, elements})
    for (std::size_t towers : {2, 4, 8, 16})
      for (dispatch_op op : {dispatch_op::mean, dispatch_op::mean_sq, dispatch_op::all}) {
        const std::string name = std::string("paired_dispatch/") + type_name<S>() + "/T:" + std::to_string(towers) +
                                 "/P:" + std::to_string(size) + "/" + op_name(op) + "/threads:1";
        benchmark::RegisterBenchmark(name.c_str(),
                                     [=](benchmark::State& s) { dispatch_point<S>(s, towers, size, op); })
            ->Iterations(static_cast<benchmark::IterationCount>(rounds))
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
}

}  // namespace
}  // namespace gradavg_bench

int main(int argc, char** argv) {
  using namespace gradavg_bench;
  const std::size_t rounds = take_count_flag(argc, argv, "--dispatch_rounds=", 11);
  const std::size_t elements = take_count_flag(argc, argv, "--dispatch_elements=", std::size_t{1} << 24);
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
