// Row-sparse gradients (gradavg/sparse.hpp) on a BERT-base word embedding: 30,522 x 768 floats,
// T towers each listing `rows` distinct rows drawn at random, measured by alternation in one run,
// one thread unless --threads= says otherwise.
//
// sparse/T:<T>/rows:<rows>   Each iteration is one round over every contender, each timed on its
//   own (the round's start rotating):
//     coalesced      average_gradients_into into a sparse_rows, with a sparse_workspace
//     dense_out      average_gradients_into into a dense [30522, 768] output
//     densify        densify-then-average: each tower's rows scattered into a dense tensor
//                    (zeroed first), then the dense average_gradients_into (with a plan)
//     dense          the dense call alone, over gradients already dense (what densify's last
//                    step costs)
//     copy           memcpy of as many bytes as coalesced moves (half read, half written)
//     gather         every listed values row copied to its row of a coalesced output, tower by
//                    tower: the data movement of a kernel over the listed rows, without the sums
//   Counters (medians over rounds): ms.<contender>; densify.over.coalesced and
//   densify.over.dense_out (the speed-up over densify-then-average: the target 5); and
//   coalesced.of.copy, dense_out.of.copy: the bytes each moves (every listed values row read once,
//   every output row written once) per second against the copy's (the target 0.7), and
//   coalesced.of.gather: against gather's bytes per second (each values row read and written).
//   Before the rounds, the coalesced rows are checked against dense_out and densify's outputs.
#include <benchmark/benchmark.h>

#include <gradavg/gradavg.hpp>
#include <gradavg/sparse.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr std::int64_t vocabulary = 30522;
constexpr std::size_t width = 768;
std::size_t threads = 1;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

template <class F>
double seconds_of(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

using rows_view = gradavg::row_sparse<std::int64_t, float>;

void sparse(benchmark::State& state) {
  const auto towers = static_cast<std::size_t>(state.range(0));
  const auto listed = static_cast<std::size_t>(state.range(1));
  const std::size_t dense_elements = static_cast<std::size_t>(vocabulary) * width;
  const gradavg::shape dense_shape = gradavg::shape::matrix(vocabulary, static_cast<std::int64_t>(width));

  std::mt19937 gen(11);
  std::uniform_real_distribution<float> value(-1, 1);
  std::vector<std::vector<std::int64_t>> indices(towers);
  std::vector<std::vector<float>> values(towers);
  std::vector<std::int64_t> all(static_cast<std::size_t>(vocabulary));
  std::iota(all.begin(), all.end(), std::int64_t{0});
  for (std::size_t k = 0; k < towers; ++k) {
    std::shuffle(all.begin(), all.end(), gen);
    indices[k].assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(listed));
    values[k].resize(listed * width);
    for (float& x : values[k]) x = value(gen);
  }
  std::vector<std::vector<std::pair<rows_view, int>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    tg[k].emplace_back(gradavg::rows_of<std::int64_t, float>(indices[k], values[k].data(), dense_shape), 0);

  gradavg::options opts;
  opts.run.threads = threads;

  // coalesced
  gradavg::sparse_workspace work;
  gradavg::sparse_rows<std::int64_t, float> coalesced_out;
  std::vector<gradavg::sparse_rows<std::int64_t, float>*> coalesced_means{&coalesced_out};
  auto coalesced = [&] { gradavg::average_gradients_into(work, tg, coalesced_means, opts); };
  // dense_out
  std::vector<float> dense_out(dense_elements);
  std::vector<std::vector<float>*> dense_means{&dense_out};
  auto dense_out_call = [&] { gradavg::average_gradients_into(work, tg, dense_means, opts); };
  // densify (and dense, over its densified towers)
  std::vector<std::vector<float>> densified(towers, std::vector<float>(dense_elements));
  std::vector<std::vector<std::pair<std::vector<float>*, int>>> dense_tg(towers);
  for (std::size_t k = 0; k < towers; ++k) dense_tg[k].emplace_back(&densified[k], 0);
  std::vector<float> densify_out(dense_elements);
  std::vector<std::vector<float>*> densify_means{&densify_out};
  gradavg::plan plan;
  auto dense = [&] { gradavg::average_gradients_into(plan, dense_tg, densify_means, opts); };
  auto densify = [&] {
    for (std::size_t k = 0; k < towers; ++k) {
      std::memset(densified[k].data(), 0, dense_elements * sizeof(float));
      for (std::size_t n = 0; n < listed; ++n)
        std::memcpy(densified[k].data() + static_cast<std::size_t>(indices[k][n]) * width,
                    values[k].data() + n * width, width * sizeof(float));
    }
    dense();
  };

  coalesced();
  dense_out_call();
  densify();
  // The checks: the three agree, bit for bit.
  if (dense_out != densify_out) {
    state.SkipWithError("dense_out differs from densify-then-average");
    return;
  }
  for (std::size_t n = 0; n < coalesced_out.indices.size(); ++n)
    if (std::memcmp(coalesced_out.values.data() + n * width,
                    dense_out.data() + static_cast<std::size_t>(coalesced_out.indices[n]) * width,
                    width * sizeof(float)) != 0) {
      state.SkipWithError("coalesced differs from dense_out");
      return;
    }

  const double read = static_cast<double>(towers * listed * width * sizeof(float));
  const double coalesced_bytes = read + static_cast<double>(coalesced_out.values.size() * sizeof(float));
  const double dense_bytes = read + static_cast<double>(dense_elements * sizeof(float));
  const std::size_t copy_floats = static_cast<std::size_t>(coalesced_bytes / 2 / sizeof(float));
  std::vector<float> copy_from(copy_floats, 1.0f), copy_to(copy_floats);
  auto copy = [&] {
    std::memcpy(copy_to.data(), copy_from.data(), copy_floats * sizeof(float));
    benchmark::DoNotOptimize(copy_to.data());
  };

  // gather: every listed values row copied to its row of a coalesced output, tower by tower (the
  // least a kernel over the listed rows moves: each read once, each output row written).
  std::vector<std::size_t> place(static_cast<std::size_t>(vocabulary), 0);
  for (std::size_t n = 0; n < coalesced_out.indices.size(); ++n)
    place[static_cast<std::size_t>(coalesced_out.indices[n])] = n;
  std::vector<float> gathered(coalesced_out.values.size());
  auto gather = [&] {
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t n = 0; n < listed; ++n)
        std::memcpy(gathered.data() + place[static_cast<std::size_t>(indices[k][n])] * width,
                    values[k].data() + n * width, width * sizeof(float));
    benchmark::DoNotOptimize(gathered.data());
  };

  const std::vector<std::pair<const char*, std::function<void()>>> contenders{
      {"coalesced", coalesced}, {"dense_out", dense_out_call}, {"densify", densify},
      {"dense", dense},         {"copy", copy},                {"gather", gather}};
  std::vector<std::vector<double>> times(contenders.size());
  std::size_t round = 0;
  for (auto _ : state) {
    for (std::size_t c = 0; c < contenders.size(); ++c) {
      const std::size_t pick = (c + round) % contenders.size();
      times[pick].push_back(seconds_of(contenders[pick].second));
      benchmark::ClobberMemory();
    }
    ++round;
  }
  auto ratio = [&](std::size_t a, std::size_t b) {  // median of t(a) / t(b)
    std::vector<double> r;
    for (std::size_t i = 0; i < times[a].size(); ++i) r.push_back(times[a][i] / times[b][i]);
    return median(r);
  };
  for (std::size_t c = 0; c < contenders.size(); ++c)
    state.counters[std::string("ms.") + contenders[c].first] = median(times[c]) * 1e3;
  state.counters["densify.over.coalesced"] = ratio(2, 0);
  state.counters["densify.over.dense_out"] = ratio(2, 1);
  const double copy_moved = 2.0 * static_cast<double>(copy_floats * sizeof(float));
  state.counters["coalesced.of.copy"] = (coalesced_bytes / copy_moved) * ratio(4, 0);
  state.counters["dense_out.of.copy"] = (dense_bytes / copy_moved) * ratio(4, 1);
  state.counters["coalesced.of.gather"] = (coalesced_bytes / (2 * read)) * ratio(5, 0);
  state.counters["unique_rows"] = static_cast<double>(coalesced_out.indices.size());
}

}  // namespace

int main(int argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--threads=", 0) == 0)
      threads = static_cast<std::size_t>(std::stoul(arg.substr(10)));
    else
      argv[out++] = argv[i];
  }
  argc = out;
  benchmark::Initialize(&argc, argv);
  benchmark::RegisterBenchmark("sparse", sparse)
      ->ArgNames({"T", "rows"})
      ->Args({8, 4096})
      ->Args({2, 4096})
      ->Args({8, 512})
      ->Iterations(15)
      ->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
