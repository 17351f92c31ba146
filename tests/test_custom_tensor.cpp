// A user's own tensor type plugs in through gradavg::tensor_traits.
#include <gradavg/gradavg.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"

namespace user {

/// A row-major 2-D tensor owned by the user's framework.
struct matrix {
  std::vector<double> values;
  std::int64_t rows = 0, cols = 0;
};

}  // namespace user

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

  const auto r = gradavg::average_gradients<user::matrix>(tg, {.include_square = true});
  REQUIRE(r.gradients.size() == 1);
  CHECK(r.gradients[0].first.rows == 7);
  CHECK(r.gradients[0].first.cols == 9);
  CHECK(gradavg_test::first_mismatch(r.gradients[0].first.values.data(), want.mean, mean_scale, towers) == 63);
  CHECK(gradavg_test::first_mismatch(r.squares[0].first.values.data(), want.square, square_scale, towers) == 63);

  std::vector<user::matrix> means{random_matrix(7, 9, 99)};
  gradavg::average_gradients_into(tg, means);
  CHECK(means[0].values == r.gradients[0].first.values);
}

TEST_CASE("a user tensor's shape is checked: 7x9 against 9x7") {
  const auto a = random_matrix(7, 9, 1), b = random_matrix(9, 7, 2);
  const std::vector<std::vector<std::pair<const user::matrix*, std::string>>> tg{{{&a, "dense"}}, {{&b, "dense"}}};
  try {
    gradavg::average_gradients(tg);
    FAIL("no exception");
  } catch (const gradavg::shape_error& e) {
    CHECK(std::string(e.what()).find("tower 1 has shape [9, 7] row-major but on tower 0 has shape [7, 9] row-major") !=
          std::string::npos);
  }
}
