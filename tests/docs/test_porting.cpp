// docs/porting.md's C++ snippets, compiled as the guide shows them (porting_in_sync checks that
// the guide's blocks are these files) and run against references computed here in double.
#include "seed_average.cpp"
#include "training_step.cpp"
#include "errors.cpp"

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

namespace {

Eigen::MatrixXf random_matrix(Eigen::Index rows, Eigen::Index cols, std::uint32_t seed) {
  const auto values = gradavg_test::random_values<float>(static_cast<std::size_t>(rows * cols), seed);
  return Eigen::Map<const Eigen::MatrixXf>(values.data(), rows, cols);
}

bool same_bits(const Eigen::MatrixXf& a, const Eigen::MatrixXf& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         gradavg_test::same_bits(a.data(), b.data(), static_cast<std::size_t>(a.size()));
}

/// Requires got to match want element by element, within float rounding of sums whose terms
/// have magnitude up to scale.
void require_close(const Eigen::MatrixXf& got, const std::vector<double>& want, double scale, const char* what) {
  INFO(what);
  REQUIRE(static_cast<std::size_t>(got.size()) == want.size());
  for (std::size_t j = 0; j < want.size(); ++j) {
    INFO("element " << j << ": got " << got.data()[j] << ", want " << want[j]);
    REQUIRE(std::abs(static_cast<double>(got.data()[j]) - want[j]) <= 1e-5 * scale);
  }
}

}  // namespace

TEST_CASE("the seed's call returns average_grads, average_grads_square and reports None") {
  const std::size_t towers = 3;
  std::vector<Eigen::MatrixXf> w;
  std::vector<Eigen::VectorXf> b;
  for (std::uint32_t k = 0; k < towers; ++k) {
    w.push_back(random_matrix(3, 4, 100 + k));
    b.push_back(random_matrix(3, 1, 200 + k));
  }
  tower_gradients tower_grads;
  for (std::size_t k = 0; k < towers; ++k)
    tower_grads.push_back({{w[k], "dense/w"}, {std::nullopt, "embedding"}, {b[k], "dense/b"}});

  std::ostringstream log;
  const auto averaged = average_like_the_seed(tower_grads, log);

  CHECK(log.str() == "None gradient for embedding\n");
  REQUIRE(averaged.skipped.size() == 1);
  CHECK(averaged.skipped[0].index == 1);
  CHECK(averaged.skipped[0].variable == "embedding");
  REQUIRE(averaged.gradients.size() == 2);
  REQUIRE(averaged.squares.size() == 2);
  CHECK(averaged.gradients[0].second == "dense/w");
  CHECK(averaged.gradients[1].second == "dense/b");
  CHECK(averaged.squares[0].second == "dense/w");
  CHECK(averaged.squares[1].second == "dense/b");

  const gradavg_test::expectation<float> w_want({w[0].data(), w[1].data(), w[2].data()}, 12);
  const gradavg_test::expectation<float> b_want({b[0].data(), b[1].data(), b[2].data()}, 3);
  for (const auto& [result, rows, cols] : {std::tuple{&averaged.gradients[0].first, 3, 4},
                                           std::tuple{&averaged.squares[0].first, 3, 4},
                                           std::tuple{&averaged.gradients[1].first, 3, 1},
                                           std::tuple{&averaged.squares[1].first, 3, 1}}) {
    CHECK(result->rows() == rows);
    CHECK(result->cols() == cols);
  }
  gradavg_test::require_matches(averaged.gradients[0].first.data(), w_want, towers, false, "dense/w");
  gradavg_test::require_matches(averaged.squares[0].first.data(), w_want, towers, true, "dense/w");
  gradavg_test::require_matches(averaged.gradients[1].first.data(), b_want, towers, false, "dense/b");
  gradavg_test::require_matches(averaged.squares[1].first.data(), b_want, towers, true, "dense/b");
}

TEST_CASE("one data-parallel step moves the model along the whole batch's gradient") {
  const std::size_t towers = GENERATE(1u, 2u, 3u, 4u);
  const Eigen::Index inputs = 5, outputs = 3, batch = 12;
  const Eigen::MatrixXf x = random_matrix(inputs, batch, 1), y = random_matrix(outputs, batch, 2);
  model m{random_matrix(outputs, inputs, 3), random_matrix(outputs, 1, 4), random_matrix(7, 1, 5)};
  const model before = m;
  const float learning_rate = 0.25f;

  // Reference: the gradient of the whole batch, in double, one sample at a time; and a scale
  // bounding the magnitude of every term, for the tolerance of float sums.
  std::vector<double> grad_w(static_cast<std::size_t>(outputs * inputs), 0.0);
  std::vector<double> grad_b(static_cast<std::size_t>(outputs), 0.0);
  double scale = 1.0;
  for (Eigen::Index s = 0; s < batch; ++s)
    for (Eigen::Index o = 0; o < outputs; ++o) {
      double residual = static_cast<double>(before.b(o)) - static_cast<double>(y(o, s));
      double magnitude = std::abs(static_cast<double>(before.b(o))) + std::abs(static_cast<double>(y(o, s)));
      for (Eigen::Index i = 0; i < inputs; ++i) {
        residual += static_cast<double>(before.w(o, i)) * static_cast<double>(x(i, s));
        magnitude += std::abs(static_cast<double>(before.w(o, i)) * static_cast<double>(x(i, s)));
      }
      scale = std::max(scale, magnitude);
      for (Eigen::Index i = 0; i < inputs; ++i)  // column-major, as Eigen stores w
        grad_w[static_cast<std::size_t>(i * outputs + o)] += residual * static_cast<double>(x(i, s)) / batch;
      grad_b[static_cast<std::size_t>(o)] += residual / batch;
    }
  std::vector<double> want_w(grad_w.size()), want_b(grad_b.size());
  for (std::size_t j = 0; j < grad_w.size(); ++j) want_w[j] = before.w.data()[j] - learning_rate * grad_w[j];
  for (std::size_t j = 0; j < grad_b.size(); ++j) want_b[j] = before.b.data()[j] - learning_rate * grad_b[j];

  std::vector<tower_buffers> grads(towers, tower_buffers{Eigen::MatrixXf(outputs, inputs), Eigen::VectorXf(outputs)});
  gradavg::thread_pool pool(2);
  INFO(towers << " towers");
  const gradavg::summary done = train_step(m, grads, x, y, learning_rate, pool);

  CHECK(done.averaged == 2);
  CHECK(done.skipped == 1);
  require_close(grads[0].w, grad_w, scale, "mean gradient of w, in tower 0's buffer");
  require_close(grads[0].b, grad_b, scale, "mean gradient of b, in tower 0's buffer");
  require_close(m.w, want_w, scale, "w after the step");
  require_close(m.b, want_b, scale, "b after the step");
  CHECK(same_bits(m.embedding, before.embedding));
}

TEST_CASE("a gradient None on some towers only skips the step, tower 0's gradients untouched") {
  const std::size_t towers = 3;
  std::vector<tower_buffers> grads;
  for (std::uint32_t k = 0; k < towers; ++k)
    grads.push_back({random_matrix(2, 3, 10 + k), random_matrix(2, 1, 20 + k)});
  const tower_buffers tower0_before = grads[0];
  mean_outputs means{grads[0].w, grads[0].b};

  tower_gradients tower_grads;
  for (std::size_t k = 0; k < towers; ++k)
    tower_grads.push_back({{grads[k].w, "w"}, {k == 2 ? gradient() : gradient(grads[k].b), "b"}});
  std::ostringstream log;
  CHECK_FALSE(average_or_skip(tower_grads, means, log));
  CHECK(gradavg_test::contains(log.str(), "step skipped: variable #1 'b': gradient missing on tower 2 but present on "
                                          "towers 0 and 1 (2 of 3 towers)"));
  CHECK(same_bits(grads[0].w, tower0_before.w));
  CHECK(same_bits(grads[0].b, tower0_before.b));

  // With b present everywhere the step goes through: tower 0 then holds the means.
  tower_grads[2][1].first.emplace(grads[2].b);  // a Ref is rebound by emplace, not assigned
  const gradavg_test::expectation<float> w_want({tower0_before.w.data(), grads[1].w.data(), grads[2].w.data()}, 6);
  const gradavg_test::expectation<float> b_want({tower0_before.b.data(), grads[1].b.data(), grads[2].b.data()}, 2);
  std::ostringstream quiet;
  CHECK(average_or_skip(tower_grads, means, quiet));
  CHECK(quiet.str().empty());
  gradavg_test::require_matches(grads[0].w.data(), w_want, towers, false, "w");
  gradavg_test::require_matches(grads[0].b.data(), b_want, towers, false, "b");
}
