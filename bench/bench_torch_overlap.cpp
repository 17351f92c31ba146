// libtorch, averaging while backward runs: one training step's time (zero_grad, then forward and
// backward of K replicas of an MLP, each on a thread of its own with one intra-op thread, then
// the averaging) three ways, by alternation in rounds (run below):
//   backward      no averaging: the time the step cannot go below
//   one_shot      backward, then average_module_gradients (everything averaged after the last
//                 backward returns)
//   overlapped    data_parallel: buckets averaged by its worker thread while backward runs, then
//                 finish()
// The MLP (256 -> 1024 -> 1024 -> 1024 -> 10, 2.4 M floats) with a few rows per replica: its
// forward and backward move about as many bytes as the averaging of its gradients. Before timing, the overlapped step's gradients are compared with the
// one-shot step's, bit for bit (exit 1 otherwise).
#include <gradavg/torch_data_parallel.hpp>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace {

struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() { reset(); }
  void reset() override {
    l1 = register_module("l1", torch::nn::Linear(256, 1024));
    l2 = register_module("l2", torch::nn::Linear(1024, 1024));
    l3 = register_module("l3", torch::nn::Linear(1024, 1024));
    l4 = register_module("l4", torch::nn::Linear(1024, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return l4(torch::relu(l3(torch::relu(l2(torch::relu(l1(x)))))));
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, l4{nullptr};
};
TORCH_MODULE(Mlp);

/// K replicas of one MLP and each replica's batch.
struct replicas {
  std::vector<Mlp> models;
  std::vector<at::Tensor> x, y;

  replicas(std::size_t k_count, std::int64_t rows) {
    torch::manual_seed(3);
    Mlp model;
    for (std::size_t k = 0; k < k_count; ++k) {
      models.push_back(std::dynamic_pointer_cast<MlpImpl>(model->clone()));
      x.push_back(torch::randn({rows, 256}));
      y.push_back(torch::randint(0, 10, {rows}));
    }
  }

  /// zero_grad(set to none), then forward and backward of every replica, each on its own thread.
  void backward() {
    for (auto& m : models) m->zero_grad(true);
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < models.size(); ++k)
      threads.emplace_back([this, k] {
        torch::nn::functional::cross_entropy(models[k]->forward(x[k]), y[k]).backward();
      });
    for (auto& t : threads) t.join();
  }
};

enum class way { backward, one_shot, overlapped };

void step(replicas& r, way w, gradavg::libtorch::data_parallel* dp, const gradavg::options& opts = {}) {
  r.backward();
  if (w == way::one_shot) gradavg::libtorch::average_module_gradients(r.models, opts);
  if (w == way::overlapped) dp->finish();
}

bool same_gradients(replicas& a, replicas& b) {
  for (std::size_t k = 0; k < a.models.size(); ++k) {
    const auto pa = a.models[k]->parameters(), pb = b.models[k]->parameters();
    for (std::size_t i = 0; i < pa.size(); ++i)
      if (std::memcmp(pa[i].grad().data_ptr(), pb[i].grad().data_ptr(), pa[i].grad().nbytes()) != 0) return false;
  }
  return true;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// One benchmark iteration is a round: every way runs `steps_per_round` steps on replicas of its
/// own, timed alone, the way that starts rotating from round to round. Reported: each way's
/// median step time, and the medians over rounds of overlapped / backward and one_shot / backward.
void run(benchmark::State& state) {
  const auto k_count = static_cast<std::size_t>(state.range(0));
  const std::int64_t rows = state.range(1);
  const auto bucket_kib = static_cast<std::size_t>(state.range(2));
  const auto threads = static_cast<std::size_t>(state.range(3));
  constexpr int steps_per_round = 4;
  torch::set_num_threads(1);
  gradavg::thread_pool pool(threads);
  const gradavg::options opts{.threads = threads, .pool = threads > 1 ? &pool : nullptr};
  std::vector<std::unique_ptr<replicas>> sets;
  for (int w = 0; w < 3; ++w) sets.push_back(std::make_unique<replicas>(k_count, rows));
  gradavg::libtorch::data_parallel dp(sets[2]->models, opts, gradavg::libtorch::module_options{},
                                      gradavg::libtorch::bucket_options{.bytes = bucket_kib << 10});
  const way ways[3] = {way::backward, way::one_shot, way::overlapped};
  for (int w = 0; w < 3; ++w) step(*sets[w], ways[w], &dp, opts);  // warm-up: first touch of every gradient
  std::vector<double> seconds[3];
  std::size_t round = 0;
  for (auto _ : state) {
    for (std::size_t j = 0; j < 3; ++j) {
      const std::size_t w = (round + j) % 3;
      const auto start = std::chrono::steady_clock::now();
      for (int n = 0; n < steps_per_round; ++n) step(*sets[w], ways[w], &dp, opts);
      seconds[w].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                           steps_per_round);
    }
    ++round;
  }
  std::vector<double> one_shot_x, overlapped_x;
  for (std::size_t r = 0; r < seconds[0].size(); ++r) {
    one_shot_x.push_back(seconds[1][r] / seconds[0][r]);
    overlapped_x.push_back(seconds[2][r] / seconds[0][r]);
  }
  std::size_t floats = 0;
  for (const auto& p : sets[0]->models[0]->parameters()) floats += static_cast<std::size_t>(p.numel());
  state.counters["MiB_per_replica"] = static_cast<double>(floats * sizeof(float)) / (1 << 20);
  state.counters["buckets"] = static_cast<double>(dp.buckets().size());
  state.counters["backward_ms"] = median(seconds[0]) * 1e3;
  state.counters["one_shot_ms"] = median(seconds[1]) * 1e3;
  state.counters["overlapped_ms"] = median(seconds[2]) * 1e3;
  state.counters["one_shot_x"] = median(one_shot_x);
  state.counters["overlapped_x"] = median(overlapped_x);
}

}  // namespace

// Args: {K, rows per replica, bucket KiB, averaging threads (a thread_pool of that many: one_shot's
// and every bucket's options.threads and options.pool)}.
BENCHMARK(run)
    ->ArgsProduct({{2, 4, 8}, {1, 4}, {256, 1024, 4096}, {1, 4}})
    ->Iterations(9)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  {
    replicas a(3, 16), b(3, 16);
    gradavg::libtorch::data_parallel dp(a.models, {}, {}, {.bytes = 1 << 20});
    step(a, way::overlapped, &dp);
    step(b, way::one_shot, nullptr);
    if (!same_gradients(a, b)) {
      std::fprintf(stderr, "overlapped: the gradients differ from the one-shot call's\n");
      return 1;
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
