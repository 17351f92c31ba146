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
// Built as gradavg_bench_torch_mpi_overlap (GRADAVG_BENCH_MPI, under mpiexec; not by CI): every
// rank holds K replicas, `one_shot` is average_module_gradients(MPI_COMM_WORLD, ...) and
// `overlapped` mpi_data_parallel; every way starts each round's block at a barrier and a round's
// time is the slowest rank's; rank 0 reports. scripts/netlink.sh runs it on an emulated link.
#ifdef GRADAVG_BENCH_MPI
#include <gradavg/torch_mpi.hpp>
#include <mpi.h>
#else
#include <gradavg/torch_data_parallel.hpp>
#endif

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

#ifdef GRADAVG_BENCH_MPI
using averager = gradavg::libtorch::mpi_data_parallel;
std::uint64_t rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return static_cast<std::uint64_t>(r);
}
/// The slowest rank's value.
double slowest(double seconds) {
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return seconds;
}
void align() { MPI_Barrier(MPI_COMM_WORLD); }
#else
using averager = gradavg::libtorch::data_parallel;
std::uint64_t rank() { return 0; }
double slowest(double seconds) { return seconds; }
void align() {}
#endif

/// K replicas of one MLP and each replica's batch.
struct replicas {
  std::vector<Mlp> models;
  std::vector<at::Tensor> x, y;

  replicas(std::size_t k_count, std::int64_t rows) {
    torch::manual_seed(3);
    Mlp model;
    torch::manual_seed(4 + rank());
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

void step(replicas& r, way w, averager* dp, const gradavg::options& opts = {}) {
  r.backward();
#ifdef GRADAVG_BENCH_MPI
  const gradavg::mpi::options mpi_opts{opts.compute, opts.run, opts.check};
  if (w == way::one_shot) gradavg::libtorch::average_module_gradients(MPI_COMM_WORLD, r.models, mpi_opts);
#else
  if (w == way::one_shot) gradavg::libtorch::average_module_gradients(r.models, opts);
#endif
  if (w == way::overlapped) dp->finish();
}

averager make_averager(replicas& r, const gradavg::options& opts, std::size_t bucket_bytes) {
#ifdef GRADAVG_BENCH_MPI
  const gradavg::mpi::options mpi_opts{opts.compute, opts.run, opts.check};
  return averager(MPI_COMM_WORLD, r.models, mpi_opts, gradavg::libtorch::module_options{},
                  gradavg::libtorch::bucket_options{.bytes = bucket_bytes});
#else
  return averager(r.models, opts, gradavg::libtorch::module_options{},
                  gradavg::libtorch::bucket_options{.bytes = bucket_bytes});
#endif
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
  const gradavg::options opts{.run = {.threads = threads, .pool = threads > 1 ? &pool : nullptr}};
  std::vector<std::unique_ptr<replicas>> sets;
  for (int w = 0; w < 3; ++w) sets.push_back(std::make_unique<replicas>(k_count, rows));
  averager dp = make_averager(*sets[2], opts, bucket_kib << 10);
  const way ways[3] = {way::backward, way::one_shot, way::overlapped};
  for (int w = 0; w < 3; ++w) step(*sets[w], ways[w], &dp, opts);  // warm-up: first touch of every gradient
  std::vector<double> seconds[3];
  std::size_t round = 0;
  for (auto _ : state) {
    for (std::size_t j = 0; j < 3; ++j) {
      const std::size_t w = (round + j) % 3;
      align();
      const auto start = std::chrono::steady_clock::now();
      for (int n = 0; n < steps_per_round; ++n) step(*sets[w], ways[w], &dp, opts);
      seconds[w].push_back(
          slowest(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps_per_round));
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

// Args: {K, rows per replica, bucket KiB, averaging threads (a thread_pool of that many: one_shot's
// and every bucket's options.run.threads and options.run.pool)}. Across processes: K replicas per rank,
// more rows (the link, not the cores, is then what the backward passes overlap).
#ifdef GRADAVG_BENCH_MPI
BENCHMARK(run)->ArgsProduct({{1, 2}, {4, 16, 64}, {1024, 4096}, {1}})
#else
BENCHMARK(run)->ArgsProduct({{2, 4, 8}, {1, 4}, {256, 1024, 4096}, {1, 4}})
#endif
    ->Iterations(9)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

/// Reports nothing: the ranks other than 0.
class silent_reporter final : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

int run_all(int argc, char** argv) {
  torch::set_num_threads(1);
  {
    replicas a(3, 16), b(3, 16);
    averager dp = make_averager(a, {}, std::size_t{1} << 20);
    step(a, way::overlapped, &dp);
    step(b, way::one_shot, nullptr);
    if (!same_gradients(a, b)) {
      std::fprintf(stderr, "overlapped: the gradients differ from the one-shot call's\n");
      return 1;
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (rank() == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    silent_reporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
#ifdef GRADAVG_BENCH_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  const int code = run_all(argc, argv);
  MPI_Finalize();
  return code;
#else
  return run_all(argc, argv);
#endif
}
