// Towers, entries and gradients yielded by value (views::transform, an entry_traits::gradient()
// returning a view): held while they are read, so results and errors are those of the same data
// held by reference. Owning gradients yielded by value are rejected at compile time
// (lifetime_rejected.cpp checks the message).
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cstddef>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

namespace {

using gradavg_test::contains;
using gradavg_test::message_of;

/// Towers of random gradients, and the reference of each variable.
struct model {
  static constexpr std::size_t towers = 3;
  std::vector<std::size_t> sizes{5, 17, 1, 64};
  std::vector<std::vector<std::vector<float>>> data;  // [tower][variable]
  std::vector<std::string> names{"w1", "b1", "scale", "w2"};
  std::string tower1_name3;  // when set, tower 1 names variable 3 so

  model() {
    data.resize(towers);
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i)
        data[k].push_back(gradavg_test::random_values<float>(sizes[i], static_cast<std::uint32_t>(10 * k + i)));
  }
  gradavg_test::expectation<float> expect(std::size_t i) const {
    std::vector<const float*> ptrs;
    for (std::size_t k = 0; k < towers; ++k) ptrs.push_back(data[k][i].data());
    return {ptrs, sizes[i]};
  }
  /// Tower k as a transform view yielding (span, name) pairs by value.
  auto tower_view(std::size_t k) const {
    return std::views::iota(std::size_t{0}, sizes.size()) | std::views::transform([this, k](std::size_t i) {
             const bool renamed = k == 1 && i == 3 && !tower1_name3.empty();
             return std::pair<std::span<const float>, std::string>(data[k][i], renamed ? tower1_name3 : names[i]);
           });
  }
};

/// An entry whose traits return the gradient as a span by value.
struct stored_entry {
  const std::vector<float>* values;
  const char* name;
};

}  // namespace

template <>
struct gradavg::entry_traits<stored_entry> {
  static std::span<const float> gradient(const stored_entry& e) { return std::span<const float>(*e.values); }
  static const char* variable(const stored_entry& e) { return e.name; }
};

TEST_CASE("towers of views::transform yielding (span, name) pairs by value") {
  const model m;
  std::vector<decltype(m.tower_view(0))> tg;
  for (std::size_t k = 0; k < model::towers; ++k) tg.push_back(m.tower_view(k));
  STATIC_REQUIRE(!std::is_reference_v<std::ranges::range_reference_t<decltype(tg[0])>>);

  std::vector<std::vector<float>> means, squares;
  for (std::size_t s : m.sizes) {
    means.emplace_back(s, -1.0f);
    squares.emplace_back(s, -1.0f);
  }
  const auto summary = gradavg::average_gradients_into(tg, means, squares);
  CHECK(summary.averaged == m.sizes.size());
  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  REQUIRE(r.gradients.size() == m.sizes.size());
  for (std::size_t i = 0; i < m.sizes.size(); ++i) {
    const auto e = m.expect(i);
    gradavg_test::require_matches(means[i].data(), e, model::towers, false, m.names[i]);
    gradavg_test::require_matches(squares[i].data(), e, model::towers, true, m.names[i]);
    gradavg_test::require_matches(r.gradients[i].first.data(), e, model::towers, false, m.names[i]);
    gradavg_test::require_matches(r.squares[i].first.data(), e, model::towers, true, m.names[i]);
    CHECK(r.gradients[i].second == m.names[i]);
  }
}

TEST_CASE("errors through transform views name the right variable and shapes") {
  model m;
  m.data[2][1].resize(16);
  std::vector<decltype(m.tower_view(0))> tg;
  for (std::size_t k = 0; k < model::towers; ++k) tg.push_back(m.tower_view(k));
  std::vector<std::vector<float>> means;
  for (std::size_t s : m.sizes) means.emplace_back(s, -1.0f);
  const auto before = means;
  const auto msg = message_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
  CHECK(contains(msg, "variable #1 'b1': gradient on tower 2 has shape [16] but on tower 0 has shape [17]"));
  CHECK(means == before);

  m.data[2][1].resize(17);
  CHECK(gradavg::average_gradients(tg).gradients.size() == m.sizes.size());
  m.tower1_name3 = "w3";
  const auto mismatch = message_of<gradavg::variable_mismatch_error>([&] { gradavg::average_gradients(tg); });
  CHECK(contains(mismatch,
                 "variable #3 'w2': tower 1 has variable 'w3' at this position but towers 0 and 2 have 'w2'"));
}

TEST_CASE("entry_traits whose gradient() returns a span by value") {
  const model m;
  std::vector<std::vector<stored_entry>> tg(model::towers);
  for (std::size_t k = 0; k < model::towers; ++k)
    for (std::size_t i = 0; i < m.sizes.size(); ++i) tg[k].push_back({&m.data[k][i], m.names[i].c_str()});
  std::vector<std::vector<float>> means;
  for (std::size_t s : m.sizes) means.emplace_back(s, -1.0f);
  gradavg::average_gradients_into(tg, means);
  for (std::size_t i = 0; i < m.sizes.size(); ++i)
    gradavg_test::require_matches(means[i].data(), m.expect(i), model::towers, false, m.names[i]);

  // Outputs checked against those spans: a wrong shape names the gradient's shape.
  means[2].resize(3);
  const auto msg = message_of<gradavg::output_error>([&] { gradavg::average_gradients_into(tg, means); });
  CHECK(contains(msg, "variable #2 'scale': the means output has shape [3] but the gradient has shape [1]"));
}

TEST_CASE("towers yielded by value as spans, entries of Eigen maps and optional maps") {
  const model m;
  using map = Eigen::Map<const Eigen::VectorXf>;
  std::vector<std::vector<std::pair<map, int>>> stored(model::towers);
  for (std::size_t k = 0; k < model::towers; ++k)
    for (std::size_t i = 0; i < m.sizes.size(); ++i)
      stored[k].push_back({map(m.data[k][i].data(), static_cast<Eigen::Index>(m.sizes[i])), static_cast<int>(i)});
  auto tg = std::views::iota(std::size_t{0}, model::towers) |
            std::views::transform([&stored](std::size_t k) { return std::span(stored[k]); });
  // Optional tensor maps yielded by value, the last variable absent everywhere (skipped).
  using tmap = Eigen::TensorMap<Eigen::Tensor<const float, 1>>;
  auto optional_tower = [&m](std::size_t k) {
    return std::views::iota(std::size_t{0}, m.sizes.size()) | std::views::transform([&m, k](std::size_t i) {
             std::optional<tmap> g;
             if (i + 1 < m.sizes.size()) g.emplace(m.data[k][i].data(), static_cast<Eigen::Index>(m.sizes[i]));
             return std::pair(g, static_cast<int>(i));
           });
  };
  std::vector<decltype(optional_tower(0))> optional_tg;
  for (std::size_t k = 0; k < model::towers; ++k) optional_tg.push_back(optional_tower(k));

  std::vector<Eigen::VectorXf> means;
  std::vector<Eigen::Tensor<float, 1>> tensor_means;
  for (std::size_t s : m.sizes) {
    means.push_back(Eigen::VectorXf::Constant(static_cast<Eigen::Index>(s), -1.0f));
    tensor_means.emplace_back(static_cast<Eigen::Index>(s));
    tensor_means.back().setConstant(-1.0f);
  }
  gradavg::average_gradients_into(tg, means);
  const auto summary = gradavg::average_gradients_into(optional_tg, tensor_means);
  CHECK(summary.skipped == 1);
  for (std::size_t i = 0; i < m.sizes.size(); ++i) {
    gradavg_test::require_matches(means[i].data(), m.expect(i), model::towers, false, m.names[i]);
    if (i + 1 < m.sizes.size())
      gradavg_test::require_matches(tensor_means[i].data(), m.expect(i), model::towers, false, m.names[i]);
  }
  CHECK(tensor_means.back()(0) == -1.0f);  // skipped: untouched
}

TEST_CASE("the lifetime rule at compile time: views pass, owning values do not") {
  using gradavg::detail::gradients_outlive_reads;
  auto by_value = [](auto make) {
    return std::vector{std::views::iota(0, 1) | std::views::transform(make)};
  };
  using span_pairs = decltype(by_value([](int) { return std::pair(std::span<const float>(), 0); }));
  using pointer_pairs = decltype(by_value([](int) { return std::pair(static_cast<std::vector<float>*>(nullptr), 0); }));
  using vector_pairs = decltype(by_value([](int) { return std::pair(std::vector<float>(), 0); }));
  using matrix_pairs = decltype(by_value([](int) { return std::pair(Eigen::MatrixXf(), 0); }));
  using const_ref_pairs =
      decltype(by_value([](int) { return std::pair(Eigen::Ref<const Eigen::MatrixXf>(Eigen::MatrixXf()), 0); }));
  using unique_pairs = decltype(by_value([](int) { return std::pair(std::unique_ptr<std::vector<float>>(), 0); }));
  using stored_vectors = std::vector<std::vector<std::pair<std::vector<float>, int>>>;
  STATIC_REQUIRE(gradients_outlive_reads<span_pairs>);
  STATIC_REQUIRE(gradients_outlive_reads<pointer_pairs>);
  STATIC_REQUIRE(gradients_outlive_reads<stored_vectors>);  // held by the caller: no rule
  STATIC_REQUIRE(!gradients_outlive_reads<vector_pairs>);
  STATIC_REQUIRE(!gradients_outlive_reads<matrix_pairs>);
  STATIC_REQUIRE(!gradients_outlive_reads<const_ref_pairs>);
  STATIC_REQUIRE(!gradients_outlive_reads<unique_pairs>);
}
