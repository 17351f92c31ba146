// Paired benchmark: the performance targets' ratios measured by alternation, so that the machine's
// bandwidth drifting between runs (on a shared VM, by ±20% over minutes) moves every contender
// of a ratio alike.
//
// One benchmark is one comparison point. Each iteration is one round: every contender runs once
// (several calls when one call is shorter than min_call_seconds), the round's start rotating
// through the contenders, each timed on its own with a steady clock. Every contender is checked
// against the double reference (copies: bitwise) before the rounds start. Reported counters:
//   GBps.<c>          credited bytes / median seconds of contender c
//   <op>.best_nt      1 when gradavg_nt's median is below gradavg's (gradavg-best is then nt)
//   <op>.vs.<peer>    median over rounds of t(peer) / t(gradavg-best)
//   <op>.of.<copy>    median over rounds of bandwidth(gradavg-best) / bandwidth(copy), for
//                     copy and copy_nt
//   sq_over_mean      median over rounds of t(best mean_sq) / t(best mean)
//   <impl>.vars_over_flat (models)  median over rounds of t(variables) / t(one flat buffer)
// A median of per-round ratios: a round takes about a second at DRAM sizes, well inside the
// time over which the bandwidth drifts.
//
// Names (run_grid.py parses them):
//   paired/<type>/T:<T>/P:<P>/threads:<n>          P in {64Ki, 16Mi}; T in {2,4,8,16,32}
//                                                  for float (32: the accumulator-block path),
//                                                  8 for double
//   paired_model/<model>/float/T:<T>/threads:<n>   T in {4, 8}
// Flags (before Google Benchmark's own): --paired_rounds=N (default 11; model points run 3N).
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.hpp"
#include "harness.hpp"
#include "limits.hpp"
#include "model_data.hpp"
#include "model_shapes.hpp"
#include "parallel.hpp"
#include "peers.hpp"
#include "rounds.hpp"
#include "towers.hpp"

namespace gradavg_bench {
namespace {

/// Model points run this many times the rounds of the others: their ratio sits near 1 and is
/// judged against 5%, finer than a dozen rounds resolve on a noisy machine.
constexpr std::size_t model_round_factor = 3;

// ---- Grid points. ---------------------------------------------------------------------------

/// Adds a peer for op `what` over `towers` to cmp; runs it once and checks it. Returns an error.
template <class S>
std::string add_peer(comparison& cmp, const std::string& name, op what, std::span<const S* const> towers,
                     std::size_t elements, int threads, peer_factory<S> make) {
  checked_runner c = checked_peer<S>(cmp, what, towers, elements, threads, make);
  const std::string full_name = std::string(op_name(what)) + "." + name;
  if (!c.error.empty()) return full_name + ": " + c.error;
  cmp.contenders.emplace_back(full_name, std::move(c.kernel), credited_bytes<S>(what, towers.size(), elements));
  return {};
}

/// gradavg-best for `what`: gradavg or gradavg_nt, whichever has the lower median time.
const contender& best_of(const comparison& cmp, op what) {
  const std::string o = op_name(what);
  const contender& plain = *cmp.find(o + ".gradavg");
  const contender& nt = *cmp.find(o + ".gradavg_nt");
  return median(nt.times) < median(plain.times) ? nt : plain;
}

/// The ratios of one op: gradavg-best against each peer and each copy.
void report_op(benchmark::State& state, const comparison& cmp, op what) {
  const std::string o = op_name(what);
  const contender& best = best_of(cmp, what);
  state.counters[o + ".best_nt"] = best.name == o + ".gradavg_nt" ? 1 : 0;
  for (const char* peer : {"eigen_per_tower", "stacked_tensor", "onednn_sum"})
    if (const contender* c = cmp.find(o + "." + peer)) state.counters[o + ".vs." + peer] = time_ratio(*c, best);
  for (const char* copy : {"copy", "copy_nt"})
    if (const contender* c = cmp.find(copy)) state.counters[o + ".of." + copy] = bandwidth_ratio(best, *c);
}

template <class S>
void paired_point(benchmark::State& state, std::size_t tower_count, std::size_t elements, int threads) {
  comparison cmp;
  std::string error;
  try {
    const auto& towers = cmp.hold<std::vector<const S*>>(towers_cache().get<S>(tower_count, elements));
    error = add_copies<S>(cmp, towers[0], elements, threads);
    for (op what : {op::mean, op::mean_sq}) {
      struct entry {
        const char* name;
        peer_factory<S> make;
      };
      std::vector<entry> peers{{"gradavg", &make_gradavg<S>},
                               {"gradavg_nt", &make_gradavg_nt<S>},
                               {"eigen_per_tower", &make_eigen_per_tower<S>},
                               {"stacked_tensor", &make_stacked_tensor<S>}};
#ifdef GRADAVG_BENCH_HAVE_ONEDNN
      if constexpr (std::is_same_v<S, float>) peers.push_back({"onednn_sum", &make_onednn_sum});
#endif
      for (const entry& e : peers)
        if (error.empty()) error = add_peer<S>(cmp, e.name, what, towers, elements, threads, e.make);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (skip_on_error(state, error)) return;
  run_rounds(state, cmp);
  report_op(state, cmp, op::mean);
  report_op(state, cmp, op::mean_sq);
  state.counters["sq_over_mean"] = time_ratio(best_of(cmp, op::mean_sq), best_of(cmp, op::mean));
}

// ---- Model points. --------------------------------------------------------------------------

void paired_model(benchmark::State& state, const model_shapes& m, std::size_t tower_count, int threads) {
  using S = model_value;
  comparison cmp;
  std::string error;
  try {
    model_data& d = get_model(m, tower_count);
    const auto& towers = cmp.hold<std::vector<const S*>>(d.tower_ptrs(tower_count));
    const double bytes = credited_bytes<S>(op::mean_sq, tower_count, d.total);
    // Every contender writes d.mean and d.sq: each is checked right after its first call.
    struct entry {
      const char* name;
      vars_factory<S> vars;  // null: the flat layout, with flat
      peer_factory<S> flat;
    };
    const entry impls[] = {{"gradavg.vars", &make_gradavg_vars<S>, nullptr},
                           {"gradavg.flat", nullptr, &make_gradavg<S>},
                           {"gradavg_nt.vars", &make_gradavg_nt_vars<S>, nullptr},
                           {"gradavg_nt.flat", nullptr, &make_gradavg_nt<S>}};
    for (const entry& e : impls) {
      checked_runner c = checked_model_runner(m, d, towers, threads, e.vars, e.flat);
      if (!c.error.empty()) {
        error = std::string(e.name) + ": " + c.error;
        break;
      }
      cmp.contenders.emplace_back(e.name, std::move(c.kernel), bytes);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (skip_on_error(state, error)) return;
  run_rounds(state, cmp);
  for (const char* impl : {"gradavg", "gradavg_nt"})
    state.counters[std::string(impl) + ".vars_over_flat"] =
        time_ratio(*cmp.find(std::string(impl) + ".vars"), *cmp.find(std::string(impl) + ".flat"));
}

// ---- Registration. --------------------------------------------------------------------------

template <class S>
void register_points(const std::vector<std::size_t>& tower_counts, const std::vector<std::size_t>& sizes,
                     const std::vector<int>& thread_counts, std::size_t rounds) {
  // (P, threads, T) order: the tower data for one P is generated once.
  for (std::size_t elements : sizes)
    for (int threads : thread_counts)
      for (std::size_t towers : tower_counts) {
        const std::string name = std::string("paired/") + type_name<S>() + "/T:" + std::to_string(towers) +
                                 "/P:" + std::to_string(elements) + "/threads:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [=](benchmark::State& s) { paired_point<S>(s, towers, elements, threads); })
            ->Iterations(static_cast<benchmark::IterationCount>(rounds))
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
}

}  // namespace
}  // namespace gradavg_bench

int main(int argc, char** argv) {
  using namespace gradavg_bench;
  const std::size_t rounds = take_count_flag(argc, argv, "--paired_rounds=", 11);
  const std::vector<int> threads = thread_counts();  // 1 and all cores
  const std::vector<std::size_t> sizes{std::size_t{1} << 16, std::size_t{1} << 24};
  register_points<float>({2, 4, 8, 16, 32}, sizes, threads, rounds);
  register_points<double>({8}, sizes, threads, rounds);

  static const model_shapes models[] = {resnet50_shapes(), bert_base_shapes()};
  for (const model_shapes& m : models) {
    check_counts(m);
    for (int n : threads)
      for (std::size_t towers : {std::size_t{4}, std::size_t{8}}) {
        const std::string name = "paired_model/" + m.name + "/float/T:" + std::to_string(towers) +
                                 "/threads:" + std::to_string(n);
        benchmark::RegisterBenchmark(name.c_str(), [&m, towers, n](benchmark::State& s) { paired_model(s, m, towers, n); })
            ->Iterations(static_cast<benchmark::IterationCount>(model_round_factor * rounds))
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
  }
  benchmark::AddCustomContext("paired_rounds", std::to_string(rounds));
  benchmark::AddCustomContext("copy_nt_store", limits::streaming_store_name<float>());
#ifdef GRADAVG_BENCH_HAVE_ONEDNN
  benchmark::AddCustomContext("onednn", "built");
#else
  benchmark::AddCustomContext("onednn", "not found at configure time");
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
