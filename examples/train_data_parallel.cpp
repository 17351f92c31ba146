// Data-parallel training with gradavg. Each tower (a thread) computes the gradient of a small
// network on its shard of every mini-batch; when all towers are done, gradavg averages their
// gradients in place into tower 0's buffers and the model takes one step of SGD with momentum.
//
// Model and data: two_class_model.hpp (one tanh hidden layer, a sigmoid output, cross-entropy on
// a synthetic two-class problem that no linear model separates).
//
//   train_data_parallel [--towers N] [--steps S] [--quiet]
//
// Exits non-zero unless (1) at the first step the averaged gradient matches the gradient of the
// whole mini-batch computed at once (with equal shards, the mean of the shard means is the batch
// mean), and (2) the final training loss is under half the initial one.
#include <gradavg/gradavg.hpp>

#include <algorithm>
#include <barrier>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <numbers>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "support.hpp"
#include "two_class_model.hpp"

namespace {

constexpr int shard_size = 64;  // samples per tower per step
constexpr float learning_rate = 0.1f;
constexpr float momentum = 0.9f;
constexpr float gradient_tolerance = 1e-4f;  // relative; float sums in another order differ ~1e-7

using namespace two_class;  // the model, its data and its gradient

// ---- Command line. ---------------------------------------------------------------------------

struct config {
  int towers = 4;
  int steps = 1500;
  bool quiet = false;
};

std::optional<config> parse_args(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--quiet") {
      c.quiet = true;
      continue;
    }
    const bool towers = arg == "--towers";
    if ((!towers && arg != "--steps") || i + 1 == argc) return std::nullopt;
    const std::optional<int> value = towers ? parse_int(argv[++i], 1, train_size / shard_size)
                                            : parse_int(argv[++i], 1, 1'000'000);
    if (!value) return std::nullopt;
    (towers ? c.towers : c.steps) = *value;
  }
  return c;
}

// ---- Training. -------------------------------------------------------------------------------

int train(const config& cfg) {
  random_source rng(20240601);
  problem start = make_problem(rng);
  const dataset& train_set = start.train_set;
  const dataset& test_set = start.test_set;
  parameters& model = start.model;
  parameters velocity;             // momentum buffer, zero
  parameters full_batch_gradient;  // for the first step's check

  const int towers = cfg.towers;
  const int batch_size = towers * shard_size;
  std::vector<parameters> tower_gradient(static_cast<std::size_t>(towers));  // each tower's own buffers
  std::vector<float> tower_loss(static_cast<std::size_t>(towers));
  std::vector<tower_entries> tower_grads;
  for (const parameters& g : tower_gradient) tower_grads.push_back(entries_of(g));
  // In place: the means overwrite tower 0's gradients, which the update then reads.
  const parameters& mean_gradient = tower_gradient[0];
  auto means = outputs_of(tower_gradient[0]);
  gradavg::plan plan;  // one per training loop

  const evaluation initial = evaluate(model, train_set);
  if (!cfg.quiet) {
    std::printf("%d towers x %d samples per step, %d steps; %d features, %d hidden units, %d training samples\n",
                towers, shard_size, cfg.steps, features, hidden_units, train_size);
    std::printf("initial   train loss %.4f  accuracy %5.1f%%\n", initial.loss, 100 * initial.accuracy);
  }

  dataset epoch = train_set;  // the training set in this epoch's order
  shuffle_into(train_set, epoch, rng);
  Eigen::Index batch_start = 0;
  int step = 0;
  bool stop = false;
  bool failed = false;
  double loss_since_report = 0;
  double trace_since_report = 0, gradient_squared_since_report = 0;
  int steps_since_report = 0;
  const int report_every = std::max(1, cfg.steps / 10);

  // Runs once per step, on one thread, after every tower has its gradient and before any
  // starts the next step: the towers are all waiting, so it may read their buffers and change
  // the model. std::barrier requires it to be noexcept.
  auto finish_step = [&]() noexcept {
    try {
      const bool report = step == 0 || (step + 1) % report_every == 0 || step + 1 == cfg.steps;
      if (step == 0)
        loss_and_gradient(model, epoch.x.middleCols(batch_start, batch_size), epoch.y.segment(batch_start, batch_size),
                          full_batch_gradient);
      // The statistics fused into the same pass: the global norm, and the gradient-noise
      // estimates (McCandlish et al.) from the towers as small batches. Each step's estimates are
      // noisy; as the paper does, tr(Sigma) and |G|^2 are summed over the report interval and
      // their ratio reported.
      // The plan keeps the first step's checks: the towers write into the same buffers every
      // step, so later steps compare pointers and sizes only.
      const gradavg::summary summary =
          gradavg::average_gradients_into(plan, tower_grads, means, {.compute = {.statistics = true}});
      if (towers > 1) {
        const gradavg::noise_estimate noise = summary.noise(static_cast<double>(shard_size));
        trace_since_report += noise.trace_covariance;
        gradient_squared_since_report += noise.gradient_squared;
      }

      if (step == 0) {
        const float difference = max_relative_difference(mean_gradient, full_batch_gradient);
        const bool ok = difference <= gradient_tolerance;
        if (!cfg.quiet || !ok)
          std::printf("step 1: averaged vs full-batch gradient, max relative difference %.2g (%s)\n", difference,
                      ok ? "ok" : "FAILED");
        failed = !ok;
      }
      for (float loss : tower_loss) loss_since_report += loss / static_cast<float>(towers);
      ++steps_since_report;
      if (report && !cfg.quiet) {
        std::printf("step %5d  loss %.4f  gradient norm %.3f", step + 1, loss_since_report / steps_since_report,
                    summary.global_norm());
        if (towers > 1) std::printf("  noise scale %.0f", trace_since_report / gradient_squared_since_report);
        std::printf("\n");
        trace_since_report = gradient_squared_since_report = 0;
        loss_since_report = 0;
        steps_since_report = 0;
      }

      for_each_pair(velocity, mean_gradient, [](auto& vel, const auto& g) { vel = momentum * vel + g; });
      for_each_pair(model, velocity, [](auto& p, const auto& vel) { p -= learning_rate * vel; });

      ++step;
      batch_start += batch_size;
      if (batch_start + batch_size > train_size) {
        shuffle_into(train_set, epoch, rng);
        batch_start = 0;
      }
      stop = failed || step == cfg.steps;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error at step %d: %s\n", step, e.what());
      failed = stop = true;
    }
  };

  const auto started = std::chrono::steady_clock::now();
  std::barrier step_done(towers, finish_step);
  {
    std::vector<std::jthread> threads;
    for (int k = 0; k < towers; ++k)
      threads.emplace_back([&, k] {
        const auto me = static_cast<std::size_t>(k);
        while (!stop) {  // written only by finish_step, while every tower waits
          const Eigen::Index first = batch_start + k * shard_size;
          tower_loss[me] = loss_and_gradient(model, epoch.x.middleCols(first, shard_size),
                                             epoch.y.segment(first, shard_size), tower_gradient[me]);
          step_done.arrive_and_wait();
        }
      });
  }  // jthreads join here
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  const evaluation final_train = evaluate(model, train_set);
  const evaluation final_test = evaluate(model, test_set);
  const bool learned = final_train.loss < 0.5f * initial.loss;
  std::printf("final     train loss %.4f  accuracy %5.1f%%  test loss %.4f  accuracy %5.1f%%  (%d steps, %.2f s)\n",
              final_train.loss, 100 * final_train.accuracy, final_test.loss, 100 * final_test.accuracy, step, seconds);
  if (!learned)
    std::printf("FAILED: final training loss %.4f is not under half the initial %.4f\n", final_train.loss,
                initial.loss);
  return failed || !learned ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<config> cfg = parse_args(argc, argv);
  if (!cfg) {
    std::fprintf(stderr, "usage: %s [--towers 1..%d] [--steps S] [--quiet]\n", argv[0], train_size / shard_size);
    return 2;
  }
  return train(*cfg);
}
