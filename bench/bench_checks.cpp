// What average_gradients_into's checks cost, measured by alternation in one run.
//
// small/V:<V>/n:<n>/T:<T>   V variables of n floats, T towers, means + squares, one thread.
//   Each iteration is one round: every contender runs `calls` calls back to back, timed on its
//   own, the round's start rotating through the contenders. Counters are medians over rounds of
//   microseconds per call (us.<contender>) and of per-round ratios to the bare loop
//   (<contender>.vs.bare):
//     bare          a fused loop over the same elements (sum and sum of squares per element,
//                   towers unrolled), no checks: the floor
//     bare_checked  the least a step that checks before it writes must do: every entry's pointer,
//                   size and variable, and every output's pointer and size, compared with a
//                   compact copy of the first call's (one pointer per buffer, one size per
//                   variable), then the bare loop over the copy's pointers. What any plan
//                   costs at least, in this layout
//     plan          gradavg with a gradavg::plan: each buffer's presence, pointer, size and
//                   contiguity compared with the proof of the first call, nothing else checked
//     plan_fused    the same with the fused step's non-finite report and statistics (the bare
//                   loop computes neither: against plan, what they add)
//     uncached      gradavg, default checks (alias_check::all), no plan: sort and sweep every call
//     same_variable gradavg, the partial check (no sort)
//     none          gradavg, no overlap check
//   Every contender's results are checked against the bare loop's (bitwise for the means of T
//   towers summed in the same order) before the rounds start.
// checks/<model>/T:<T>   the checks alone on a model's layout (BERT-base: 199 variables),
//   through gradavg::detail::validate_into on buffers that are allocated but never touched:
//   the averaging of the same call moves (T+2) * params * 4 bytes (4.4 GB for BERT-base at T=8).
//   Modes: the full check; the full check proving again into a plan's proof of the same layout
//   (the ranges compared one by one, the sort skipped); no overlap check.
#include <benchmark/benchmark.h>

#include <gradavg/gradavg.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "model_shapes.hpp"

namespace {

using entry = std::pair<std::span<const float>, int>;
using towers_t = std::vector<std::vector<entry>>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// The floor: every element's sum and sum of squares over 4 towers, in tower order, then / 4;
/// n known at compile time and every pointer restrict-qualified, so the compiler vectorizes it.
template <std::size_t N>
void bare_variable(const float* __restrict a, const float* __restrict b, const float* __restrict c,
                   const float* __restrict d, float* __restrict mi, float* __restrict qi) {
  for (std::size_t j = 0; j < N; ++j) {
    mi[j] = (((a[j] + b[j]) + c[j]) + d[j]) / 4.0f;
    qi[j] = (((a[j] * a[j] + b[j] * b[j]) + c[j] * c[j]) + d[j] * d[j]) / 4.0f;
  }
}

template <std::size_t N>
void bare_loop(const std::vector<std::vector<const float*>>& g, const std::vector<float*>& m,
               const std::vector<float*>& q) {
  for (std::size_t i = 0; i < m.size(); ++i) bare_variable<N>(g[i][0], g[i][1], g[i][2], g[i][3], m[i], q[i]);
}

/// What a checked step keeps of the first call: per variable, its 4 gradients' pointers, its
/// outputs' pointers (in that order) and its element count.
struct compact_layout {
  std::vector<const float*> pointers;  // [i * 6 + slot]
  std::vector<std::size_t> sizes;      // [i]
};

/// Whether every buffer of this step is the one kept (pointer and size; an entry's variable too),
/// read once each.
bool matches_compact(const compact_layout& kept, const towers_t& tg,
                     const std::vector<std::span<float>>& m, const std::vector<std::span<float>>& q) {
  const std::size_t variables = kept.sizes.size();
  if (m.size() != variables || q.size() != variables) return false;
  for (const auto& tower : tg)
    if (tower.size() != variables) return false;
  bool same = true;
  for (std::size_t i = 0; i < variables; ++i) {
    const std::size_t size = kept.sizes[i];
    const float* const* p = kept.pointers.data() + i * 6;
    for (std::size_t k = 0; k < 4; ++k)
      same &= tg[k][i].first.data() == p[k] && tg[k][i].first.size() == size && tg[k][i].second == static_cast<int>(i);
    same &= m[i].data() == p[4] && m[i].size() == size && q[i].data() == p[5] && q[i].size() == size;
  }
  return same;
}

/// The bare loop over a compact layout's pointers.
template <std::size_t N>
void bare_compact(const compact_layout& kept) {
  const float* const* p = kept.pointers.data();
  for (std::size_t i = 0; i < kept.sizes.size(); ++i, p += 6)
    bare_variable<N>(p[0], p[1], p[2], p[3], const_cast<float*>(p[4]), const_cast<float*>(p[5]));
}

struct small_model {
  std::size_t variables, n, towers;
  std::vector<gradavg_bench::aligned_buffer<float>> data;  // [tower * variables + i]
  std::vector<std::vector<float>> means, squares;
  towers_t tg;
  std::vector<std::span<float>> mean_spans, square_spans;
  std::vector<std::vector<const float*>> by_variable;  // [i][k]
  std::vector<float*> mean_ptrs, square_ptrs;

  small_model(std::size_t v, std::size_t n_, std::size_t t) : variables(v), n(n_), towers(t) {
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < variables; ++i) {
        data.emplace_back(n);
        for (std::size_t j = 0; j < n; ++j) data.back().data()[j] = static_cast<float>((k * 31 + i * 7 + j) % 97) / 97.0f;
      }
    tg.resize(towers);
    by_variable.resize(variables);
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < variables; ++i) {
        const float* p = data[k * variables + i].data();
        tg[k].push_back({std::span<const float>(p, n), static_cast<int>(i)});
        by_variable[i].push_back(p);
      }
    means.assign(variables, std::vector<float>(n));
    squares.assign(variables, std::vector<float>(n));
    for (std::size_t i = 0; i < variables; ++i) {
      mean_spans.emplace_back(means[i]);
      square_spans.emplace_back(squares[i]);
      mean_ptrs.push_back(means[i].data());
      square_ptrs.push_back(squares[i].data());
    }
  }
};

void BM_small(benchmark::State& state) {
  const auto V = static_cast<std::size_t>(state.range(0)), n = static_cast<std::size_t>(state.range(1));
  constexpr std::size_t T = 4;
  small_model s(V, n, T);
  struct contender {
    std::string name;
    std::function<void()> call;
    std::vector<double> us;
  };
  std::vector<contender> cs;
  compact_layout kept;
  for (std::size_t i = 0; i < V; ++i) {
    for (std::size_t k = 0; k < T; ++k) kept.pointers.push_back(s.tg[k][i].first.data());
    kept.pointers.push_back(s.mean_ptrs[i]);
    kept.pointers.push_back(s.square_ptrs[i]);
    kept.sizes.push_back(n);
  }
  const auto checked = [&]<std::size_t N>() {
    if (!matches_compact(kept, s.tg, s.mean_spans, s.square_spans)) throw std::logic_error("layout changed");
    bare_compact<N>(kept);
  };
  if (n == 64) {
    cs.push_back({"bare", [&] { bare_loop<64>(s.by_variable, s.mean_ptrs, s.square_ptrs); }, {}});
    cs.push_back({"bare_checked", [&] { checked.template operator()<64>(); }, {}});
  } else {
    cs.push_back({"bare", [&] { bare_loop<1024>(s.by_variable, s.mean_ptrs, s.square_ptrs); }, {}});
    cs.push_back({"bare_checked", [&] { checked.template operator()<1024>(); }, {}});
  }
#if __has_include(<gradavg/plan.hpp>)
  gradavg::plan plan;
  cs.push_back({"plan", [&] { gradavg::average_gradients_into(plan, s.tg, s.mean_spans, s.square_spans); }, {}});
  gradavg::plan fused_plan;
  const gradavg::options fused{.compute = {.on_nonfinite = gradavg::nonfinite_policy::report, .statistics = true}};
  cs.push_back({"plan_fused",
                [&] { gradavg::average_gradients_into(fused_plan, s.tg, s.mean_spans, s.square_spans, fused); }, {}});
#endif
  cs.push_back({"uncached", [&] { gradavg::average_gradients_into(s.tg, s.mean_spans, s.square_spans); }, {}});
  cs.push_back({"same_variable", [&] {
                  gradavg::average_gradients_into(s.tg, s.mean_spans, s.square_spans,
                                                  {.check = {.aliasing = gradavg::alias_check::same_variable}});
                }, {}});
  cs.push_back({"none", [&] {
                  gradavg::average_gradients_into(s.tg, s.mean_spans, s.square_spans,
                                                  {.check = {.aliasing = gradavg::alias_check::none}});
                }, {}});

  // Check every contender against the bare loop.
  cs[0].call();
  const auto want_m = s.means, want_q = s.squares;
  for (std::size_t c = 1; c < cs.size(); ++c) {
    for (auto& m : s.means) std::fill(m.begin(), m.end(), -1.0f);
    cs[c].call();
    for (std::size_t i = 0; i < V; ++i)
      if (std::memcmp(s.means[i].data(), want_m[i].data(), n * sizeof(float)) != 0) {
        state.SkipWithError((cs[c].name + ": means differ from the bare loop").c_str());
        return;
      }
    (void)want_q;  // squares may differ in the last bit where the kernel fuses multiply-adds
  }

  const std::size_t calls = 100;
  std::size_t round = 0;
  for (auto _ : state) {
    for (std::size_t r = 0; r < cs.size(); ++r) {
      contender& c = cs[(round + r) % cs.size()];
      const auto start = std::chrono::steady_clock::now();
      for (std::size_t call = 0; call < calls; ++call) c.call();
      const std::chrono::duration<double, std::micro> d = std::chrono::steady_clock::now() - start;
      c.us.push_back(d.count() / static_cast<double>(calls));
    }
    ++round;
  }
  for (const contender& c : cs) {
    state.counters["us." + c.name] = median(c.us);
    if (c.name == "bare") continue;
    std::vector<double> ratio;
    for (std::size_t r = 0; r < c.us.size(); ++r) ratio.push_back(c.us[r] / cs[0].us[r]);
    state.counters[c.name + ".vs.bare"] = median(ratio);
  }
}
BENCHMARK(BM_small)->Name("small")->ArgNames({"V", "n"})->Args({1000, 64})->Args({100, 64})->Args({100, 1024})
    ->Iterations(201)->Unit(benchmark::kMillisecond);

void BM_checks(benchmark::State& state) {
  const auto T = static_cast<std::size_t>(state.range(0));
  const gradavg_bench::model_shapes m = gradavg_bench::bert_base_shapes();
  // Allocated, never written or read: the checks only look at pointers and shapes.
  std::vector<std::unique_ptr<float[]>> storage;
  towers_t tg(T);
  std::vector<std::span<float>> means, squares;
  for (std::size_t k = 0; k < T + 2; ++k)
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      const std::size_t size = m.params[i].size();
      storage.emplace_back(new float[size]);
      if (k < T)
        tg[k].push_back({std::span<const float>(storage.back().get(), size), static_cast<int>(i)});
      else
        (k == T ? means : squares).emplace_back(storage.back().get(), size);
    }
  gradavg::shared_detail::layout_proof proof;
  const auto mode = static_cast<int>(state.range(1));
  gradavg::options opts;
  if (mode == 2) opts.check.aliasing = gradavg::alias_check::none;
  for (auto _ : state) {
    gradavg::detail::check_scratch scratch;
    benchmark::DoNotOptimize(
        gradavg::detail::validate_into(tg, means, &squares, opts, scratch, mode == 1 ? &proof : nullptr));
  }
  state.SetLabel(mode == 0 ? "all" : mode == 1 ? "all, proving again into a plan's proof" : "none");
}
BENCHMARK(BM_checks)->Name("checks/bert_base")->ArgNames({"T", "mode"})
    ->ArgsProduct({{8}, {0, 1, 2}})->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
