// Mixed-precision data-parallel training with gradavg: 16-bit gradients, float master weights,
// dynamic loss scaling, clipping by the global norm and the gradient-noise scale, all from one
// averaging call per step.
//
// Every step, each of K towers computes the gradient of its shard of the batch in float,
// multiplies it by the loss scale and stores it as Eigen::bfloat16, as a device hands its
// gradients over (the towers run in turn here; train_data_parallel.cpp runs them on threads).
// One gradavg::average_gradients_into call then
//   - averages the bf16 gradients into float outputs, the master gradients, weighted by each
//     tower's sample count (options.weights): an epoch's last batch is short, and there a tower
//     may get fewer samples or none,
//   - unscales them by 1 / loss scale (options.scale),
//   - reports non-finite gradients (options.on_nonfinite = report),
//   - computes the global norm and the gradient-noise statistics (options.statistics).
// Any overflow halves the loss scale, and a step whose mean is not finite (a non-finite input, or
// a float sum of finite bf16 values beyond float's range, which shows as a non-finite norm) is
// skipped; after growth_interval clean steps in a row the scale doubles. bf16 has float's
// exponent range, so only very large scales overflow it; the float sums of squares behind the
// noise statistics overflow from scaled gradients beyond about 2^60, which keeps the scale below.
// It starts deliberately far too large (2^140), so that the first steps overflow and the reaction
// shows. Steps taken update the float master weights by SGD with momentum, the gradient
// multiplied by summary.clip_coefficient(max_norm) in the update.
//
// Model: one tanh hidden layer and a softmax over 4 classes, trained with cross-entropy on
// synthetic data: x ~ N(0, I) in 16 dimensions, the class given by the signs of x's projections
// on two fixed directions.
//
//   train_mixed_precision [--towers K] [--epochs E] [--quiet]
//
// Exits non-zero unless (1) steps were skipped for overflow, the loss scale came down and steps
// with finite noise statistics followed, (2) on the first short last batch that was not skipped,
// the averaged gradient matches the gradient of the whole batch computed at once in float, within
// bf16's precision, (3) the final training loss is under a quarter of the initial one, and (4)
// accuracy on held-out data is at least 90%.
#include <gradavg/gradavg.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "support.hpp"

namespace {

using gradient_value = Eigen::bfloat16;  // what the towers hand over
using gradient_matrix = Eigen::Matrix<gradient_value, Eigen::Dynamic, Eigen::Dynamic>;

constexpr int features = 16;
constexpr int hidden_units = 32;
constexpr int classes = 4;
constexpr int train_size = 4000;  // not a multiple of the batch: every epoch ends with a short batch
constexpr int test_size = 1000;
constexpr int shard_size = 64;  // samples per tower in a full batch
constexpr float learning_rate = 0.1f;
constexpr float momentum = 0.9f;
constexpr double max_norm = 0.25;        // clipping threshold of the global norm
constexpr double initial_loss_scale = 0x1p140;
constexpr int growth_interval = 100;     // good steps in a row before the loss scale doubles
constexpr float batch_gradient_tolerance = 0x1p-6f;  // bf16 keeps 8 significant bits
constexpr float required_accuracy = 0.9f;

// ---- Synthetic data, generated deterministically. -------------------------------------------

struct dataset {
  Eigen::MatrixXf x;    // features x samples: one column per sample
  Eigen::VectorXi y;    // class of each sample, 0 to classes - 1
};

dataset make_dataset(int samples, const direction<features>& u, const direction<features>& v, random_source& rng) {
  dataset d{Eigen::MatrixXf(features, samples), Eigen::VectorXi(samples)};
  for (int j = 0; j < samples; ++j) {
    d.x.col(j) = normal_vector(features, rng);
    d.y(j) = (u.dot(d.x.col(j)) > 0 ? 1 : 0) + (v.dot(d.x.col(j)) > 0 ? 2 : 0);
  }
  return d;
}

// ---- The model, in float. --------------------------------------------------------------------

struct parameters {
  Eigen::MatrixXf w1 = Eigen::MatrixXf::Zero(hidden_units, features);
  Eigen::VectorXf b1 = Eigen::VectorXf::Zero(hidden_units);
  Eigen::MatrixXf w2 = Eigen::MatrixXf::Zero(classes, hidden_units);
  Eigen::VectorXf b2 = Eigen::VectorXf::Zero(classes);
};

// Calls f on each pair of corresponding members of a and b: the one place that lists them.
template <class A, class B, class F>
void for_each_pair(A& a, B& b, F f) {
  f(a.w1, b.w1);
  f(a.b1, b.b1);
  f(a.w2, b.w2);
  f(a.b2, b.b2);
}

// One tower's gradient as it hands it over: the same members in bf16, scaled by the loss scale.
struct tower_gradient {
  gradient_matrix w1 = gradient_matrix(hidden_units, features);
  gradient_matrix b1 = gradient_matrix(hidden_units, 1);
  gradient_matrix w2 = gradient_matrix(classes, hidden_units);
  gradient_matrix b2 = gradient_matrix(classes, 1);
};

// What gradavg sees of one tower: (gradient, variable name) per parameter, as views (no copy).
using tower_entries = std::vector<std::pair<Eigen::Ref<const gradient_matrix>, std::string_view>>;
tower_entries entries_of(const tower_gradient& g) {
  return {{g.w1, "w1"}, {g.b1, "b1"}, {g.w2, "w2"}, {g.b2, "b2"}};
}

// Writable views of the float master gradients, as average_gradients_into outputs.
std::vector<Eigen::Ref<Eigen::MatrixXf>> outputs_of(parameters& p) { return {p.w1, p.b1, p.w2, p.b2}; }

struct forward_pass {
  Eigen::MatrixXf hidden;         // tanh activations, hidden_units x samples
  Eigen::MatrixXf probabilities;  // softmax, classes x samples
};

forward_pass forward(const parameters& p, const Eigen::Ref<const Eigen::MatrixXf>& x) {
  forward_pass f;
  f.hidden = ((p.w1 * x).colwise() + p.b1).array().tanh().matrix();
  Eigen::MatrixXf logits = (p.w2 * f.hidden).colwise() + p.b2;
  logits.rowwise() -= logits.colwise().maxCoeff();  // exp cannot overflow
  f.probabilities = logits.array().exp().matrix();
  f.probabilities.array().rowwise() /= f.probabilities.colwise().sum().array();
  return f;
}

// Sum over samples of -log p(true class).
double summed_loss(const Eigen::MatrixXf& probabilities, const Eigen::Ref<const Eigen::VectorXi>& y) {
  double loss = 0;
  for (Eigen::Index j = 0; j < y.size(); ++j)
    loss -= std::log(std::max(probabilities(y(j), j), std::numeric_limits<float>::min()));
  return loss;
}

// The mean loss over the samples (columns) of x, and its gradient written into grad (zero for
// no samples).
double loss_and_gradient(const parameters& p, const Eigen::Ref<const Eigen::MatrixXf>& x,
                         const Eigen::Ref<const Eigen::VectorXi>& y, parameters& grad) {
  if (x.cols() == 0) {
    for_each_pair(grad, grad, [](auto& g, auto&) { g.setZero(); });
    return 0;
  }
  const forward_pass f = forward(p, x);
  // d loss / d logits = (softmax - one-hot) / samples
  Eigen::MatrixXf d_logits = f.probabilities;
  for (Eigen::Index j = 0; j < y.size(); ++j) d_logits(y(j), j) -= 1.0f;
  d_logits /= static_cast<float>(x.cols());
  const Eigen::MatrixXf d_hidden =
      ((p.w2.transpose() * d_logits).array() * (1.0f - f.hidden.array().square())).matrix();
  grad.w1.noalias() = d_hidden * x.transpose();
  grad.b1 = d_hidden.rowwise().sum();
  grad.w2.noalias() = d_logits * f.hidden.transpose();
  grad.b2 = d_logits.rowwise().sum();
  return summed_loss(f.probabilities, y) / static_cast<double>(x.cols());
}

// x * scale rounded to bf16, computed in double: a product beyond float's range is +-Inf there,
// as in a device's conversion (a double-to-float conversion out of range is undefined in C++).
gradient_value scaled_to_storage(float x, double scale) {
  const double v = static_cast<double>(x) * scale;
  const double limit = std::numeric_limits<float>::max();
  return gradient_value(std::abs(v) > limit ? std::copysign(std::numeric_limits<float>::infinity(), v)
                                            : static_cast<float>(v));
}

// A tower hands its float gradient over: each element times the loss scale, in bf16.
void store_scaled(parameters& g, double loss_scale, tower_gradient& out) {
  for_each_pair(g, out, [loss_scale](const auto& from, auto& to) {
    for (Eigen::Index i = 0; i < from.size(); ++i) to.data()[i] = scaled_to_storage(from.data()[i], loss_scale);
  });
}

struct evaluation {
  double loss;
  float accuracy;
};

evaluation evaluate(const parameters& p, const dataset& d) {
  const forward_pass f = forward(p, d.x);
  Eigen::Index correct = 0;
  for (Eigen::Index j = 0; j < d.y.size(); ++j) {
    Eigen::Index predicted = 0;
    f.probabilities.col(j).maxCoeff(&predicted);
    correct += predicted == d.y(j) ? 1 : 0;
  }
  return {summed_loss(f.probabilities, d.y) / static_cast<double>(d.y.size()),
          static_cast<float>(correct) / static_cast<float>(d.y.size())};
}

// ---- Command line. ---------------------------------------------------------------------------

struct config {
  int towers = 4;
  int epochs = 40;
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
    if ((!towers && arg != "--epochs") || i + 1 == argc) return std::nullopt;
    const std::optional<int> value = towers ? parse_int(argv[++i], 2, 16) : parse_int(argv[++i], 1, 10'000);
    if (!value) return std::nullopt;
    (towers ? c.towers : c.epochs) = *value;
  }
  return c;
}

// ---- Training. -------------------------------------------------------------------------------

// Sums over one epoch's steps, for its report line.
struct epoch_totals {
  double loss = 0;
  int steps = 0;
  int skipped = 0;
  int good = 0;                 // steps taken
  int clipped = 0;              // steps taken whose gradient was clipped
  double norm = 0;              // global norm before clipping, over steps taken
  int with_noise = 0;           // steps taken whose statistics were finite
  double trace_covariance = 0;  // the noise estimate's numerator and denominator over those:
  double gradient_squared = 0;  // summed separately, their ratio estimates B_simple
};

// What overflowed in one step's averaging.
enum class overflow {
  none,
  inputs,   // a bf16 gradient element is +-Inf: the non-finite report
  sum,      // finite bf16 gradients whose float sum overflowed: the mean, and so the norm, is not finite
  squares,  // the means are fine, but the float sums of weighted squares behind the noise statistics
            // overflowed: unscaled gradients beyond about 2^64 over the square root of the weight
};

overflow overflow_of(const gradavg::summary& s) {
  if (s.nonfinite()) return overflow::inputs;
  if (!std::isfinite(s.global_norm())) return overflow::sum;
  if (!std::isfinite(s.sum_mean_of_squares)) return overflow::squares;
  return overflow::none;
}

const char* describe(overflow kind) {
  switch (kind) {
    case overflow::inputs:
      return "bf16 gradients overflowed (non-finite report): step skipped";
    case overflow::sum:
      return "the float sum of finite bf16 gradients overflowed (non-finite norm): step skipped";
    case overflow::squares:
      return "the means of squares overflowed: step taken, no noise estimate";
    case overflow::none:
      break;
  }
  return "no overflow";
}

int train(const config& cfg) {
  random_source rng(20251130);
  const auto [u, v] = orthonormal_directions<features>(rng);
  const dataset train_set = make_dataset(train_size, u, v, rng);
  const dataset test_set = make_dataset(test_size, u, v, rng);

  parameters model;
  model.w1 = Eigen::MatrixXf::NullaryExpr(hidden_units, features, [&] { return rng.normal(); });
  model.w1 /= std::sqrt(float{features});
  model.w2 = Eigen::MatrixXf::NullaryExpr(classes, hidden_units, [&] { return rng.normal(); });
  model.w2 /= std::sqrt(float{hidden_units});
  parameters velocity;             // momentum buffer, zero
  parameters master_gradient;      // gradavg's float outputs: the unscaled mean gradient
  parameters tower_float;          // one tower's gradient in float, before it is handed over
  parameters full_batch_gradient;  // for the short-batch check

  const int towers = cfg.towers;
  const int batch_size = towers * shard_size;
  std::vector<tower_gradient> tower_grad(static_cast<std::size_t>(towers));
  std::vector<tower_entries> tower_grads;
  for (const tower_gradient& g : tower_grad) tower_grads.push_back(entries_of(g));
  auto means = outputs_of(master_gradient);
  std::vector<double> weights(static_cast<std::size_t>(towers));  // samples on each tower

  double loss_scale = initial_loss_scale;
  gradavg::options opts;
  opts.weights = weights;
  opts.on_nonfinite = gradavg::nonfinite_policy::report;
  opts.statistics = true;

  const evaluation initial = evaluate(model, train_set);
  if (!cfg.quiet) {
    std::printf("%d towers x %d samples per step, %d epochs of %d samples (the last batch of each: %d); "
                "bf16 gradients, float master weights\n",
                towers, shard_size, cfg.epochs, train_size, train_size % batch_size);
    std::printf("initial   train loss %.4f  accuracy %5.1f%%  loss scale 2^%.0f\n", initial.loss,
                100 * initial.accuracy, std::log2(loss_scale));
  }

  dataset epoch = train_set;  // the training set in this epoch's order
  int step = 0, total_skipped = 0, total_with_noise = 0, good_in_a_row = 0;
  overflow last_overflow = overflow::none;
  bool short_batch_checked = false, failed = false;
  for (int e = 1; e <= cfg.epochs && !failed; ++e) {
    shuffle_into(train_set, epoch, rng);
    epoch_totals totals;
    for (int batch_start = 0; batch_start < train_size; batch_start += batch_size) {
      ++step;
      // Tower k takes the next shard_size samples of the batch, or what is left of it.
      const int batch = std::min(batch_size, train_size - batch_start);
      double batch_loss = 0;
      for (int k = 0; k < towers; ++k) {
        const int first = std::min(batch, k * shard_size), count = std::min(batch, first + shard_size) - first;
        const auto kk = static_cast<std::size_t>(k);
        weights[kk] = count;
        batch_loss += count * loss_and_gradient(model, epoch.x.middleCols(batch_start + first, count),
                                                epoch.y.segment(batch_start + first, count), tower_float);
        store_scaled(tower_float, loss_scale, tower_grad[kk]);
      }
      totals.loss += batch_loss / batch;
      ++totals.steps;

      opts.scale = 1.0 / loss_scale;
      opts.samples_per_tower = static_cast<double>(batch) / towers;
      const gradavg::summary s = gradavg::average_gradients_into(tower_grads, means, opts);

      // What overflowed, if anything: every overflow halves the loss scale; only a non-finite
      // mean (inputs, or their float sum) skips the step.
      const overflow kind = overflow_of(s);
      if (kind != overflow::none) {
        if (!cfg.quiet && kind != last_overflow)
          std::printf("  step %4d: %s; loss scale halved from 2^%.0f (and again at each step while it lasts)\n",
                      step, describe(kind), std::log2(loss_scale));
        loss_scale /= 2;
        good_in_a_row = 0;
      }
      last_overflow = kind;
      if (kind == overflow::inputs || kind == overflow::sum) {
        ++totals.skipped;
        ++total_skipped;
        continue;
      }

      if (batch < batch_size && !short_batch_checked) {
        // The weighted mean of the towers' shard gradients is the gradient of the whole batch.
        loss_and_gradient(model, epoch.x.middleCols(batch_start, batch), epoch.y.segment(batch_start, batch),
                          full_batch_gradient);
        const float difference = max_relative_difference(master_gradient, full_batch_gradient);
        const bool ok = difference <= batch_gradient_tolerance;
        if (!cfg.quiet || !ok)
          std::printf("  step %4d: short batch of %d, weighted mean vs whole-batch gradient: max relative "
                      "difference %.2g (%s)\n",
                      step, batch, difference, ok ? "ok" : "FAILED");
        failed = !ok;
        short_batch_checked = true;
      }

      const auto clip = static_cast<float>(s.clip_coefficient(max_norm));
      totals.clipped += clip < 1 ? 1 : 0;
      for_each_pair(velocity, master_gradient, [clip](auto& vel, const auto& g) { vel = momentum * vel + clip * g; });
      for_each_pair(model, velocity, [](auto& p, const auto& vel) { p -= learning_rate * vel; });

      totals.norm += s.global_norm();
      ++totals.good;
      if (kind == overflow::squares) continue;
      const gradavg::noise_estimate noise = s.noise();
      totals.trace_covariance += noise.trace_covariance;
      totals.gradient_squared += noise.gradient_squared;
      ++totals.with_noise;
      ++total_with_noise;
      if (++good_in_a_row == growth_interval) {
        loss_scale *= 2;
        good_in_a_row = 0;
      }
    }
    if (!cfg.quiet)
      std::printf("epoch %3d  loss %.4f  loss scale 2^%-3.0f  skipped %2d  clipped %2d  global norm %.4f  "
                  "noise scale %.0f\n",
                  e, totals.loss / totals.steps, std::log2(loss_scale), totals.skipped, totals.clipped,
                  totals.good > 0 ? totals.norm / totals.good : std::nan(""),
                  totals.with_noise > 0 ? totals.trace_covariance / totals.gradient_squared : std::nan(""));
  }

  const evaluation final_train = evaluate(model, train_set);
  const evaluation final_test = evaluate(model, test_set);
  std::printf("final     train loss %.4f  accuracy %5.1f%%  test loss %.4f  accuracy %5.1f%%  (%d steps, %d skipped, "
              "loss scale 2^%.0f)\n",
              final_train.loss, 100 * final_train.accuracy, final_test.loss, 100 * final_test.accuracy, step,
              total_skipped, std::log2(loss_scale));
  if (total_skipped == 0 || !(loss_scale < initial_loss_scale)) {
    std::printf("FAILED: the loss scale 2^%.0f never overflowed the gradients\n", std::log2(initial_loss_scale));
    failed = true;
  }
  if (total_with_noise == 0) {
    std::printf("FAILED: no step had finite noise statistics\n");
    failed = true;
  }
  if (!short_batch_checked) {
    std::printf("FAILED: every short last batch was skipped\n");
    failed = true;
  }
  if (!(final_train.loss < 0.25 * initial.loss)) {
    std::printf("FAILED: final training loss %.4f is not under a quarter of the initial %.4f\n", final_train.loss,
                initial.loss);
    failed = true;
  }
  if (!(final_test.accuracy >= required_accuracy)) {
    std::printf("FAILED: held-out accuracy %.1f%% is under %.0f%%\n", 100 * final_test.accuracy,
                100 * required_accuracy);
    failed = true;
  }
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<config> cfg = parse_args(argc, argv);
  if (!cfg) {
    std::fprintf(stderr, "usage: %s [--towers 2..16] [--epochs E] [--quiet]\n", argv[0]);
    return 2;
  }
  try {
    return train(*cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
