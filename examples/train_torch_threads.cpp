// Data-parallel training in libtorch with threads as replicas: a small convolutional network with
// batch normalisation (digits_model.hpp; its convolution in channels_last memory order) on the
// 1,797 8x8 handwritten digits of scikit-learn's digits.csv (64 pixel values 0..16, then the
// label). K replicas, each initialised on its own, start in sync through
// gradavg::libtorch::broadcast_parameters and broadcast_buffers; each computes the gradient of its
// slice of every batch on its own thread; gradavg::libtorch::data_parallel averages them into every
// replica's .grad(), bucket by bucket while the backward passes still run (--one-shot: with
// average_module_gradients once they have all returned; the same bits), and each replica's
// optimizer takes the same step (--one-optimizer: the means go to replica 0 only, one optimizer
// steps it, and broadcast_parameters copies its parameters into the others; the same bits again);
// broadcast_buffers then gives every replica replica 0's BatchNorm running statistics, as
// DistributedDataParallel does.
//
// Checks, each failing the program (exit 1): the first step's averaged gradient against the mean
// of the slices' gradients computed one slice at a time by one model (max relative difference
// under 1e-5), the convolution's gradient channels_last, every replica's parameters and buffers
// identical at the end, and held-out accuracy (eval mode) of at least 90%.
//
//   train_torch_threads --data digits.csv [--replicas 4] [--epochs 40] [--one-shot] [--one-optimizer]
//                       [--quiet]
// scripts/fetch-digits.sh gets digits.csv (from Debian's python3-sklearn package). Exit 77 when
// the data file is missing (ctest reports the example skipped).
#include <gradavg/torch_data_parallel.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "digits_model.hpp"
#include "support.hpp"

using namespace digits;  // the model, the data, the checks

int main(int argc, char** argv) {
  std::string data_path;
  int replica_count = 4, epochs = 40;
  bool quiet = false, one_shot = false, one_optimizer = false;
  for (int a = 1; a < argc; ++a) {
    const std::string_view arg = argv[a];
    std::optional<int> value;
    if (arg == "--quiet" || arg == "--one-shot" || arg == "--one-optimizer") {
      (arg == "--quiet" ? quiet : arg == "--one-shot" ? one_shot : one_optimizer) = true;
      continue;
    }
    if (a + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: %s --data digits.csv [--replicas K] [--epochs N] [--one-shot] [--one-optimizer] "
                   "[--quiet]\n",
                   argv[0]);
      return 2;
    }
    const std::string_view next = argv[++a];
    if (arg == "--data") {
      data_path = next;
      continue;
    }
    if (arg == "--replicas" && (value = parse_int(next, 1, 64))) {
      replica_count = *value;
    } else if (arg == "--epochs" && (value = parse_int(next, 1, 10000))) {
      epochs = *value;
    } else {
      std::fprintf(stderr, "bad argument %s %s\n", argv[a - 1], argv[a]);
      return 2;
    }
  }
  const auto all = load(data_path);
  if (!all) {
    std::fprintf(stderr, "cannot read the digits from '%s' (scripts/fetch-digits.sh gets them)\n", data_path.c_str());
    return 77;
  }
  // Each replica runs its forward and backward passes on one thread: the replicas are the parallelism.
  torch::set_num_threads(1);
  const auto [train, test] = split_held_out(*all);
  const auto n_train = train.y.size(0);

  const auto k_count = static_cast<std::size_t>(replica_count);
  const std::int64_t per_replica = 16;  // samples per replica and step
  const auto batch = per_replica * static_cast<std::int64_t>(k_count);
  // Each replica starts from its own random initialisation; the broadcasts put every replica in
  // replica 0's state.
  std::vector<Net> replicas(k_count);
  gradavg::libtorch::broadcast_parameters(replicas);
  gradavg::libtorch::broadcast_buffers(replicas);
  // Hooks on every replica's parameters; buckets of 2 KiB, as this model is small (about 10 KiB of
  // parameters): bench/bench_torch_overlap.cpp measures the size for a larger one.
  // With one optimizer, the means go to replica 0 only.
  const gradavg::libtorch::module_options mopts{
      .means_to = one_optimizer ? gradavg::libtorch::mean_target::first_replica
                                : gradavg::libtorch::mean_target::every_replica};
  std::optional<gradavg::libtorch::data_parallel> overlapped;
  if (!one_shot)
    overlapped.emplace(replicas, gradavg::options{}, mopts, gradavg::libtorch::bucket_options{.bytes = 2048});
  std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;
  for (std::size_t k = 0; k < (one_optimizer ? 1 : k_count); ++k)
    optimizers.push_back(
        std::make_unique<torch::optim::SGD>(replicas[k]->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));

  constexpr double gradient_tolerance = 1e-5;
  bool checked_first_step = false;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    const auto shuffle = torch::randperm(n_train);
    double loss_sum = 0;
    int steps = 0;
    for (std::int64_t start = 0; start + batch <= n_train; start += batch, ++steps) {
      const auto rows = shuffle.slice(0, start, start + batch);
      const auto x = train.x.index({rows}), y = train.y.index({rows});
      std::vector<double> losses(k_count);
      {
        std::vector<std::jthread> threads;
        for (std::size_t k = 0; k < k_count; ++k)
          threads.emplace_back([&, k] {
            torch::set_num_threads(1);  // a new thread starts with OpenMP's default team size
            const auto begin = static_cast<std::int64_t>(k) * per_replica;
            auto& r = replicas[k];
            r->zero_grad();
            auto loss = torch::nn::functional::cross_entropy(r->forward(x.slice(0, begin, begin + per_replica)),
                                                             y.slice(0, begin, begin + per_replica));
            loss.backward();
            losses[k] = loss.item<double>();
          });
      }
      const auto report =
          one_shot ? gradavg::libtorch::average_module_gradients(replicas, {}, mopts) : overlapped->finish();
      if (report.report.averaged != 6) {
        std::fprintf(stderr, "FAILED: %zu parameters averaged, 6 expected\n", report.report.averaged);
        return 1;
      }
      if (!checked_first_step) {
        const double difference =
            max_relative_difference(replicas[0], mean_slice_gradient(replicas[0], x, y, replica_count));
        const bool channels_last = replicas[0]->conv->weight.grad().is_contiguous(at::MemoryFormat::ChannelsLast);
        std::printf("step 0: averaged gradient vs the slices' mean gradient: max relative difference %.3g "
                    "(tolerance %g); convolution gradient %s\n",
                    difference, gradient_tolerance, channels_last ? "channels_last" : "NOT channels_last");
        if (overlapped)
          std::printf("step 0: %zu of %zu buckets averaged while backward ran\n", overlapped->overlapped_buckets(),
                      overlapped->buckets().size());
        if (!(difference <= gradient_tolerance) || !channels_last) {
          std::fprintf(stderr, "FAILED: the averaged gradient differs from the reference, or is not channels_last\n");
          return 1;
        }
        checked_first_step = true;
      }
      for (auto& o : optimizers) o->step();
      if (one_optimizer) gradavg::libtorch::broadcast_parameters(replicas);  // replica 0's step everywhere
      gradavg::libtorch::broadcast_buffers(replicas);  // replica 0's running statistics everywhere
      for (double l : losses) loss_sum += l / static_cast<double>(k_count);
    }
    if (!quiet && (epoch % 10 == 9 || epoch == epochs - 1))
      std::printf("epoch %3d: training loss %.4f, held-out accuracy %.1f%%\n", epoch + 1, loss_sum / steps,
                  100 * accuracy(replicas[0], test));
  }

  // The replicas took the same steps from the same start: the same parameters and buffers.
  for (std::size_t k = 1; k < k_count; ++k)
    if (!same_state(replicas[0], replicas[k])) {
      std::fprintf(stderr, "FAILED: replica %zu's parameters or buffers differ from replica 0's\n", k);
      return 1;
    }
  const double test_accuracy = accuracy(replicas[0], test);
  std::printf("%zu replicas (threads), %d epochs, batch %lld: held-out accuracy %.1f%% on %lld digits\n", k_count,
              epochs, static_cast<long long>(batch), 100 * test_accuracy, static_cast<long long>(test.y.size(0)));
  if (test_accuracy < 0.9) {
    std::fprintf(stderr, "FAILED: held-out accuracy under 90%%\n");
    return 1;
  }
  return 0;
}
