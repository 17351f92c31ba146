// The seed's semantics (TensorFlow's _average_gradients), case by case.
#include <gradavg/gradavg.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"

namespace {

using grads = std::vector<float>;
using entry = std::pair<const grads*, std::string>;
using tower = std::vector<entry>;

}  // namespace

TEST_CASE("mean over towers, paired with the variable, in variable order") {
  // Values chosen so every mean is exact in float: the expected values are worked by hand.
  const grads a0{1, 2, 3}, a1{3, 4, 5}, a2{5, 0, -2};
  const grads b0{0.5f}, b1{1.5f}, b2{-5};
  const std::vector<tower> tg{{{&a0, "a"}, {&b0, "b"}}, {{&a1, "a"}, {&b1, "b"}}, {{&a2, "a"}, {&b2, "b"}}};

  const auto r = gradavg::average_gradients(tg);
  REQUIRE(r.gradients.size() == 2);
  CHECK(r.gradients[0].second == "a");
  CHECK(r.gradients[0].first == grads{3, 2, 2});
  CHECK(r.gradients[1].second == "b");
  CHECK(r.gradients[1].first == grads{-1});
  CHECK(r.squares.empty());
  CHECK(r.skipped.empty());
}

TEST_CASE("mean of squares is the mean over towers of g*g, not the square of the mean") {
  const grads a0{1, -2, 3}, a1{3, 2, -1};
  const std::vector<tower> tg{{{&a0, "a"}}, {{&a1, "a"}}};

  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  REQUIRE(r.gradients.size() == 1);
  REQUIRE(r.squares.size() == 1);
  CHECK(r.gradients[0].first == grads{2, 0, 1});
  CHECK(r.squares[0].first == grads{5, 4, 5});  // (1+9)/2, (4+4)/2, (9+1)/2
  CHECK(r.squares[0].second == "a");

  // Without the tag: means only; {} is the options, whatever overloads exist.
  const auto plain = gradavg::average_gradients(tg, {});
  CHECK(plain.gradients[0].first == grads{2, 0, 1});
  CHECK(plain.squares.empty());
  const auto grouped = gradavg::average_gradients(tg, gradavg::include_square, {.run = {.threads = 1}});
  CHECK(grouped.squares[0].first == grads{5, 4, 5});
}

TEST_CASE("a gradient absent on every tower skips the variable and reports it") {
  const grads a0{1, 2}, a1{3, 4}, c0{7}, c1{9};
  const std::vector<tower> tg{{{&a0, "a"}, {nullptr, "frozen"}, {&c0, "c"}},
                              {{&a1, "a"}, {nullptr, "frozen"}, {&c1, "c"}}};

  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  REQUIRE(r.gradients.size() == 2);
  CHECK(r.gradients[0].second == "a");
  CHECK(r.gradients[0].first == grads{2, 3});
  CHECK(r.gradients[1].second == "c");
  CHECK(r.gradients[1].first == grads{8});
  REQUIRE(r.squares.size() == 2);
  CHECK(r.squares[0].second == "a");
  CHECK(r.squares[0].first == grads{5, 10});  // (1+9)/2, (4+16)/2
  CHECK(r.squares[1].second == "c");
  CHECK(r.squares[1].first == grads{65});  // (49+81)/2
  REQUIRE(r.skipped.size() == 1);
  CHECK(r.skipped[0].index == 1);
  CHECK(r.skipped[0].variable == "frozen");
}

TEST_CASE("a gradient absent on some towers only is an error") {
  const grads a0{1}, a2{3};
  const std::vector<tower> tg{{{&a0, "a"}}, {{nullptr, "a"}}, {{&a2, "a"}}};
  CHECK_THROWS_AS(gradavg::average_gradients(tg), gradavg::missing_gradient_error);
}

TEST_CASE("one tower: the mean is the gradient and the square its square") {
  const auto g = gradavg_test::random_values<float>(37, 7);
  const std::vector<tower> tg{{{&g, "w"}}};
  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  REQUIRE(r.gradients.size() == 1);
  CHECK(r.gradients[0].first == g);
  for (std::size_t j = 0; j < g.size(); ++j) CHECK(r.squares[0].first[j] == g[j] * g[j]);
}

TEST_CASE("variables: results carry tower 0's variable") {
  // The seed returns grad_and_vars[0][1]; with variables that compare equal across towers but
  // are distinct objects, the result must be tower 0's.
  struct var {
    int id;
    std::string tower_name;
    bool operator==(const var& o) const { return id == o.id; }
  };
  const grads g0{2}, g1{4};
  const std::vector<std::vector<std::pair<const grads*, var>>> tg{{{&g0, var{1, "from tower 0"}}},
                                                                  {{&g1, var{1, "from tower 1"}}}};
  const auto r = gradavg::average_gradients(tg);
  REQUIRE(r.gradients.size() == 1);
  CHECK(r.gradients[0].second.tower_name == "from tower 0");
  CHECK(r.gradients[0].first == grads{3});
}

TEST_CASE("no variables gives an empty result") {
  const std::vector<tower> tg(3);
  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  CHECK(r.gradients.empty());
  CHECK(r.squares.empty());
  CHECK(r.skipped.empty());
}

TEST_CASE("random towers against the double reference, for both APIs") {
  const std::size_t tower_count = GENERATE(1, 2, 3, 8, 33);
  const std::size_t n = GENERATE(0, 1, 7, 17, 1000, 4099);
  std::vector<grads> data;
  for (std::size_t k = 0; k < tower_count; ++k)
    data.push_back(gradavg_test::random_values<float>(n, static_cast<std::uint32_t>(100 * k + n)));
  std::vector<tower> tg;
  std::vector<const float*> ptrs;
  for (const auto& d : data) {
    tg.push_back({{&d, "w"}});
    ptrs.push_back(d.data());
  }
  const gradavg_test::reference<float> want(ptrs, n);
  const auto mean_scale = gradavg_test::magnitude<float>(ptrs, n, false);
  const auto square_scale = gradavg_test::magnitude<float>(ptrs, n, true);

  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  CHECK(gradavg_test::first_mismatch(r.gradients[0].first.data(), want.mean, mean_scale, tower_count) == n);
  CHECK(gradavg_test::first_mismatch(r.squares[0].first.data(), want.square, square_scale, tower_count) == n);

  std::vector<grads> means{grads(n)}, squares{grads(n)};
  const auto s = gradavg::average_gradients_into(tg, means, squares);
  CHECK(s.averaged == 1);
  CHECK(s.skipped == 0);
  // Both APIs run the same kernel: bitwise equal.
  CHECK(means[0] == r.gradients[0].first);
  CHECK(squares[0] == r.squares[0].first);
}

TEST_CASE("towers given as spans of spans") {
  const grads a0{1, 2}, a1{3, 6};
  const std::vector<entry> t0{{&a0, "a"}}, t1{{&a1, "a"}};
  const std::vector<std::span<const entry>> towers{t0, t1};
  const std::span<const std::span<const entry>> tg(towers);
  const auto r = gradavg::average_gradients(tg);
  REQUIRE(r.gradients.size() == 1);
  CHECK(r.gradients[0].first == grads{2, 4});
}

TEST_CASE("means and squares follow their variable past skipped variables, in both APIs") {
  // Variables 0 and 2 are absent everywhere; the others differ in size and values, so a square
  // paired with the wrong variable or written to the wrong output shows.
  constexpr std::size_t towers = 3, variables = 5;
  const std::vector<std::size_t> sizes{2, 3, 4, 5, 6};
  std::vector<std::vector<grads>> data(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i)
      data[k].push_back(gradavg_test::random_values<float>(sizes[i], static_cast<std::uint32_t>(7 * k + i)));
  const std::vector<std::string> names{"frozen0", "a", "frozen2", "b", "c"};
  std::vector<tower> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i) tg[k].push_back({i == 0 || i == 2 ? nullptr : &data[k][i], names[i]});
  auto expected = [&](std::size_t i) {
    std::vector<const float*> ptrs;
    for (std::size_t k = 0; k < towers; ++k) ptrs.push_back(data[k][i].data());
    return gradavg_test::reference<float>(ptrs, sizes[i]);
  };
  auto near = [](const grads& got, const std::vector<double>& want) {
    if (got.size() != want.size()) return false;
    for (std::size_t j = 0; j < got.size(); ++j)
      if (std::abs(static_cast<double>(got[j]) - want[j]) > 1e-6) return false;
    return true;
  };

  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  REQUIRE(r.gradients.size() == 3);
  REQUIRE(r.squares.size() == 3);
  REQUIRE(r.skipped.size() == 2);
  CHECK(r.skipped[0].index == 0);
  CHECK(r.skipped[1].index == 2);
  const std::size_t averaged[] = {1, 3, 4};
  for (std::size_t n = 0; n < 3; ++n) {
    const std::size_t i = averaged[n];
    INFO("variable " << i);
    CHECK(r.gradients[n].second == names[i]);
    CHECK(r.squares[n].second == names[i]);
    CHECK(near(r.gradients[n].first, expected(i).mean));
    CHECK(near(r.squares[n].first, expected(i).square));
  }

  std::vector<grads> means, squares;
  for (std::size_t s : sizes) {
    means.emplace_back(s, -1.0f);
    squares.emplace_back(s, -1.0f);
  }
  const auto s = gradavg::average_gradients_into(tg, means, squares);
  CHECK(s.averaged == 3);
  CHECK(s.skipped == 2);
  for (std::size_t i = 0; i < variables; ++i) {
    INFO("variable " << i);
    if (i == 0 || i == 2) {
      CHECK(means[i] == grads(sizes[i], -1.0f));
      CHECK(squares[i] == grads(sizes[i], -1.0f));
    } else {
      CHECK(near(means[i], expected(i).mean));
      CHECK(near(squares[i], expected(i).square));
    }
  }
}
