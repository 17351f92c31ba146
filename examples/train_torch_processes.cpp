// Data-parallel training in libtorch across processes: the convolutional network with batch
// normalisation of digits_model.hpp on scikit-learn's 1,797 handwritten digits, over MPI
// (train_torch_mpi) or a gloo c10d::ProcessGroup (train_torch_c10d): the same code, with
// processes.hpp's world() as the processes. Every rank (a process) holds --replicas replicas,
// each initialised on its own; broadcast_parameters and broadcast_buffers give every replica of
// every rank rank 0's start. Each replica computes the gradient of its slice of every batch on
// its own thread; the transport's data parallel (mpi_data_parallel, c10d_data_parallel) averages
// the gradients of every replica of every rank into each replica's .grad(), bucket by bucket
// while the backward passes still run (--one-shot: average_module_gradients(world(), ...) once
// they have returned; the same bits), bitwise the same on every rank, every replica's optimizer
// takes the same step, and broadcast_buffers gives every replica rank 0's BatchNorm running
// statistics.
//
//   mpiexec -n 2 train_torch_mpi --data digits.csv [--replicas 2] [--epochs 30] [--one-shot]
//       [--compression none|bf16|fp16|int8|all] [--quiet]
//   torchrun --nproc_per_node=2 --no_python train_torch_c10d --data digits.csv [...]
//   for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
//       train_torch_c10d --data digits.csv & done; wait     (one shell line)
//   GRADAVG_TIMELINE=trace.%r.json GRADAVG_LOG=info ...      (docs/timeline.md)
//
// --compression: the exchange's wire format (gradavg::compression, an option of the helpers'
// options; default none; int8 without error feedback); all: the training once per format from
// the same start, each one's held-out accuracy printed beside the fp32 exchange's.
//
// Checks, each failing the program (exit 1 on every rank): the first step's averaged gradient
// against the mean of the gradients of every slice of every rank computed one at a time by one
// model (max relative difference under 1e-5; with compression, the format's two roundings), every
// replica of every rank bitwise identical at the end (parameters and buffers), held-out accuracy
// (eval mode) of at least 90%, and with all, every format's within 0.5 points of the fp32
// exchange's (or better). Exit 77 when the data file is missing (ctest reports it skipped).
#include <torch/torch.h>

#include <gradavg/log.hpp>
#include <gradavg/timeline.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "digits_model.hpp"
#include "processes.hpp"
#include "support.hpp"

using namespace digits;  // the model, the data, the checks

namespace {

/// FNV-1a of a model's parameters and buffers.
std::uint64_t hash_of(Net& model) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](const torch::Tensor& t) {
    const auto* b = static_cast<const unsigned char*>(t.data_ptr());
    for (std::size_t i = 0; i < static_cast<std::size_t>(t.numel()) * t.element_size(); ++i)
      h = (h ^ b[i]) * 1099511628211ull;
  };
  for (const auto& p : model->parameters()) mix(p);
  for (const auto& b : model->buffers()) mix(b);
  return h;
}

using processes::on_every_rank;

/// One training from rank 0's start with one wire format: the held-out accuracy, or nothing
/// after a failed check (reported).
std::optional<double> train_with(const dataset& train_set, const dataset& test, int ranks, int rank, int replica_count,
                                 int epochs, bool quiet, bool one_shot, const wire_format& format) {
  const auto n_train = train_set.y.size(0);
  const auto k_count = static_cast<std::size_t>(replica_count);
  const std::int64_t per_replica = 16;  // samples per replica and step
  const std::int64_t per_rank = per_replica * replica_count;
  const std::int64_t batch = per_rank * ranks;  // every replica of every rank
  // Every replica of every rank starts from its own random initialisation; the broadcasts give
  // them all rank 0's replica 0. Then the same seed on every rank for the batches.
  torch::manual_seed(static_cast<std::uint64_t>(1000 + rank));
  std::vector<Net> replicas(k_count);
  gradavg::libtorch::broadcast_parameters(processes::world(), replicas, 0);
  gradavg::libtorch::broadcast_buffers(processes::world(), replicas, 0);
  torch::manual_seed(2);
  // Hooks on every replica's parameters; buckets of 2 KiB, as this model is small (about 10 KiB of
  // parameters). Collective: every rank constructs it.
  std::optional<processes::data_parallel> overlapped;
  processes::options opts;
  opts.exchange.compression = format.format;
  // GRADAVG_TIMELINE=trace.%r.json: each rank's events (the buckets' readiness, averages, copies
  // and exchanges); GRADAVG_LOG=info: what each plan chose (docs/timeline.md).
  const std::unique_ptr<gradavg::timeline> line = gradavg::timeline::from_environment();
  const std::unique_ptr<gradavg::logger> log = gradavg::logger::from_environment();
  opts.run.timeline = line.get();
  opts.run.log = log.get();
  if (!one_shot) overlapped.emplace(processes::world(), replicas, opts, gradavg::libtorch::module_options{},
                                    gradavg::libtorch::bucket_options{.bytes = 2048});
  std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;
  for (auto& r : replicas)
    optimizers.push_back(std::make_unique<torch::optim::SGD>(r->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));

  // The first step's, relative to the largest gradient element: a lossy format adds its roundings.
  const double gradient_tolerance = format.format == gradavg::compression::none ? 1e-5 : format.rounding_tolerance;
  bool checked_first_step = false;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    const auto shuffle = torch::randperm(n_train);
    double loss_sum = 0;
    int steps = 0;
    for (std::int64_t start = 0; start + batch <= n_train; start += batch, ++steps) {
      const auto rows = shuffle.slice(0, start, start + batch);
      const auto x = train_set.x.index({rows}), y = train_set.y.index({rows});
      std::vector<double> losses(k_count);
      {
        std::vector<std::jthread> threads;
        for (std::size_t k = 0; k < k_count; ++k)
          threads.emplace_back([&, k] {
            torch::set_num_threads(1);  // a new thread starts with OpenMP's default team size
            const auto begin = rank * per_rank + static_cast<std::int64_t>(k) * per_replica;
            auto& r = replicas[k];
            r->zero_grad();
            auto loss = torch::nn::functional::cross_entropy(r->forward(x.slice(0, begin, begin + per_replica)),
                                                             y.slice(0, begin, begin + per_replica));
            loss.backward();
            losses[k] = loss.item<double>();
          });
      }
      const auto report = one_shot ? gradavg::libtorch::average_module_gradients(processes::world(), replicas, opts)
                                   : overlapped->finish();
      if (!on_every_rank(report.report.averaged == 6)) {
        std::fprintf(stderr, "rank %d: FAILED: %zu parameters averaged, 6 expected\n", rank, report.report.averaged);
        return std::nullopt;
      }
      if (!checked_first_step) {
        const double difference =
            max_relative_difference(replicas[0], mean_slice_gradient(replicas[0], x, y, ranks * replica_count));
        if (rank == 0)
          std::printf("step 0: averaged gradient of %d ranks x %d replicas vs the slices' mean gradient: max "
                      "relative difference %.3g (tolerance %g)\n",
                      ranks, replica_count, difference, gradient_tolerance);
        if (rank == 0 && overlapped)
          std::printf("step 0: %zu of %zu buckets started while backward ran\n", overlapped->overlapped_buckets(),
                      overlapped->buckets().size());
        if (!on_every_rank(difference <= gradient_tolerance)) {
          std::fprintf(stderr, "rank %d: FAILED: the averaged gradient differs from the reference\n", rank);
          return std::nullopt;
        }
        checked_first_step = true;
      }
      for (auto& o : optimizers) o->step();
      gradavg::libtorch::broadcast_buffers(processes::world(), replicas, 0);  // rank 0's running statistics
      for (double l : losses) loss_sum += l / static_cast<double>(k_count);
    }
    const double mean_loss = processes::sum(loss_sum / steps) / ranks;
    if (!quiet && rank == 0 && (epoch % 10 == 9 || epoch == epochs - 1))
      std::printf("epoch %3d: training loss %.4f, held-out accuracy %.1f%%\n", epoch + 1, mean_loss,
                  100 * accuracy(replicas[0], test));
  }

  // Every replica of every rank took the same steps from the same start.
  const std::uint64_t h = hash_of(replicas[0]);
  bool same = true;
  for (std::size_t k = 1; k < k_count; ++k) same = same && hash_of(replicas[k]) == h;
  if (!on_every_rank(same && h == processes::from_rank_0(h))) {
    std::fprintf(stderr, "rank %d: FAILED: the replicas' parameters or buffers differ between replicas or ranks\n",
                 rank);
    return std::nullopt;
  }
  const double test_accuracy = accuracy(replicas[0], test);
  if (rank == 0)
    std::printf("%d ranks x %zu replicas, %d epochs, batch %lld: models identical on every rank, held-out accuracy "
                "%.1f%% on %lld digits\n",
                ranks, k_count, epochs, static_cast<long long>(batch), 100 * test_accuracy,
                static_cast<long long>(test.y.size(0)));
  if (test_accuracy < 0.9) {
    std::fprintf(stderr, "FAILED: held-out accuracy under 90%%\n");
    return std::nullopt;
  }
  return test_accuracy;
}

int run(int argc, char** argv, int rank, int ranks) {
  std::string data_path;
  int replica_count = 2, epochs = 30;
  bool quiet = false, one_shot = false;
  std::vector<wire_format> chosen = {wire_formats[0]};
  for (int a = 1; a < argc; ++a) {
    const std::string_view arg = argv[a];
    std::optional<int> value;
    if (arg == "--quiet" || arg == "--one-shot") {
      (arg == "--quiet" ? quiet : one_shot) = true;
      continue;
    }
    if (a + 1 >= argc) {
      if (rank == 0)
        std::fprintf(stderr,
                     "usage: %s --data digits.csv [--replicas K] [--epochs N] [--one-shot] "
                     "[--compression none|bf16|fp16|int8|all] [--quiet]\n",
                     argv[0]);
      return 2;
    }
    const std::string_view next = argv[++a];
    if (arg == "--data") {
      data_path = next;
    } else if (arg == "--replicas" && (value = parse_int(next, 1, 16))) {
      replica_count = *value;
    } else if (arg == "--epochs" && (value = parse_int(next, 1, 10000))) {
      epochs = *value;
    } else if (arg == "--compression" && next == "all") {
      chosen.assign(wire_formats.begin(), wire_formats.end());
    } else if (arg == "--compression" && wire_format_named(next)) {
      chosen = {*wire_format_named(next)};
    } else {
      if (rank == 0) std::fprintf(stderr, "bad argument %s %s\n", argv[a - 1], argv[a]);
      return 2;
    }
  }
  const auto all = load(data_path);
  if (!on_every_rank(all.has_value())) {
    if (rank == 0) std::fprintf(stderr, "cannot read the digits from '%s' (scripts/fetch-digits.sh gets them)\n", data_path.c_str());
    return 77;
  }
  // The replicas are the parallelism: one thread each. The same split on every rank.
  torch::set_num_threads(1);
  const auto [train, test] = split_held_out(*all);

  int status = 0;
  double fp32_accuracy = -1;
  for (const wire_format& format : chosen) {
    const std::optional<double> test_accuracy =
        train_with(train, test, ranks, rank, replica_count, epochs, quiet, one_shot, format);
    if (!test_accuracy) return 1;
    if (format.format == gradavg::compression::none) fp32_accuracy = *test_accuracy;
    if (chosen.size() > 1 && rank == 0) {
      const double points = 100 * (*test_accuracy - fp32_accuracy);
      std::printf("compression %-4s  held-out accuracy %5.1f%%  (%+.2f points against the fp32 exchange%s)\n",
                  format.name, 100 * *test_accuracy, points, points < -0.5 ? ": FAILED, more than 0.5 below" : "");
    }
    if (*test_accuracy - fp32_accuracy < -0.005 && fp32_accuracy >= 0) status = 1;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  return processes::run([&](int rank, int ranks) { return run(argc, argv, rank, ranks); });
}
