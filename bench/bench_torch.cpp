// libtorch: averaging K = 4 and 8 replicas' gradients of ResNet-50's parameter list (161 float
// tensors, 25,557,032 values each, model_shapes.hpp) held in torch::Tensors, into replica 0's
// gradients, three ways in the same run:
//   gradavg      gradavg::average_gradients_into, in place into tower 0's tensors
//   stack_mean   torch::stack(grads).mean(0) per parameter (a new tensor each; what the forums write)
//   add_div      g0.add_(g1) ... add_(g_{K-1}); g0.div_(K) per parameter (in place)
// Threads: 1 (gradavg threads = 1, torch::set_num_threads(1)) and all cores (threads = 0, torch's
// default). Bytes credited: (K + 1) x total x 4 (every gradient read once, one output written),
// the least any of them must move. Before timing, each way's result on fresh data is compared
// with torch's double-precision mean (relative 1e-6; exit 1 otherwise).
// module_call: the cost of average_module_gradients over the averaging alone (K = 4 replicas of one
// 64 MiB parameter, threads = 2), with the means copied into every replica or left in replica 0's.
#include <gradavg/torch.hpp>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "model_shapes.hpp"

namespace {

using towers_t = std::vector<std::vector<std::pair<at::Tensor, std::string>>>;

towers_t make_towers(std::size_t k_count) {
  const auto model = gradavg_bench::resnet50_shapes();
  torch::manual_seed(7);
  towers_t tg(k_count);
  for (std::size_t k = 0; k < k_count; ++k)
    for (const auto& p : model.params) tg[k].emplace_back(torch::rand(p.dims) * 2 - 1, p.name);
  return tg;
}

std::size_t total_elements(const towers_t& tg) {
  std::size_t n = 0;
  for (const auto& e : tg[0]) n += static_cast<std::size_t>(e.first.numel());
  return n;
}

void way_gradavg(towers_t& tg, std::vector<at::Tensor>& means, std::size_t threads) {
  gradavg::average_gradients_into(tg, means, {.run = {.threads = threads}});
}

void way_stack_mean(towers_t& tg, std::vector<at::Tensor>& means, std::size_t) {
  std::vector<at::Tensor> g(tg.size());
  for (std::size_t i = 0; i < means.size(); ++i) {
    for (std::size_t k = 0; k < tg.size(); ++k) g[k] = tg[k][i].first;
    means[i] = torch::stack(g).mean(0);
  }
}

void way_add_div(towers_t& tg, std::vector<at::Tensor>& means, std::size_t) {
  for (std::size_t i = 0; i < means.size(); ++i) {
    for (std::size_t k = 1; k < tg.size(); ++k) means[i].add_(tg[k][i].first);
    means[i].div_(static_cast<double>(tg.size()));
  }
}

using way = void (*)(towers_t&, std::vector<at::Tensor>&, std::size_t);

/// Outputs: tower 0's own tensors (in place).
std::vector<at::Tensor> in_place_outputs(const towers_t& tg) {
  std::vector<at::Tensor> means;
  for (const auto& e : tg[0]) means.push_back(e.first);
  return means;
}

/// Runs w once on fresh towers and compares with torch's double mean.
bool check(way w, const char* name, std::size_t k_count) {
  towers_t tg = make_towers(k_count);
  std::vector<at::Tensor> want;
  for (std::size_t i = 0; i < tg[0].size(); i += 16) {  // every 16th parameter
    std::vector<at::Tensor> g;
    for (const auto& tower : tg) g.push_back(tower[i].first.to(at::kDouble));
    want.push_back(torch::stack(g).mean(0));
  }
  auto means = in_place_outputs(tg);
  w(tg, means, 0);
  for (std::size_t i = 0, j = 0; i < tg[0].size(); i += 16, ++j) {
    const double err = (means[i].to(at::kDouble) - want[j]).abs().max().item<double>();
    if (!(err <= 1e-6 * want[j].abs().max().item<double>())) {
      std::fprintf(stderr, "%s, K = %zu: parameter %zu differs from the double mean by %g\n", name, k_count, i, err);
      return false;
    }
  }
  return true;
}

void run(benchmark::State& state, way w) {
  const auto k_count = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  static towers_t tg;
  if (tg.size() != k_count) tg = make_towers(k_count);
  const int torch_threads = torch::get_num_threads();
  torch::set_num_threads(threads == 1 ? 1 : static_cast<int>(std::thread::hardware_concurrency()));
  auto means = in_place_outputs(tg);
  for (auto _ : state) {
    w(tg, means, threads);
    benchmark::ClobberMemory();
  }
  torch::set_num_threads(torch_threads);
  const auto total = total_elements(tg);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * (k_count + 1) * total * sizeof(float)));
  state.counters["towers"] = static_cast<double>(k_count);
  state.counters["threads"] = threads == 1 ? 1.0 : static_cast<double>(std::thread::hardware_concurrency());
}

// Args: {K, threads (1, or 0 for all cores)}; K = 4 first, then K = 8 (towers rebuilt once each).
void args(benchmark::internal::Benchmark* b) {
  for (int k : {4, 8})
    for (int threads : {1, 0}) b->Args({k, threads});
  b->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
}

/// One parameter of 4096 x 4096 floats (16 Mi values, 64 MiB).
struct WideImpl : torch::nn::Cloneable<WideImpl> {
  WideImpl() { reset(); }
  void reset() override { w = register_parameter("w", torch::zeros({4096, 4096})); }
  at::Tensor w;
};
TORCH_MODULE(Wide);

enum class module_way : std::int64_t { averaging_alone, every_replica, first_replica, every_replica_regular };

/// K = 4 replicas of Wide with random gradients, threads = 2: the averaging alone
/// (average_gradients_into in place into replica 0's gradient), and average_module_gradients with
/// the means copied into every replica (mean_target::every_replica) or left in replica 0's
/// (mean_target::first_replica), with the default options.stores (automatic: these calls move
/// enough bytes to store non-temporally); every_replica_regular: every_replica with
/// store_policy::regular. Bytes credited: the least each must move, (K + 1) x 64 MiB, plus K x 64 MiB (the mean read once,
/// written into K - 1 replicas) when every replica receives the means.
void module_call(benchmark::State& state) {
  const auto w = static_cast<module_way>(state.range(0));
  constexpr std::size_t k_count = 4;
  static std::vector<Wide> replicas;
  if (replicas.empty()) {
    torch::manual_seed(11);
    for (std::size_t k = 0; k < k_count; ++k) {
      replicas.emplace_back();
      replicas.back()->w.mutable_grad() = torch::rand({4096, 4096}) * 2 - 1;
    }
  }
  const gradavg::options opts{.run = {.threads = 2, .stores = w == module_way::every_replica_regular ? gradavg::store_policy::regular
                                                                               : gradavg::store_policy::automatic}};
  std::vector<std::vector<std::pair<at::Tensor, std::string>>> tg(k_count);
  for (std::size_t k = 0; k < k_count; ++k) tg[k].emplace_back(replicas[k]->w.grad(), "w");
  std::vector<at::Tensor> means{replicas[0]->w.grad()};
  const gradavg::libtorch::module_options mopts{.means_to = w == module_way::first_replica
                                                                ? gradavg::libtorch::mean_target::first_replica
                                                                : gradavg::libtorch::mean_target::every_replica};
  for (auto _ : state) {
    if (w == module_way::averaging_alone)
      gradavg::average_gradients_into(tg, means, opts);
    else
      gradavg::libtorch::average_module_gradients(replicas, opts, mopts);
    benchmark::ClobberMemory();
  }
  const std::size_t bytes = std::size_t{4096} * 4096 * sizeof(float);
  const bool copies = w == module_way::every_replica || w == module_way::every_replica_regular;
  const std::size_t moved = (k_count + 1 + (copies ? k_count : 0)) * bytes;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * moved));
}

}  // namespace

BENCHMARK(module_call)
    ->ArgName("way")
    ->Arg(static_cast<std::int64_t>(module_way::averaging_alone))
    ->Arg(static_cast<std::int64_t>(module_way::every_replica))
    ->Arg(static_cast<std::int64_t>(module_way::first_replica))
    ->Arg(static_cast<std::int64_t>(module_way::every_replica_regular))
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);

// Each way over every (K, threads) point; the towers are made again when K changes.
BENCHMARK_CAPTURE(run, gradavg, way_gradavg)->Apply(args);
BENCHMARK_CAPTURE(run, stack_mean, way_stack_mean)->Apply(args);
BENCHMARK_CAPTURE(run, add_div, way_add_div)->Apply(args);

int main(int argc, char** argv) {
  for (std::size_t k : {4u, 8u})
    if (!check(way_gradavg, "gradavg", k) || !check(way_stack_mean, "stack_mean", k) ||
        !check(way_add_div, "add_div", k))
      return 1;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
