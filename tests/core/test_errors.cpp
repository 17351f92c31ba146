// Every error: its type, what its message names, and that nothing the caller owns changed.
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

namespace {

using gradavg_test::contains;
using gradavg_test::message_of;

struct printable_var {
  std::string name;
  friend std::ostream& operator<<(std::ostream& os, const printable_var& v) { return os << v.name; }
};


using grads = std::vector<float>;
using entry = std::pair<grads*, std::string>;
using tower = std::vector<entry>;

/// Three towers, three variables; outputs pre-filled with a sentinel.
struct fixture {
  std::vector<std::vector<grads>> data;  // [tower][variable]
  std::vector<tower> tg;
  std::vector<grads> means, squares;

  explicit fixture(std::size_t towers = 3) {
    const std::vector<std::size_t> sizes{5, 3, 8};
    const char* names[] = {"w1", "b1", "w2"};
    data.resize(towers);
    tg.resize(towers);
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i) data[k].push_back(grads(sizes[i], float(k + 1)));
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i) tg[k].push_back({&data[k][i], names[i]});
    for (std::size_t s : sizes) {
      means.push_back(grads(s, -42.0f));
      squares.push_back(grads(s, -43.0f));
    }
  }
  /// Runs both APIs, each must throw E with the same message; returns it.
  template <class E>
  std::string both_throw(const gradavg::options& opts = {}) {
    const auto inputs = data;
    const auto means_before = means, squares_before = squares;
    const std::string allocating =
        message_of<E>([&] { (void)gradavg::average_gradients(tg, gradavg::include_square, opts); });
    const std::string msg = message_of<E>([&] { gradavg::average_gradients_into(tg, means, squares, opts); });
    CHECK(allocating == msg);
    CHECK(means == means_before);
    CHECK(squares == squares_before);
    CHECK(data == inputs);
    return msg;
  }
};

}  // namespace

TEST_CASE("every exception derives from gradavg::error and std::invalid_argument") {
  STATIC_REQUIRE(std::is_base_of_v<gradavg::error, gradavg::tower_error>);
  STATIC_REQUIRE(std::is_base_of_v<gradavg::error, gradavg::shape_error>);
  STATIC_REQUIRE(std::is_base_of_v<gradavg::error, gradavg::missing_gradient_error>);
  STATIC_REQUIRE(std::is_base_of_v<gradavg::error, gradavg::variable_mismatch_error>);
  STATIC_REQUIRE(std::is_base_of_v<gradavg::error, gradavg::output_error>);
  STATIC_REQUIRE(std::is_base_of_v<gradavg::error, gradavg::aliasing_error>);
  STATIC_REQUIRE(std::is_base_of_v<std::invalid_argument, gradavg::error>);
}

TEST_CASE("zero towers") {
  const std::vector<tower> tg;
  std::vector<grads> means;
  CHECK_THROWS_AS(gradavg::average_gradients(tg), gradavg::tower_error);
  const auto msg = message_of<gradavg::tower_error>([&] { gradavg::average_gradients_into(tg, means); });
  CHECK(contains(msg, "no towers"));
}

TEST_CASE("towers of different lengths") {
  fixture f;
  f.tg[2].pop_back();
  const auto msg = f.both_throw<gradavg::tower_error>();
  CHECK(contains(msg, "tower 2 holds 2"));
  CHECK(contains(msg, "tower 0 holds 3"));
}

TEST_CASE("gradient shapes that differ between towers") {
  fixture f;
  f.data[1][2].resize(7);
  const auto msg = f.both_throw<gradavg::shape_error>();
  CHECK(contains(msg, "variable #2 'w2'"));
  CHECK(contains(msg, "tower 1 has shape [7]"));
  CHECK(contains(msg, "tower 0 has shape [8]"));
}

TEST_CASE("same size, different shape") {
  Eigen::MatrixXf a = Eigen::MatrixXf::Ones(2, 3), b = Eigen::MatrixXf::Ones(3, 2);
  const std::vector<std::vector<std::pair<const Eigen::MatrixXf*, std::string>>> tg{{{&a, "kernel"}},
                                                                                    {{&b, "kernel"}}};
  Eigen::MatrixXf out = Eigen::MatrixXf::Constant(2, 3, -1.0f);
  const Eigen::MatrixXf before = out;
  std::vector<Eigen::MatrixXf*> means{&out};
  const auto msg = message_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
  CHECK(contains(msg, "variable #0 'kernel'"));
  CHECK(contains(msg, "[3, 2] col-major"));
  CHECK(contains(msg, "[2, 3] col-major"));
  CHECK(out == before);
}

TEST_CASE("a gradient missing on some towers only") {
  fixture f(5);
  f.tg[1][1].first = nullptr;
  f.tg[3][1].first = nullptr;
  const auto msg = f.both_throw<gradavg::missing_gradient_error>();
  CHECK(contains(msg, "variable #1 'b1'"));
  CHECK(contains(msg, "missing on towers 1 and 3 but present on towers 0, 2 and 4 (3 of 5 towers)"));
  CHECK(gradavg_test::exception_of<gradavg::error>([&] { gradavg::average_gradients(f.tg); }).variable_index() == 1);
}

TEST_CASE("several defects: both APIs report the first variable's, gradients before options") {
  fixture f(4);
  f.data[2][2].resize(7);        // variable 2: a shape on tower 2
  f.tg[0][1].first = nullptr;    // variable 1: missing on tower 0 only
  f.tg[0][0].second = "other";   // variable 0: tower 0's variable differs from the others'
  const std::vector<double> weights{1, 2};
  const gradavg::options two_weights{.compute = {.weights = weights}};
  CHECK(contains(f.both_throw<gradavg::variable_mismatch_error>(two_weights), "variable #0"));
  f.tg[0][0].second = "w1";
  const auto missing = f.both_throw<gradavg::missing_gradient_error>(two_weights);
  CHECK(contains(missing, "variable #1 'b1'"));
  CHECK(contains(missing, "missing on tower 0"));
  f.tg[0][1].first = &f.data[0][1];
  CHECK(contains(f.both_throw<gradavg::shape_error>(two_weights), "variable #2 'w2'"));
  f.data[2][2].resize(8);
  CHECK(contains(f.both_throw<gradavg::weight_error>(two_weights), "holds 2 weights but there are 4 towers"));
}

TEST_CASE("many towers missing a gradient are listed in short") {
  fixture f(40);
  for (std::size_t k = 1; k < 40; k += 2) f.tg[k][0].first = nullptr;
  const auto msg = f.both_throw<gradavg::missing_gradient_error>();
  CHECK(contains(msg, "towers 1, 3, 5"));
  CHECK(contains(msg, "(20 in all)"));
}

TEST_CASE("a variable that differs between towers") {
  fixture f;
  f.tg[2][1].second = "b1_typo";
  const auto msg = f.both_throw<gradavg::variable_mismatch_error>();
  CHECK(contains(msg, "variable #1 'b1'"));
  CHECK(contains(msg, "tower 2 has variable 'b1_typo' at this position but towers 0 and 1 have 'b1';"));
}

TEST_CASE("a variable that differs on tower 0 only names tower 0, and what each side has") {
  fixture f(4);
  f.tg[0][1].second = "b1_typo";
  const auto msg = f.both_throw<gradavg::variable_mismatch_error>();
  CHECK(contains(msg, "variable #1 'b1': tower 0 has variable 'b1_typo' at this position but towers 1, 2 and 3 "
                      "have 'b1';"));
  // Two against two: the side of the lowest tower is taken as the one to match.
  f.tg[1][1].second = "b1_typo";
  CHECK(contains(f.both_throw<gradavg::variable_mismatch_error>(),
                 "towers 2 and 3 have variable 'b1' at this position but towers 0 and 1 have 'b1_typo'"));
}

TEST_CASE("an error on the last variable leaves earlier outputs untouched") {
  fixture f;
  f.data[2][2].resize(1);  // variable #2 is bad; #0 and #1 are fine
  const auto msg = f.both_throw<gradavg::shape_error>();
  CHECK(contains(msg, "variable #2"));
}

TEST_CASE("wrong number of outputs") {
  fixture f;
  f.means.pop_back();
  const auto before = f.means;
  const auto msg = message_of<gradavg::output_error>([&] { gradavg::average_gradients_into(f.tg, f.means); });
  CHECK(f.means == before);
  CHECK(contains(msg, "means holds 2 outputs"));
  CHECK(contains(msg, "3 variables"));
}

TEST_CASE("an output of the wrong shape") {
  fixture f;
  f.squares[1].resize(4);
  const auto means_before = f.means;
  const auto msg = message_of<gradavg::output_error>([&] { gradavg::average_gradients_into(f.tg, f.means, f.squares); });
  CHECK(contains(msg, "variable #1 'b1'"));
  CHECK(contains(msg, "squares output has shape [4]"));
  CHECK(contains(msg, "gradient has shape [3]"));
  CHECK(f.means == means_before);
}

TEST_CASE("a null output for a variable that is averaged") {
  fixture f;
  std::vector<grads*> means{&f.means[0], nullptr, &f.means[2]};
  const auto before = f.means;
  const auto msg = message_of<gradavg::output_error>([&] { gradavg::average_gradients_into(f.tg, means); });
  CHECK(contains(msg, "variable #1 'b1': the means output is null"));
  CHECK(f.means == before);
}

TEST_CASE("aliasing other than in place into tower 0 is rejected") {
  fixture f;
  const auto inputs = f.data;
  std::vector<grads*> means{&f.means[0], &f.means[1], &f.means[2]};
  std::vector<grads*> squares{&f.squares[0], &f.squares[1], &f.squares[2]};
  const auto means_before = f.means, squares_before = f.squares;

  SECTION("means into tower 1's gradient") {
    means[1] = &f.data[1][1];
    const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(f.tg, means, squares); });
    CHECK(contains(msg, "variable #1 'b1': the means output overlaps its gradient on tower 1"));
  }
  SECTION("squares into tower 0's gradient") {
    squares[0] = &f.data[0][0];
    const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(f.tg, means, squares); });
    CHECK(contains(msg, "the squares output overlaps its gradient on tower 0"));
  }
  SECTION("means and squares the same buffer") {
    squares[2] = means[2];
    const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(f.tg, means, squares); });
    CHECK(contains(msg, "variable #2 'w2'"));
    CHECK(contains(msg, "means output"));
  }
  SECTION("means of two variables overlapping: found with alias_check::all") {
    std::vector<float> shared(8, -1.0f);
    std::vector<std::span<float>> out{std::span<float>(shared.data(), 5), std::span<float>(shared.data() + 4, 3),
                                      std::span<float>(f.means[2])};
    const auto shared_before = shared;
    const auto msg = message_of<gradavg::aliasing_error>(
        [&] { gradavg::average_gradients_into(f.tg, out, {.check = {.aliasing = gradavg::alias_check::all}}); });
    CHECK(contains(msg, "variable #0 'w1': the means output overlaps the means output of variable #1 'b1'"));
    CHECK(shared == shared_before);
  }
  CHECK(f.means == means_before);
  CHECK(f.squares == squares_before);
  CHECK(f.data == inputs);
}

TEST_CASE("a means output shifted against tower 0's gradient is not in place") {
  std::vector<float> storage(6, 0.5f), other(5, 1.5f);
  using span_tower = std::vector<std::pair<std::span<const float>, std::string>>;
  const std::vector<span_tower> tg{{{std::span<const float>(storage.data(), 5), "v"}},
                                   {{std::span<const float>(other), "v"}}};
  std::vector<std::span<float>> shifted{std::span<float>(storage.data() + 1, 5)};
  const auto before = storage;
  const auto msg = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(tg, shifted); });
  CHECK(contains(msg, "variable #0 'v': the means output overlaps its gradient on tower 0"));
  CHECK(storage == before);

  // The exact buffer is in place, and allowed.
  std::vector<std::span<float>> in_place{std::span<float>(storage.data(), 5)};
  gradavg::average_gradients_into(tg, in_place);
  CHECK(storage == std::vector<float>{1, 1, 1, 1, 1, 0.5f});
}

TEST_CASE("an output overlapping another variable's gradient: found with alias_check::all") {
  std::vector<float> joint(13, 1.0f), a1(5, 3.0f), b0(8, 1.0f), b1(8, 2.0f), mean_a(5, -1.0f);
  using span_tower = std::vector<std::pair<std::span<const float>, std::string>>;
  const std::vector<span_tower> tg{{{std::span<const float>(joint.data(), 5), "a"}, {std::span<const float>(b0), "b"}},
                                   {{std::span<const float>(a1), "a"}, {std::span<const float>(b1), "b"}}};
  // b's mean written over joint[2, 10): overlaps a's tower-0 gradient joint[0, 5).
  std::vector<std::span<float>> outs{std::span<float>(mean_a), std::span<float>(joint.data() + 2, 8)};
  const auto joint_before = joint;
  const auto mean_a_before = mean_a;
  const auto msg = message_of<gradavg::aliasing_error>(
      [&] { gradavg::average_gradients_into(tg, outs, {.check = {.aliasing = gradavg::alias_check::all}}); });
  CHECK(contains(msg, "variable #1 'b': the means output overlaps the gradient on tower 0 of variable #0 'a'"));
  CHECK(joint == joint_before);
  CHECK(mean_a == mean_a_before);

  // Moved clear of a's gradient, the same call succeeds under the exhaustive check.
  outs[1] = std::span<float>(joint.data() + 5, 8);
  gradavg::average_gradients_into(tg, outs, {.check = {.aliasing = gradavg::alias_check::all}});
  CHECK(mean_a == std::vector<float>(5, 2.0f));
  CHECK(std::vector<float>(joint.begin() + 5, joint.end()) == std::vector<float>(8, 1.5f));
}

TEST_CASE("variables without operator<< are named by position") {
  struct opaque {
    int id;
    bool operator==(const opaque&) const = default;
  };
  std::vector<float> a{1}, b{1, 2};
  const std::vector<std::vector<std::pair<std::vector<float>*, opaque>>> tg{{{&a, {7}}}, {{&b, {7}}}};
  const auto msg = message_of<gradavg::shape_error>([&] { gradavg::average_gradients(tg); });
  CHECK(contains(msg, "variable #0:"));
}

TEST_CASE("pointer variables print the object they point to") {
  printable_var v{"dense/kernel"}, other{"dense/bias"};
  std::vector<float> a{1}, b{1};
  const std::vector<std::vector<std::pair<std::vector<float>*, printable_var*>>> tg{{{&a, &v}}, {{&b, &other}}};
  const auto msg = message_of<gradavg::variable_mismatch_error>([&] { gradavg::average_gradients(tg); });
  CHECK(contains(msg, "variable #0 'dense/kernel': tower 1 has variable 'dense/bias'"));
}
