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
//   paired/<type>/T:<T>/P:<P>/threads:<n>          P in {64Ki, 16Mi}; T in {2,4,8,16} for
//                                                  float, 8 for double
//   paired_model/<model>/float/T:<T>/threads:<n>   T in {4, 8}
// Flags (before Google Benchmark's own): --paired_rounds=N (default 11; model points run 3N).
#include <algorithm>
#include <chrono>
#include <cstdlib>
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
#include "towers.hpp"

namespace gradavg_bench {
namespace {

/// Model points run this many times the rounds of the others: their ratio sits near 1 and is
/// judged against 5%, finer than a dozen rounds resolve on a noisy machine.
constexpr std::size_t model_round_factor = 3;

/// One call shorter than this is repeated within a round, so that the clock's resolution and
/// the round's fixed costs stay small against what is measured.
constexpr double min_call_seconds = 2e-3;

/// One implementation in a comparison, with its timings.
struct contender {
  contender(std::string name_, std::unique_ptr<runner> kernel_, double bytes_)
      : name(std::move(name_)), kernel(std::move(kernel_)), bytes(bytes_) {}

  std::string name;
  std::unique_ptr<runner> kernel;
  double bytes = 0;           ///< credited per call
  std::size_t calls = 1;      ///< calls per round
  std::vector<double> times;  ///< seconds per call, one value per round
};

/// The contenders of one comparison point. hold() keeps the storage they point into; as the
/// base, it is destroyed after them.
struct comparison : holder {
  std::vector<contender> contenders;

  [[nodiscard]] const contender* find(std::string_view name) const {
    for (const contender& c : contenders)
      if (c.name == name) return &c;
    return nullptr;
  }
};

double seconds_of(runner& r, std::size_t calls) {
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t k = 0; k < calls; ++k) r.run();
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(stop - start).count();
}

/// Sets c.calls from the time of one call, made after the checking call (pages touched).
void calibrate(contender& c) {
  const double once = seconds_of(*c.kernel, 1);
  c.calls = once >= min_call_seconds ? 1 : static_cast<std::size_t>(min_call_seconds / std::max(once, 1e-9)) + 1;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  if (v.size() % 2 == 1) return *mid;
  return (*mid + *std::max_element(v.begin(), mid)) / 2;
}

/// Median over rounds of f(a.times[r], b.times[r]).
template <class F>
double median_ratio(const contender& a, const contender& b, F f) {
  std::vector<double> r;
  for (std::size_t i = 0; i < std::min(a.times.size(), b.times.size()); ++i) r.push_back(f(a.times[i], b.times[i]));
  return median(r);
}

/// Median over rounds of t(a) / t(b).
double time_ratio(const contender& a, const contender& b) {
  return median_ratio(a, b, [](double x, double y) { return x / y; });
}

/// Median over rounds of bandwidth(a) / bandwidth(b).
double bandwidth_ratio(const contender& a, const contender& b) {
  return median_ratio(a, b, [&](double x, double y) { return (a.bytes / x) / (b.bytes / y); });
}

/// The rounds: every iteration of the state is one round over all contenders.
void run_rounds(benchmark::State& state, comparison& cmp) {
  const std::size_t n = cmp.contenders.size();
  for (contender& c : cmp.contenders) {
    calibrate(c);
    c.times.reserve(static_cast<std::size_t>(state.max_iterations));
  }
  std::size_t round = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < n; ++i) {
      contender& c = cmp.contenders[(i + round) % n];
      c.times.push_back(seconds_of(*c.kernel, c.calls) / static_cast<double>(c.calls));
      benchmark::ClobberMemory();
    }
    ++round;
  }
  for (const contender& c : cmp.contenders) state.counters["GBps." + c.name] = c.bytes / median(c.times) / 1e9;
}

/// Reports an error from building (a factory that throws, a failed check) and skips.
bool skip_on_error(benchmark::State& state, const std::string& error) {
  if (error.empty()) return false;
  state.SkipWithError(error.c_str());
  return true;
}

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

/// Adds the copy limits of tower 0 on a chunk_pool: ordinary and non-temporal stores.
template <class S>
std::string add_copies(comparison& cmp, const S* src, std::size_t elements, int threads) {
  auto& pool = cmp.hold<chunk_pool>(threads);
  const limits::named_copy<S> copies[] = {{"copy", &limits::copy<S>}, {"copy_nt", &limits::copy_nt<S>}};
  for (const limits::named_copy<S>& k : copies) {
    S* dst = cmp.hold<aligned_buffer<S>>(elements).data();
    contender c{k.name, make_copy_runner(k, dst, src, elements, pool), 2.0 * static_cast<double>(elements) * sizeof(S)};
    if (std::string error = run_and_check_copy(*c.kernel, k.name, dst, src, elements); !error.empty()) return error;
    cmp.contenders.push_back(std::move(c));
  }
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

std::size_t take_rounds_flag(int& argc, char** argv) {
  std::size_t rounds = 11;
  constexpr std::string_view flag = "--paired_rounds=";
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with(flag))
      rounds = static_cast<std::size_t>(std::max(1L, std::strtol(argv[i] + flag.size(), nullptr, 10)));
    else
      argv[out++] = argv[i];
  }
  argc = out;
  return rounds;
}

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
  const std::size_t rounds = take_rounds_flag(argc, argv);
  const std::vector<int> threads = thread_counts();  // 1 and all cores
  const std::vector<std::size_t> sizes{std::size_t{1} << 16, std::size_t{1} << 24};
  register_points<float>({2, 4, 8, 16}, sizes, threads, rounds);
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
