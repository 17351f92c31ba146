// The model both data-parallel training examples train (train_data_parallel: threads as towers;
// train_mpi: processes, each with threads as towers): one tanh hidden layer and a sigmoid output,
// trained with cross-entropy on a synthetic two-class problem that no linear model separates:
// x ~ N(0, I) in 20 dimensions, class 1 when x's projection on a fixed plane lies in the disc
// holding half the probability.
#pragma once

#include <gradavg/gradavg.hpp>

#include <cmath>
#include <numbers>
#include <string_view>
#include <utility>
#include <vector>

#include "support.hpp"

namespace two_class {

constexpr int features = 20;
constexpr int hidden_units = 32;
constexpr int train_size = 4096;
constexpr int test_size = 1024;

// ---- Synthetic data, generated deterministically. -------------------------------------------

struct dataset {
  Eigen::MatrixXf x;  // features x samples: one column per sample
  Eigen::VectorXf y;  // labels, 0 or 1
};

inline dataset make_dataset(int samples, const direction<features>& u, const direction<features>& v,
                            random_source& rng) {
  const float radius_squared = 2.0f * std::numbers::ln2_v<float>;  // P(chi^2 with 2 dof < r^2) = 1/2
  dataset d{Eigen::MatrixXf(features, samples), Eigen::VectorXf(samples)};
  for (int j = 0; j < samples; ++j) {
    d.x.col(j) = normal_vector(features, rng);
    const float a = u.dot(d.x.col(j)), b = v.dot(d.x.col(j));
    d.y(j) = a * a + b * b < radius_squared ? 1.0f : 0.0f;
  }
  return d;
}

// ---- The model. ------------------------------------------------------------------------------

struct parameters {
  Eigen::MatrixXf w1 = Eigen::MatrixXf::Zero(hidden_units, features);
  Eigen::VectorXf b1 = Eigen::VectorXf::Zero(hidden_units);
  Eigen::VectorXf w2 = Eigen::VectorXf::Zero(hidden_units);
  Eigen::VectorXf b2 = Eigen::VectorXf::Zero(1);
};

// Calls f on each pair of corresponding members of a and b: the one place that lists them.
template <class A, class B, class F>
void for_each_pair(A& a, B& b, F f) {
  f(a.w1, b.w1);
  f(a.b1, b.b1);
  f(a.w2, b.w2);
  f(a.b2, b.b2);
}

// What gradavg sees of one tower: (gradient, variable name) per parameter, as views (no copy).
// The views stay valid because the gradient buffers never change size.
using tower_entries = std::vector<std::pair<Eigen::Ref<const Eigen::MatrixXf>, std::string_view>>;
inline tower_entries entries_of(const parameters& g) { return {{g.w1, "w1"}, {g.b1, "b1"}, {g.w2, "w2"}, {g.b2, "b2"}}; }

// Writable views of the same members, as average_gradients_into outputs.
inline std::vector<Eigen::Ref<Eigen::MatrixXf>> outputs_of(parameters& p) { return {p.w1, p.b1, p.w2, p.b2}; }

struct forward_pass {
  Eigen::MatrixXf hidden;  // tanh activations, hidden_units x samples
  Eigen::ArrayXf logits;   // one per sample
};

inline forward_pass forward(const parameters& p, const Eigen::Ref<const Eigen::MatrixXf>& x) {
  forward_pass f;
  f.hidden = ((p.w1 * x).colwise() + p.b1).array().tanh().matrix();
  f.logits = (f.hidden.transpose() * p.w2).array() + p.b2(0);
  return f;
}

// Mean cross-entropy of sigmoid(logits) against y, in a form that cannot overflow.
inline float mean_loss(const Eigen::ArrayXf& logits, const Eigen::ArrayXf& y) {
  return (logits.max(0.0f) - y * logits + (-logits.abs()).exp().log1p()).mean();
}

// The mean loss over the samples (columns) of x; its gradient is written into grad.
inline float loss_and_gradient(const parameters& p, const Eigen::Ref<const Eigen::MatrixXf>& x,
                        const Eigen::Ref<const Eigen::VectorXf>& y, parameters& grad) {
  const forward_pass f = forward(p, x);
  // d loss / d logit = (sigmoid(logit) - y) / samples
  const Eigen::VectorXf d_logits =
      ((1.0f + (-f.logits).exp()).inverse() - y.array()).matrix() / static_cast<float>(x.cols());
  const Eigen::MatrixXf d_hidden =
      ((p.w2 * d_logits.transpose()).array() * (1.0f - f.hidden.array().square())).matrix();
  grad.w1.noalias() = d_hidden * x.transpose();
  grad.b1 = d_hidden.rowwise().sum();
  grad.w2.noalias() = f.hidden * d_logits;
  grad.b2(0) = d_logits.sum();
  return mean_loss(f.logits, y.array());
}

struct evaluation {
  float loss;
  float accuracy;
};

inline evaluation evaluate(const parameters& p, const dataset& d) {
  const forward_pass f = forward(p, d.x);
  const auto correct = ((f.logits > 0.0f) == (d.y.array() > 0.5f)).count();
  return {mean_loss(f.logits, d.y.array()), static_cast<float>(correct) / static_cast<float>(d.y.size())};
}

/// The training and held-out sets and the initial model, drawn from rng in this order: the same
/// for the same seed (on every rank of a job).
struct problem {
  dataset train_set;
  dataset test_set;
  parameters model;
};

inline problem make_problem(random_source& rng) {
  const auto [u, v] = orthonormal_directions<features>(rng);
  problem p{make_dataset(train_size, u, v, rng), make_dataset(test_size, u, v, rng), {}};
  p.model.w1 = Eigen::MatrixXf::NullaryExpr(hidden_units, features, [&] { return rng.normal(); });
  p.model.w1 /= std::sqrt(float{features});
  p.model.w2 = normal_vector(hidden_units, rng) / std::sqrt(float{hidden_units});
  return p;
}

}  // namespace two_class
