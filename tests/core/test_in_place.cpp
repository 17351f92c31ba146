// Averaging in place into tower 0's own gradient buffers, for each tensor family.
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <span>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"

namespace {

constexpr std::size_t tower_count = 3;

/// tower_count towers of n random values each, and the reference computed before any write.
template <class S>
struct towers_of {
  std::vector<std::vector<S>> values;
  std::vector<double> mean, scale;

  explicit towers_of(std::size_t n) {
    for (std::size_t k = 0; k < tower_count; ++k)
      values.push_back(gradavg_test::random_values<S>(n, static_cast<std::uint32_t>(31 * k + n)));
    std::vector<const S*> ptrs;
    for (const auto& v : values) ptrs.push_back(v.data());
    mean = gradavg_test::reference<S>(ptrs, n).mean;
    scale = gradavg_test::magnitude<S>(ptrs, n, false);
  }
  bool matches(const S* got) const {
    return gradavg_test::first_mismatch(got, mean, scale, tower_count) == mean.size();
  }
};

}  // namespace

TEMPLATE_TEST_CASE("in place: std::vector through pointers", "", float, double) {
  towers_of<TestType> t(1031);
  std::vector<std::vector<std::pair<std::vector<TestType>*, int>>> tg(tower_count);
  for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({&t.values[k], 0});
  std::vector<std::vector<TestType>*> means{&t.values[0]};
  const auto tower1 = t.values[1];
  gradavg::average_gradients_into(tg, means);
  CHECK(t.matches(t.values[0].data()));
  CHECK(t.values[1] == tower1);  // other towers are read only
}

TEMPLATE_TEST_CASE("in place: std::span", "", float, double) {
  towers_of<TestType> t(77);
  std::vector<std::vector<std::pair<std::span<const TestType>, int>>> tg(tower_count);
  for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({std::span<const TestType>(t.values[k]), 0});
  std::vector<std::span<TestType>> means{std::span<TestType>(t.values[0])};
  gradavg::average_gradients_into(tg, means);
  CHECK(t.matches(t.values[0].data()));
}

TEMPLATE_TEST_CASE("in place: Eigen matrices, and maps on unaligned storage", "", float, double) {
  using matrix = Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic>;
  towers_of<TestType> t(5 * 13);
  SECTION("Matrix through pointers") {
    std::vector<matrix> m;
    for (const auto& v : t.values) m.push_back(Eigen::Map<const matrix>(v.data(), 5, 13));
    std::vector<std::vector<std::pair<const matrix*, int>>> tg(tower_count);
    for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({&m[k], 0});
    std::vector<matrix*> means{&m[0]};
    gradavg::average_gradients_into(tg, means);
    CHECK(t.matches(m[0].data()));
  }
  SECTION("Map at an odd offset") {
    std::vector<std::vector<TestType>> padded;
    for (const auto& v : t.values) {
      padded.push_back(std::vector<TestType>(1, TestType(9)));
      padded.back().insert(padded.back().end(), v.begin(), v.end());
    }
    std::vector<std::vector<std::pair<Eigen::Map<const matrix>, int>>> tg(tower_count);
    for (std::size_t k = 0; k < tower_count; ++k)
      tg[k].push_back({Eigen::Map<const matrix>(padded[k].data() + 1, 5, 13), 0});
    std::vector<Eigen::Map<matrix>> means{Eigen::Map<matrix>(padded[0].data() + 1, 5, 13)};
    gradavg::average_gradients_into(tg, means);
    CHECK(t.matches(padded[0].data() + 1));
    CHECK(padded[0][0] == TestType(9));  // the element before the map is untouched
  }
}

TEMPLATE_TEST_CASE("in place: Eigen::Tensor and TensorMap", "", float, double) {
  using tensor3 = Eigen::Tensor<TestType, 3>;
  towers_of<TestType> t(4 * 5 * 6);
  SECTION("Tensor through pointers") {
    std::vector<tensor3> m;
    for (const auto& v : t.values) m.push_back(Eigen::TensorMap<const tensor3>(v.data(), 4, 5, 6));
    std::vector<std::vector<std::pair<const tensor3*, int>>> tg(tower_count);
    for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({&m[k], 0});
    std::vector<tensor3*> means{&m[0]};
    gradavg::average_gradients_into(tg, means);
    CHECK(t.matches(m[0].data()));
  }
  SECTION("TensorMap over the towers' own storage") {
    std::vector<std::vector<std::pair<Eigen::TensorMap<const tensor3>, int>>> tg(tower_count);
    for (std::size_t k = 0; k < tower_count; ++k)
      tg[k].push_back({Eigen::TensorMap<const tensor3>(t.values[k].data(), 4, 5, 6), 0});
    std::vector<Eigen::TensorMap<tensor3>> means{Eigen::TensorMap<tensor3>(t.values[0].data(), 4, 5, 6)};
    gradavg::average_gradients_into(tg, means);
    CHECK(t.matches(t.values[0].data()));
  }
}

TEST_CASE("in place with squares into separate buffers") {
  towers_of<float> t(300);
  std::vector<const float*> ptrs;
  for (const auto& v : t.values) ptrs.push_back(v.data());
  const auto want_square = gradavg_test::reference<float>(ptrs, 300).square;
  const auto square_scale = gradavg_test::magnitude<float>(ptrs, 300, true);
  std::vector<std::vector<std::pair<std::vector<float>*, int>>> tg(tower_count);
  for (std::size_t k = 0; k < tower_count; ++k) tg[k].push_back({&t.values[k], 0});
  std::vector<float> squares(300);
  std::vector<std::vector<float>*> means{&t.values[0]}, square_out{&squares};
  gradavg::average_gradients_into(tg, means, square_out);
  CHECK(t.matches(t.values[0].data()));
  CHECK(gradavg_test::first_mismatch(squares.data(), want_square, square_scale, tower_count) == 300);
}
