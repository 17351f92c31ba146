// Data-parallel training across processes with gradavg::mpi: every rank (a process) runs
// --towers threads, each computing the gradient of two_class_model.hpp's network on its shard of
// every mini-batch; gradavg::mpi then averages the gradients of all towers of all ranks in place
// into each rank's tower 0, and every rank takes the same step of SGD with momentum (the average
// is bitwise the same on every rank, so the models never drift apart).
//
//   mpiexec -n 2 train_mpi [--towers N] [--steps S] [--compression none|bf16|fp16|int8|all] [--quiet]
//
// --compression: the exchange's wire format (gradavg::compression; default none; int8 with error
// feedback, a residual per rank kept across steps); all: the same
// training once per format from the same start, each one's accuracy printed beside the fp32
// exchange's.
//
// Exits non-zero unless (1) at the first step the averaged gradient matches the gradient of the
// whole mini-batch (every shard of every rank) computed at once (within the format's rounding),
// (2) the final training loss is under half the initial one, (3) every rank ends with bitwise the
// same model, and (4) with all, every format's test accuracy is within 0.5 points of the fp32
// exchange's (or better).
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

#include "support.hpp"
#include "two_class_model.hpp"

namespace {

using namespace two_class;  // the model, its data and its gradient

constexpr int shard_size = 64;  // samples per tower per step
constexpr float learning_rate = 0.1f;
constexpr float momentum = 0.9f;
/// The first step's gradient against the full batch's, relative to its largest element: float
/// sums in another order differ ~1e-7; a lossy format adds its roundings (support.hpp).
float gradient_tolerance(gradavg::compression format) {
  return format == gradavg::compression::none ? 1e-4f : static_cast<float>(wire_format_of(format).rounding_tolerance);
}

struct config {
  int towers = 2;
  int steps = 1000;
  bool quiet = false;
  bool every_format = false;  // --compression all
  gradavg::compression format = gradavg::compression::none;
};

std::optional<config> parse_args(int argc, char** argv, int ranks) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--quiet") {
      c.quiet = true;
      continue;
    }
    if (arg == "--compression" && i + 1 < argc) {
      const std::string_view name = argv[++i];
      c.every_format = name == "all";
      const std::optional<wire_format> named = wire_format_named(name);
      if (!c.every_format && !named) return std::nullopt;
      if (named) c.format = named->format;
      continue;
    }
    const bool towers = arg == "--towers";
    if ((!towers && arg != "--steps") || i + 1 == argc) return std::nullopt;
    const std::optional<int> value = towers ? parse_int(argv[++i], 1, train_size / shard_size / ranks)
                                            : parse_int(argv[++i], 1, 1'000'000);
    if (!value) return std::nullopt;
    (towers ? c.towers : c.steps) = *value;
  }
  return c;
}

/// FNV-1a of the model's parameters, to compare ranks.
std::uint64_t fingerprint(parameters& p) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& out : outputs_of(p)) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(out.data());
    for (std::size_t i = 0; i < static_cast<std::size_t>(out.size()) * sizeof(float); ++i)
      h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

/// What one training run left: its exit status and its final test accuracy.
struct outcome {
  int status;
  float test_accuracy;
};

outcome train(const config& cfg, int rank, int ranks) {
  // Every rank generates the same data and initial model from the same seed.
  random_source rng(20240601);
  problem start = make_problem(rng);
  const dataset& train_set = start.train_set;
  const dataset& test_set = start.test_set;
  parameters& model = start.model;
  parameters velocity;

  const int towers = cfg.towers;
  const int batch_size = ranks * towers * shard_size;  // the global mini-batch
  std::vector<parameters> tower_gradient(static_cast<std::size_t>(towers));
  std::vector<tower_entries> tower_grads;
  for (const parameters& g : tower_gradient) tower_grads.push_back(entries_of(g));
  const parameters& mean_gradient = tower_gradient[0];  // in place, as in train_data_parallel
  auto means = outputs_of(tower_gradient[0]);
  gradavg::mpi::workspace work;  // fusion buffers kept from step to step
  gradavg::mpi::options opts;
  opts.exchange.work = &work;
  opts.compute.statistics = true;
  opts.exchange.compression = cfg.format;
  // int8 with error feedback: this rank's residual, one float per parameter, kept across steps.
  std::vector<float> residual;
  if (cfg.format == gradavg::compression::int8) {
    for (const auto& m : means) residual.resize(residual.size() + static_cast<std::size_t>(m.size()));
    opts.exchange.residual = residual;
  }

  const evaluation initial = evaluate(model, train_set);
  if (!cfg.quiet && rank == 0) {
    std::printf("%d ranks x %d towers x %d samples per step, %d steps, compression %s\n", ranks, towers, shard_size,
                cfg.steps, wire_format_of(cfg.format).name);
    std::printf("initial   train loss %.4f  accuracy %5.1f%%\n", initial.loss, 100 * initial.accuracy);
  }
  dataset epoch = train_set;
  shuffle_into(train_set, epoch, rng);
  Eigen::Index batch_start = 0;
  bool failed = false;
  const int report_every = std::max(1, cfg.steps / 10);
  std::vector<float> tower_loss(static_cast<std::size_t>(towers));
  parameters full_batch_gradient;  // for the first step's check
  gradavg::plan plan;  // one per training loop, on every rank
  const auto started = std::chrono::steady_clock::now();
  for (int step = 0; step < cfg.steps; ++step) {
    // This rank's towers: shards rank * towers ... of the global batch, one thread each.
    auto shard = [&](int k) {
      const Eigen::Index first = batch_start + (rank * towers + k) * shard_size;
      tower_loss[static_cast<std::size_t>(k)] =
          loss_and_gradient(model, epoch.x.middleCols(first, shard_size), epoch.y.segment(first, shard_size),
                            tower_gradient[static_cast<std::size_t>(k)]);
    };
    {
      std::vector<std::jthread> threads;
      for (int k = 1; k < towers; ++k) threads.emplace_back(shard, k);
      shard(0);
    }
    if (step == 0)
      loss_and_gradient(model, epoch.x.middleCols(batch_start, batch_size), epoch.y.segment(batch_start, batch_size),
                        full_batch_gradient);

    // With a plan, steps after the first skip the agreement on variables and shapes. A new
    // stochastic rounding each step (int8).
    opts.exchange.seed = static_cast<std::uint64_t>(step);
    const gradavg::summary summary =
        gradavg::mpi::average_gradients_into(plan, MPI_COMM_WORLD, tower_grads, means, opts);

    if (step == 0) {
      const float difference = max_relative_difference(mean_gradient, full_batch_gradient);
      failed = difference > gradient_tolerance(cfg.format);
      if ((!cfg.quiet && rank == 0) || failed)
        std::printf("rank %d, step 1: averaged vs full-batch gradient over %d samples, max relative difference %.2g (%s)\n",
                    rank, batch_size, difference, failed ? "FAILED" : "ok");
    }
    if (!cfg.quiet && rank == 0 && ((step + 1) % report_every == 0 || step + 1 == cfg.steps)) {
      float loss = 0;
      for (float l : tower_loss) loss += l / static_cast<float>(towers);
      std::printf("step %5d  rank 0 loss %.4f  gradient norm %.3f\n", step + 1, loss, summary.global_norm());
    }
    for_each_pair(velocity, mean_gradient, [](auto& vel, const auto& g) { vel = momentum * vel + g; });
    for_each_pair(model, velocity, [](auto& p, const auto& vel) { p -= learning_rate * vel; });
    batch_start += batch_size;
    if (batch_start + batch_size > train_size) {
      shuffle_into(train_set, epoch, rng);
      batch_start = 0;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  // Every rank holds the same model, bit for bit.
  const std::uint64_t mine = fingerprint(model);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(ranks));
  MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  bool same = true;
  for (std::uint64_t h : all) same = same && h == all[0];

  const evaluation final_train = evaluate(model, train_set);
  const evaluation final_test = evaluate(model, test_set);
  const bool learned = final_train.loss < 0.5f * initial.loss;
  if (rank == 0) {
    std::printf("final     train loss %.4f  accuracy %5.1f%%  test loss %.4f  accuracy %5.1f%%  (%d steps, %.2f s)\n",
                final_train.loss, 100 * final_train.accuracy, final_test.loss, 100 * final_test.accuracy, cfg.steps,
                seconds);
    std::printf("models on the %d ranks: %s\n", ranks, same ? "bitwise identical" : "DIFFER (FAILED)");
    if (!learned)
      std::printf("FAILED: final training loss %.4f is not under half the initial %.4f\n", final_train.loss,
                  initial.loss);
  }
  return {failed || !learned || !same ? 1 : 0, final_test.accuracy};
}

/// The training of cfg; with every_format, once per format, each compared with the fp32 exchange's.
int run(config cfg, int rank, int ranks) {
  if (!cfg.every_format) return train(cfg, rank, ranks).status;
  int status = 0;
  float fp32_accuracy = 0;
  for (const wire_format& f : wire_formats) {
    cfg.format = f.format;
    const outcome o = train(cfg, rank, ranks);
    if (f.format == gradavg::compression::none) fp32_accuracy = o.test_accuracy;
    const float points = 100 * (o.test_accuracy - fp32_accuracy);
    const bool close = points >= -0.5f;
    if (rank == 0)
      std::printf("compression %-4s  test accuracy %5.1f%%  (%+.2f points against the fp32 exchange%s)\n", f.name,
                  100 * o.test_accuracy, points, close ? "" : ": FAILED, more than 0.5 below");
    status |= o.status | (close ? 0 : 1);
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // only the main thread calls MPI
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int status = 2;
  if (const std::optional<config> cfg = parse_args(argc, argv, ranks)) {
    try {
      status = run(*cfg, rank, ranks);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      status = 1;
    }
  } else if (rank == 0) {
    std::fprintf(stderr, "usage: mpiexec -n P %s [--towers 1..%d] [--steps S] [--compression none|bf16|fp16|int8|all] [--quiet]\n", argv[0],
                 train_size / shard_size / ranks);
  }
  MPI_Finalize();
  return status;
}
