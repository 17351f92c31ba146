// A user's own tensor type plugs in through gradavg::tensor_traits.
#include <gradavg/gradavg.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "counted_tensor.hpp"
#include "reference.hpp"

namespace user {

/// A row-major 2-D tensor owned by the user's framework.
struct matrix {
  std::vector<double> values;
  std::int64_t rows = 0, cols = 0;
};

/// A framework tensor that may be undefined (no value, like a parameter that took no part in
/// the loss): it says so through tensor_traits::present.
struct maybe_tensor {
  std::vector<float> values;
  bool defined = true;
};

}  // namespace user

template <>
struct gradavg::tensor_traits<user::maybe_tensor> {
  using value_type = float;
  static bool present(const user::maybe_tensor& t) noexcept { return t.defined; }
  static const float* data(const user::maybe_tensor& t) noexcept { return t.values.data(); }
  static float* mutable_data(user::maybe_tensor& t) noexcept { return t.values.data(); }
  static gradavg::shape shape(const user::maybe_tensor& t) noexcept { return gradavg::shape::vector(t.values.size()); }
};

template <>
struct gradavg::tensor_traits<user::matrix> {
  using value_type = double;
  using result_type = user::matrix;
  static const double* data(const user::matrix& m) noexcept { return m.values.data(); }
  static double* mutable_data(user::matrix& m) noexcept { return m.values.data(); }
  static gradavg::shape shape(const user::matrix& m) noexcept {
    gradavg::shape s;
    s.rank = 2;
    s.dims = {m.rows, m.cols};
    s.order = gradavg::storage_order::row_major;
    return s;
  }
  static user::matrix make(const gradavg::shape& s) {
    return {std::vector<double>(s.size()), s.dims[0], s.dims[1]};
  }
  /// Messages name a matrix as the framework does.
  static std::string describe(const user::matrix& m) {
    return std::to_string(m.rows) + " rows x " + std::to_string(m.cols) + " columns";
  }
};


namespace {

user::matrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
  return {gradavg_test::random_values<double>(static_cast<std::size_t>(rows * cols), seed), rows, cols};
}

}  // namespace

TEST_CASE("a user tensor type works with both APIs") {
  STATIC_REQUIRE(gradavg::tensor<user::matrix>);
  STATIC_REQUIRE(gradavg::writable_tensor<user::matrix>);
  STATIC_REQUIRE(gradavg::resultable_tensor<user::matrix>);

  const std::size_t towers = 5;
  std::vector<user::matrix> data;
  for (std::size_t k = 0; k < towers; ++k) data.push_back(random_matrix(7, 9, static_cast<std::uint32_t>(k)));
  std::vector<std::vector<std::pair<const user::matrix*, std::string>>> tg(towers);
  std::vector<const double*> ptrs;
  for (std::size_t k = 0; k < towers; ++k) {
    tg[k].push_back({&data[k], "dense"});
    ptrs.push_back(data[k].values.data());
  }
  const gradavg_test::reference<double> want(ptrs, 63);
  const auto mean_scale = gradavg_test::magnitude<double>(ptrs, 63, false);
  const auto square_scale = gradavg_test::magnitude<double>(ptrs, 63, true);

  const auto r = gradavg::average_gradients<user::matrix>(tg, gradavg::include_square);
  REQUIRE(r.gradients.size() == 1);
  CHECK(r.gradients[0].first.rows == 7);
  CHECK(r.gradients[0].first.cols == 9);
  CHECK(gradavg_test::first_mismatch(r.gradients[0].first.values.data(), want.mean, mean_scale, towers) == 63);
  CHECK(gradavg_test::first_mismatch(r.squares[0].first.values.data(), want.square, square_scale, towers) == 63);

  std::vector<user::matrix> means{random_matrix(7, 9, 99)};
  gradavg::average_gradients_into(tg, means);
  CHECK(means[0].values == r.gradients[0].first.values);
}

TEST_CASE("the allocating call reads each gradient's shape once to check it, and tower 0's again to make results") {
  const std::size_t towers = 4, variables = 6;
  std::size_t reads = 0;
  std::vector<std::vector<gradavg_test::counted_vector>> grads(towers);
  std::vector<std::vector<std::pair<const gradavg_test::counted_vector*, std::size_t>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i)
      grads[k].push_back({gradavg_test::random_values<float>(3 + i, static_cast<std::uint32_t>(10 * k + i)), &reads});
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i) tg[k].push_back({&grads[k][i], i});

  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  CHECK(reads == (towers + 1) * variables);
  REQUIRE(r.gradients.size() == variables);
  for (std::size_t i = 0; i < variables; ++i) {
    std::vector<const float*> ptrs;
    for (std::size_t k = 0; k < towers; ++k) ptrs.push_back(grads[k][i].values.data());
    const gradavg_test::reference<float> want(ptrs, 3 + i);
    const auto mean_scale = gradavg_test::magnitude<float>(ptrs, 3 + i, false);
    const auto square_scale = gradavg_test::magnitude<float>(ptrs, 3 + i, true);
    CHECK(r.gradients[i].second == i);
    CHECK(gradavg_test::first_mismatch(r.gradients[i].first.values.data(), want.mean, mean_scale, towers) == 3 + i);
    CHECK(gradavg_test::first_mismatch(r.squares[i].first.values.data(), want.square, square_scale, towers) == 3 + i);
  }
}

TEST_CASE("a user tensor's shape is checked: 7x9 against 9x7, named in the words of its tensor_traits::describe") {
  const auto a = random_matrix(7, 9, 1), b = random_matrix(9, 7, 2);
  const std::vector<std::vector<std::pair<const user::matrix*, std::string>>> tg{{{&a, "dense"}}, {{&b, "dense"}}};
  try {
    gradavg::average_gradients(tg);
    FAIL("no exception");
  } catch (const gradavg::shape_error& e) {
    CHECK(std::string(e.what()) ==
          "variable #0 'dense': gradient on tower 1 has shape 9 rows x 7 columns but on tower 0 has shape 7 rows x 9 "
          "columns");
  }
  // An output of the wrong shape likewise.
  const auto c = random_matrix(7, 9, 3);
  const std::vector<std::vector<std::pair<const user::matrix*, std::string>>> same{{{&a, "dense"}}, {{&c, "dense"}}};
  std::vector<user::matrix> means{random_matrix(9, 7, 4)};
  try {
    gradavg::average_gradients_into(same, means);
    FAIL("no exception");
  } catch (const gradavg::output_error& e) {
    CHECK(std::string(e.what()) ==
          "variable #0 'dense': the means output has shape 9 rows x 7 columns but the gradient has shape 7 rows x 9 "
          "columns");
  }
}

TEST_CASE("a tensor that says it holds no value is an absent gradient and a null output") {
  // Three towers, three variables: defined everywhere, undefined everywhere, undefined on tower 1.
  std::vector<std::vector<user::maybe_tensor>> grads(3);
  for (std::size_t k = 0; k < 3; ++k)
    for (std::size_t i = 0; i < 3; ++i)
      grads[k].push_back({std::vector<float>(5, static_cast<float>(k + 1) * 0.5f), i != 1});
  auto towers = [&] {
    std::vector<std::vector<std::pair<user::maybe_tensor*, int>>> tg(3);
    for (std::size_t k = 0; k < 3; ++k)
      for (std::size_t i = 0; i < 2; ++i) tg[k].push_back({&grads[k][i], static_cast<int>(i)});
    return tg;
  };
  std::vector<user::maybe_tensor> means(2, {std::vector<float>(5, -1.f), true});
  means[1].defined = false;  // the skipped variable's output may be absent too

  const gradavg::summary s = gradavg::average_gradients_into(towers(), means);
  CHECK(s.averaged == 1);
  CHECK(s.skipped == 1);
  for (float x : means[0].values) CHECK(x == (0.5f + 1.0f + 1.5f) / 3);
  CHECK(means[1].values == std::vector<float>(5, -1.f));

  // Undefined on tower 1 only: the seed's error, naming the variable and the tower.
  auto tg = towers();
  for (std::size_t k = 0; k < 3; ++k) tg[k].push_back({&grads[k][2], 2});
  grads[1][2].defined = false;
  means.push_back({std::vector<float>(5, -1.f), true});
  const auto before = means;
  try {
    gradavg::average_gradients_into(tg, means);
    FAIL("no exception");
  } catch (const gradavg::missing_gradient_error& e) {
    CHECK(e.variable_index() == 2);
    CHECK(std::string(e.what()).find("tower 1") != std::string::npos);
  }
  for (std::size_t i = 0; i < means.size(); ++i) CHECK(means[i].values == before[i].values);

  // An undefined output where a mean is due: the library's output error.
  grads[1][2].defined = true;
  means[0].defined = false;
  CHECK_THROWS_AS(gradavg::average_gradients_into(tg, means), gradavg::output_error);
}
