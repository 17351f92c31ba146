// Special values, as docs/errors.md's "Bad input" table states them: infinities propagate, a sum
// past the largest finite value overflows to infinity (floats sum floats, in tower order, then
// divide), squares overflow past sqrt(max), and denormals are kept (no flush to zero, in the
// default floating-point environment). NaN results are covered by test_kernel.
#include <gradavg/gradavg.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <utility>
#include <vector>

#include "catch.hpp"

namespace {

/// Two towers of n values, 1 everywhere but at the positions given (packet heads, middles and
/// the tail), where tower k holds special[p].first / .second.
template <class S>
struct special_towers {
  static constexpr std::size_t n = 67;
  std::vector<std::size_t> at{0, 5, 16, 33, 64, 66};
  std::vector<S> g0 = std::vector<S>(n, S(1)), g1 = std::vector<S>(n, S(1));

  explicit special_towers(const std::vector<std::pair<S, S>>& special) {
    REQUIRE(special.size() == at.size());
    for (std::size_t p = 0; p < at.size(); ++p) {
      g0[at[p]] = special[p].first;
      g1[at[p]] = special[p].second;
    }
  }
  /// Means and squares from both APIs; they must agree bitwise.
  std::pair<std::vector<S>, std::vector<S>> average() const {
    const std::vector<std::vector<std::pair<const std::vector<S>*, int>>> tg{{{&g0, 0}}, {{&g1, 0}}};
    std::vector<std::vector<S>> means{std::vector<S>(n)}, squares{std::vector<S>(n)};
    gradavg::average_gradients_into(tg, means, squares);
    const auto r = gradavg::average_gradients(tg, gradavg::include_square);
    REQUIRE(r.gradients.size() == 1);
    for (std::size_t j = 0; j < n; ++j) {
      // Compared as values except NaN, which must be NaN in both.
      const bool same_mean = (std::isnan(means[0][j]) && std::isnan(r.gradients[0].first[j])) ||
                             means[0][j] == r.gradients[0].first[j];
      const bool same_square = (std::isnan(squares[0][j]) && std::isnan(r.squares[0].first[j])) ||
                               squares[0][j] == r.squares[0].first[j];
      CHECK(same_mean);
      CHECK(same_square);
    }
    // Elements away from the special positions are plain ones.
    for (std::size_t j = 0; j < n; ++j)
      if (std::find(at.begin(), at.end(), j) == at.end()) CHECK((means[0][j] == S(1) && squares[0][j] == S(1)));
    return {means[0], squares[0]};
  }
};

}  // namespace

TEMPLATE_TEST_CASE("infinities propagate: +inf and -inf give infinite means, squares +inf", "", float, double) {
  using S = TestType;
  const S inf = std::numeric_limits<S>::infinity();
  const special_towers<S> t({{inf, S(1)}, {S(2), -inf}, {-inf, -inf}, {inf, inf}, {-inf, S(0)}, {S(3), inf}});
  const auto [mean, square] = t.average();
  const std::vector<S> want_mean{inf, -inf, -inf, inf, -inf, inf};
  for (std::size_t p = 0; p < t.at.size(); ++p) {
    INFO("position " << t.at[p]);
    CHECK(mean[t.at[p]] == want_mean[p]);
    CHECK(square[t.at[p]] == inf);
  }
}

TEMPLATE_TEST_CASE("a sum past the largest finite value overflows to infinity before the division", "", float, double) {
  using S = TestType;
  const S max = std::numeric_limits<S>::max();
  const S inf = std::numeric_limits<S>::infinity();
  const S big = std::sqrt(max) * S(2);  // its square overflows, its sum with itself does not
  const special_towers<S> t({{max, max}, {-max, -max}, {max, -max}, {max / 2, max / 2}, {big, big}, {-big, S(0)}});
  const auto [mean, square] = t.average();
  // max + max is inf in the element type although the true mean, max, fits.
  CHECK(mean[t.at[0]] == inf);
  CHECK(mean[t.at[1]] == -inf);
  CHECK(mean[t.at[2]] == S(0));
  CHECK(mean[t.at[3]] == max / 2);  // max/2 + max/2 = max: no overflow
  CHECK(mean[t.at[4]] == big);
  CHECK(mean[t.at[5]] == -big / 2);
  for (std::size_t p = 0; p < t.at.size(); ++p) CHECK(square[t.at[p]] == inf);
}

TEMPLATE_TEST_CASE("denormals are kept, not flushed to zero", "", float, double) {
  using S = TestType;
  const S d = std::numeric_limits<S>::denorm_min();
  const S small = std::numeric_limits<S>::min();  // smallest normal
  REQUIRE(d > S(0));
  const special_towers<S> t(
      {{4 * d, 2 * d}, {d, d}, {-6 * d, 2 * d}, {small / 4, small / 4}, {small, -small / 2}, {d, S(0)}});
  const auto [mean, square] = t.average();
  CHECK(mean[t.at[0]] == 3 * d);
  CHECK(mean[t.at[1]] == d);
  CHECK(mean[t.at[2]] == -2 * d);
  CHECK(mean[t.at[3]] == small / 4);
  CHECK(mean[t.at[4]] == small / 4);
  // (d + 0) / 2 is half the smallest denormal: rounds to even, which is 0.
  CHECK(mean[t.at[5]] == S(0));
  // Squares of denormals underflow to zero: a rounding, not a flush.
  CHECK(square[t.at[0]] == S(0));
}
