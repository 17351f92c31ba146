// Data-parallel training across processes with gradavg::mpi: every rank (a process) runs
// --towers threads, each computing the gradient of two_class_model.hpp's network on its shard of
// every mini-batch; gradavg::mpi then averages the gradients of all towers of all ranks in place
// into each rank's tower 0, and every rank takes the same step of SGD with momentum (the average
// is bitwise the same on every rank, so the models never drift apart).
//
//   mpiexec -n 2 train_mpi [--towers N] [--steps S] [--compression none|bf16|fp16|int8|all]
//       [--output replicated|sharded] [--quiet]
//   GRADAVG_TIMELINE=trace.%r.json GRADAVG_LOG=info mpiexec -n 2 train_mpi ...
//       (a timeline per rank, what the plan chose: docs/timeline.md)
//
// --compression: the exchange's wire format (gradavg::compression; default none; int8 with error
// feedback, a residual per rank kept across steps); all: the same
// training once per format from the same start, each one's accuracy printed beside the fp32
// exchange's.
// --output sharded: ZeRO-1 — each rank receives the means of its shard of the parameters only
// (gradavg::output_mode::sharded, half the bytes on the wire), keeps the momentum of that shard
// only, updates its shard, and gradavg::mpi::gather_shards sends every shard to every rank.
//
// Exits non-zero unless (1) at the first step the averaged gradient matches the gradient of the
// whole mini-batch (every shard of every rank) computed at once (within the format's rounding),
// (2) the final training loss is under half the initial one, (3) every rank ends with bitwise the
// same model, and (4) with all, every format's test accuracy is within 0.5 points of the fp32
// exchange's (or better).
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
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
  gradavg::output_mode output = gradavg::output_mode::replicated;
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
    if (arg == "--output" && i + 1 < argc) {
      const std::string_view name = argv[++i];
      if (name != "replicated" && name != "sharded") return std::nullopt;
      c.output = name == "sharded" ? gradavg::output_mode::sharded : gradavg::output_mode::replicated;
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

/// Calls f(variable, first element, count) for each variable's part in the flat elements of
/// `shard` (the variables end to end, in order).
template <class Views, class F>
void for_each_part(const gradavg::element_range& shard, const Views& views, F f) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < views.size(); ++i) {
    const auto size = static_cast<std::size_t>(views[i].size());
    const std::size_t begin = std::max(shard.begin, at), end = std::min(shard.end, at + size);
    if (begin < end) f(i, begin - at, end - begin);
    at += size;
  }
}

/// SGD with momentum on the shard's elements of the model: velocity holds the shard's momentum
/// (its first element the shard's first).
void update_shard(const gradavg::element_range& shard, const std::vector<Eigen::Ref<Eigen::MatrixXf>>& means,
                  std::vector<Eigen::Ref<Eigen::MatrixXf>> model, std::vector<float>& velocity) {
  velocity.resize(shard.end - shard.begin, 0.0f);
  std::size_t v = 0;
  for_each_part(shard, means, [&](std::size_t i, std::size_t first, std::size_t count) {
    const auto n = static_cast<Eigen::Index>(count);
    Eigen::Map<const Eigen::ArrayXf> g(means[i].data() + first, n);
    Eigen::Map<Eigen::ArrayXf> p(model[i].data() + first, n), vel(velocity.data() + v, n);
    vel = momentum * vel + g;
    p -= learning_rate * vel;
    v += count;
  });
}

/// The squared norm of the shard's means, in double.
double shard_squared_norm(const gradavg::element_range& shard, const std::vector<Eigen::Ref<Eigen::MatrixXf>>& means) {
  double sum = 0;
  for_each_part(shard, means, [&](std::size_t i, std::size_t first, std::size_t count) {
    for (std::size_t j = 0; j < count; ++j) sum += double(means[i].data()[first + j]) * double(means[i].data()[first + j]);
  });
  return sum;
}

/// The largest difference between a and b in the shard, relative to b's largest element.
float shard_relative_difference(const gradavg::element_range& shard, const std::vector<Eigen::Ref<Eigen::MatrixXf>>& a,
                                const std::vector<Eigen::Ref<Eigen::MatrixXf>>& b) {
  float difference = 0, scale = 0;
  for (const auto& y : b) scale = std::max(scale, y.cwiseAbs().maxCoeff());
  for_each_part(shard, a, [&](std::size_t i, std::size_t first, std::size_t count) {
    for (std::size_t j = 0; j < count; ++j)
      difference = std::max(difference, std::fabs(a[i].data()[first + j] - b[i].data()[first + j]));
  });
  return difference / scale;
}

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
  const bool sharded = cfg.output == gradavg::output_mode::sharded;
  opts.compute.statistics = !sharded;  // statistics need every mean: the norm is summed below
  opts.exchange.compression = cfg.format;
  opts.exchange.output = cfg.output;
  // GRADAVG_TIMELINE=trace.%r.json: each rank's calls recorded (docs/timeline.md), written when
  // the training ends.
  const std::unique_ptr<gradavg::timeline> line = gradavg::timeline::from_environment();
  opts.run.timeline = line.get();
  // GRADAVG_LOG=info: what the plan chose, on stderr; debug: a line per step.
  const std::unique_ptr<gradavg::logger> log = gradavg::logger::from_environment();
  opts.run.log = log.get();
  // int8 with error feedback: this rank's residual, one float per parameter, kept across steps.
  std::vector<float> residual;
  if (cfg.format == gradavg::compression::int8) {
    for (const auto& m : means) residual.resize(residual.size() + static_cast<std::size_t>(m.size()));
    opts.exchange.residual = residual;
  }

  const evaluation initial = evaluate(model, train_set);
  if (!cfg.quiet && rank == 0) {
    std::printf("%d ranks x %d towers x %d samples per step, %d steps, compression %s, output %s\n", ranks, towers,
                shard_size, cfg.steps, wire_format_of(cfg.format).name, sharded ? "sharded" : "replicated");
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
  std::vector<float> shard_velocity;  // --output sharded: the momentum of this rank's shard
  gradavg::mpi::workspace gather_work;
  gradavg::mpi::options gather_opts;
  gather_opts.exchange.work = &gather_work;
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
      // Sharded: this rank's shard of the means against the same elements of the full batch's.
      const float difference = sharded ? shard_relative_difference(summary.shard, means, outputs_of(full_batch_gradient))
                                       : max_relative_difference(mean_gradient, full_batch_gradient);
      failed = difference > gradient_tolerance(cfg.format);
      if ((!cfg.quiet && rank == 0) || failed)
        std::printf("rank %d, step 1: averaged vs full-batch gradient over %d samples, max relative difference %.2g (%s)\n",
                    rank, batch_size, difference, failed ? "FAILED" : "ok");
    }
    const bool report = (step + 1) % report_every == 0 || step + 1 == cfg.steps;
    if (sharded) {
      // ZeRO-1: the momentum and the update of this rank's shard only, then every shard gathered.
      update_shard(summary.shard, means, outputs_of(model), shard_velocity);
      gradavg::mpi::gather_shards(MPI_COMM_WORLD, outputs_of(model), gather_opts);
    } else {
      for_each_pair(velocity, mean_gradient, [](auto& vel, const auto& g) { vel = momentum * vel + g; });
      for_each_pair(model, velocity, [](auto& p, const auto& vel) { p -= learning_rate * vel; });
    }
    if (!cfg.quiet && report) {
      // Sharded: each rank holds its shard's means; the norm is the shards' squared norms summed.
      double norm = sharded ? 0.0 : summary.global_norm();
      if (sharded) {
        double squares = shard_squared_norm(summary.shard, means);
        MPI_Allreduce(MPI_IN_PLACE, &squares, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        norm = std::sqrt(squares);
      }
      float loss = 0;
      for (float l : tower_loss) loss += l / static_cast<float>(towers);
      if (rank == 0) std::printf("step %5d  rank 0 loss %.4f  gradient norm %.3f\n", step + 1, loss, norm);
    }
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
    if (line != nullptr) {
      const gradavg::call_profile& last = line->last_call();
      std::printf("last step on rank 0: %zu buckets, %.0f KiB sent, %.3f ms (local %.3f, waiting %.3f), overlap %.0f%%; "
                  "timeline: %s\n",
                  last.buckets, static_cast<double>(last.sent_bytes) / 1024, last.seconds * 1e3,
                  last.local_seconds * 1e3, last.wait_seconds * 1e3, 100 * last.overlap(), line->file().c_str());
    }
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
    std::fprintf(stderr, "usage: mpiexec -n P %s [--towers 1..%d] [--steps S] [--compression none|bf16|fp16|int8|all] "
                 "[--output replicated|sharded] [--quiet]\n", argv[0],
                 train_size / shard_size / ranks);
  }
  MPI_Finalize();
  return status;
}
