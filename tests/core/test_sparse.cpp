// Row-sparse gradients (sparse.hpp): every output against the test's own densify-then-average in
// scalar code (bit for bit where the order of the sums is the contract's), and against the dense
// call over the test's densified gradients (bit for bit, fused options included); random index
// sets with repeats, empty sets, every row listed; int32 and int64 indices; float, double, half
// and bfloat16 values; dense and coalesced outputs; the errors, with the outputs untouched.
#include <gradavg/eigen.hpp>
#include <gradavg/gradavg.hpp>
#include <gradavg/sparse.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

namespace {

using namespace gradavg_test;  // support.hpp
using half = Eigen::half;
using bf16 = Eigen::bfloat16;

/// One tower's row-sparse gradient of one variable, owned by the test.
template <class I, class S>
struct tower_rows {
  std::vector<I> indices;
  std::vector<S> values;  // indices.size() rows of `length`
};

/// One variable on every tower: its dense shape [rows, length] and each tower's rows (absent:
/// every tower's optional is empty).
template <class I, class S>
struct sparse_variable {
  std::int64_t rows = 0;
  std::size_t length = 0;
  std::vector<tower_rows<I, S>> towers;
  bool absent = false;
};

/// The test's densify (sparse_types.hpp's contract): zeros; a row's first values row copied,
/// each next one with the same index added in S.
template <class I, class S>
std::vector<S> densify(const tower_rows<I, S>& g, std::int64_t rows, std::size_t length) {
  std::vector<S> dense(static_cast<std::size_t>(rows) * length, S(0));
  std::vector<bool> seen(static_cast<std::size_t>(rows), false);
  for (std::size_t n = 0; n < g.indices.size(); ++n) {
    const auto r = static_cast<std::size_t>(g.indices[n]);
    for (std::size_t j = 0; j < length; ++j) {
      const S v = g.values[n * length + j];
      S& d = dense[r * length + j];
      d = seen[r] ? static_cast<S>(d + v) : v;
    }
    seen[r] = true;
  }
  return dense;
}

/// The value the outputs start with: stray writes and untouched outputs show.
template <class O>
O start_value() {
  return static_cast<O>(-1234.5f);
}

/// The plain mean and mean of squares of the densified towers, in scalar code: summed in tower
/// order in the accumulator, divided by T, rounded once to O.
template <class O, class I, class S>
std::pair<std::vector<O>, std::vector<O>> scalar_reference(const sparse_variable<I, S>& v) {
  using A = accumulator_of<S>;
  const std::size_t n = static_cast<std::size_t>(v.rows) * v.length, towers = v.towers.size();
  std::vector<A> sum(n, A(0)), squares(n, A(0));
  for (std::size_t k = 0; k < towers; ++k) {
    const std::vector<S> d = densify(v.towers[k], v.rows, v.length);
    for (std::size_t j = 0; j < n; ++j) {
      const A x = static_cast<A>(d[j]);
      const A x2 = rounded_square(x);
      sum[j] = k == 0 ? x : sum[j] + x;
      squares[j] = k == 0 ? x2 : squares[j] + x2;
    }
  }
  std::pair<std::vector<O>, std::vector<O>> out;
  for (std::size_t j = 0; j < n; ++j) {
    out.first.push_back(static_cast<O>(sum[j] / static_cast<A>(towers)));
    out.second.push_back(static_cast<O>(squares[j] / static_cast<A>(towers)));
  }
  return out;
}

/// Random rows for T towers: per tower up to `listed` indices drawn from [0, rows) (with repeats
/// when `repeats`), values in [-1, 1] with some exact zeros and negative zeros.
template <class I, class S>
sparse_variable<I, S> random_variable(std::mt19937& gen, std::size_t towers, std::int64_t rows, std::size_t length,
                                      std::size_t listed, bool repeats) {
  sparse_variable<I, S> v;
  v.rows = rows;
  v.length = length;
  std::uniform_real_distribution<float> value(-1, 1);
  std::uniform_int_distribution<std::int64_t> row(0, rows - 1);
  for (std::size_t k = 0; k < towers; ++k) {
    tower_rows<I, S> g;
    if (repeats) {
      for (std::size_t n = 0; n < listed; ++n) g.indices.push_back(static_cast<I>(row(gen)));
    } else {
      std::vector<I> all(static_cast<std::size_t>(rows));
      for (std::size_t r = 0; r < all.size(); ++r) all[r] = static_cast<I>(r);
      std::shuffle(all.begin(), all.end(), gen);
      all.resize(std::min(listed, all.size()));
      g.indices = all;
    }
    for (std::size_t n = 0; n < g.indices.size() * length; ++n) {
      const float x = value(gen);
      g.values.push_back(static_cast<S>(std::abs(x) < 0.02f ? (x < 0 ? -0.0f : 0.0f) : x));
    }
    v.towers.push_back(std::move(g));
  }
  return v;
}

template <class I, class S>
using sparse_tower = std::vector<std::pair<std::optional<gradavg::row_sparse<I, S>>, int>>;

/// The call's towers: views of every variable's rows (variable ids 100, 101, ...).
template <class I, class S>
std::vector<sparse_tower<I, S>> towers_of(const std::vector<sparse_variable<I, S>>& variables, std::size_t towers) {
  std::vector<sparse_tower<I, S>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables.size(); ++i) {
      const auto& v = variables[i];
      std::optional<gradavg::row_sparse<I, S>> g;
      if (!v.absent)
        g = gradavg::rows_of<I, S>(v.towers[k].indices, v.towers[k].values.data(),
                                   gradavg::shape::matrix(v.rows, static_cast<std::int64_t>(v.length)));
      tg[k].emplace_back(g, static_cast<int>(100 + i));
    }
  return tg;
}

/// The dense call over the test's densified gradients: its means and squares per variable.
template <class O, class I, class S>
std::pair<std::vector<std::vector<O>>, std::vector<std::vector<O>>> dense_call(
    const std::vector<sparse_variable<I, S>>& variables, std::size_t towers, const gradavg::options& opts) {
  std::vector<std::vector<std::vector<S>>> dense(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (const auto& v : variables) dense[k].push_back(densify(v.towers[k], v.rows, v.length));
  std::vector<std::vector<std::pair<std::vector<S>*, int>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables.size(); ++i)
      tg[k].emplace_back(variables[i].absent ? nullptr : &dense[k][i], static_cast<int>(100 + i));
  std::pair<std::vector<std::vector<O>>, std::vector<std::vector<O>>> out;
  for (const auto& v : variables) {
    out.first.emplace_back(static_cast<std::size_t>(v.rows) * v.length, start_value<O>());
    out.second.emplace_back(static_cast<std::size_t>(v.rows) * v.length, start_value<O>());
  }
  std::vector<std::vector<O>*> means, squares;
  for (std::size_t i = 0; i < variables.size(); ++i) {
    means.push_back(variables[i].absent ? nullptr : &out.first[i]);
    squares.push_back(variables[i].absent ? nullptr : &out.second[i]);
  }
  gradavg::average_gradients_into(tg, means, squares, opts);
  return out;
}

/// A coalesced output as a dense one: its rows placed, the others `fill`.
template <class I, class O>
std::vector<O> placed(const gradavg::sparse_rows<I, O>& c, O fill) {
  const std::size_t length = c.row_length();
  std::vector<O> dense(static_cast<std::size_t>(c.dense_shape.dims[0]) * length, fill);
  for (std::size_t n = 0; n < c.indices.size(); ++n)
    std::copy_n(c.values.begin() + static_cast<std::ptrdiff_t>(n * length), length,
                dense.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(c.indices[n]) * length));
  return dense;
}

/// The rows some tower lists, ascending.
template <class I, class S>
std::vector<I> listed_rows(const sparse_variable<I, S>& v) {
  std::vector<I> rows;
  for (const auto& g : v.towers) rows.insert(rows.end(), g.indices.begin(), g.indices.end());
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

/// The sweep for one (I, S, O): several variables (repeats, no repeats, an empty set on some
/// towers, every row listed, an absent variable), dense and coalesced outputs, against both
/// references; with options `opts` (plain: also the scalar reference).
template <class I, class S, class O>
void check_sweep(std::size_t towers, const gradavg::options& opts, bool plain) {
  INFO("T = " << towers);
  std::mt19937 gen(static_cast<std::uint32_t>(towers * 7919 + sizeof(I) * 31 + sizeof(S)));
  std::vector<sparse_variable<I, S>> variables;
  variables.push_back(random_variable<I, S>(gen, towers, 40, 7, 12, true));    // repeats
  variables.push_back(random_variable<I, S>(gen, towers, 300, 70, 25, false)); // no repeats
  variables.push_back(random_variable<I, S>(gen, towers, 5, 1, 5, false));     // every row, rows of 1
  auto empty = random_variable<I, S>(gen, towers, 9, 16, 4, true);
  empty.towers[0].indices.clear();
  empty.towers[0].values.clear();
  variables.push_back(empty);                                                  // tower 0 lists none
  auto absent = random_variable<I, S>(gen, towers, 4, 3, 2, true);
  absent.absent = true;
  variables.push_back(absent);
  const auto tg = towers_of(variables, towers);
  const auto reference = dense_call<O>(variables, towers, opts);

  // Dense outputs.
  std::vector<std::vector<O>> means, squares;
  for (const auto& v : variables) {
    means.emplace_back(static_cast<std::size_t>(v.rows) * v.length, start_value<O>());
    squares.emplace_back(static_cast<std::size_t>(v.rows) * v.length, start_value<O>());
  }
  std::vector<std::vector<O>*> mp, sp;
  for (std::size_t i = 0; i < variables.size(); ++i) {
    mp.push_back(variables[i].absent ? nullptr : &means[i]);
    sp.push_back(variables[i].absent ? nullptr : &squares[i]);
  }
  const gradavg::summary s = gradavg::average_gradients_into(tg, mp, sp, opts);
  CHECK(s.averaged == variables.size() - 1);
  CHECK(s.skipped == 1);
  CHECK(s.towers == towers);

  // Coalesced outputs (with a workspace, twice: the second call over grown scratch).
  std::vector<gradavg::sparse_rows<I, O>> cm(variables.size()), cs(variables.size());
  std::vector<gradavg::sparse_rows<I, O>*> cmp, csp;
  for (std::size_t i = 0; i < variables.size(); ++i) {
    cmp.push_back(variables[i].absent ? nullptr : &cm[i]);
    csp.push_back(variables[i].absent ? nullptr : &cs[i]);
  }
  gradavg::sparse_workspace w;
  gradavg::average_gradients_into(w, tg, cmp, csp, opts);
  gradavg::average_gradients_into(w, tg, cmp, csp, opts);

  for (std::size_t i = 0; i < variables.size(); ++i) {
    INFO("variable " << i);
    const auto& v = variables[i];
    const std::size_t n = static_cast<std::size_t>(v.rows) * v.length;
    if (v.absent) {
      CHECK(means[i] == std::vector<O>(n, start_value<O>()));
      continue;
    }
    CHECK(same_bits(means[i].data(), reference.first[i].data(), n));
    CHECK(same_bits(squares[i].data(), reference.second[i].data(), n));
    if (plain) {
      const auto scalar = scalar_reference<O>(v);
      CHECK(same_bits(means[i].data(), scalar.first.data(), n));
      CHECK(same_bits(squares[i].data(), scalar.second.data(), n));
    }
    // The coalesced rows: the listed ones, ascending, with the dense output's values.
    CHECK(cm[i].indices == listed_rows(v));
    CHECK(cs[i].indices == listed_rows(v));
    CHECK(cm[i].dense_shape == gradavg::shape::matrix(v.rows, static_cast<std::int64_t>(v.length)));
    const auto dense_means = placed(cm[i], O(0)), dense_squares = placed(cs[i], O(0));
    for (std::size_t j = 0; j < n; ++j) {
      const bool listed = std::binary_search(cm[i].indices.begin(), cm[i].indices.end(),
                                             static_cast<I>(j / v.length));
      if (!listed) continue;
      CHECK(same_bits(&dense_means[j], &means[i][j], 1));
      CHECK(same_bits(&dense_squares[j], &squares[i][j], 1));
    }
  }
}

}  // namespace

TEST_CASE("row-sparse: the seed's mean of a small case, worked by hand", "[sparse]") {
  // Tower 0 lists row 3 twice (they add) and row 1; tower 1 lists rows 0 and 3.
  const std::vector<std::int64_t> i0{3, 1, 3}, i1{0, 3};
  const std::vector<float> v0{1, 2, 3, 4, 5, 6}, v1{10, 20, 30, 40};
  const gradavg::shape dense = gradavg::shape::matrix(5, 2);
  using G = gradavg::row_sparse<std::int64_t, float>;
  std::vector<std::vector<std::pair<G, std::string>>> tg{{{gradavg::rows_of<std::int64_t, float>(i0, v0.data(), dense), "emb"}},
                                                          {{gradavg::rows_of<std::int64_t, float>(i1, v1.data(), dense), "emb"}}};
  std::vector<float> mean(10, -1), square(10, -1);
  std::vector<std::vector<float>*> m{&mean}, s{&square};
  const auto report = gradavg::average_gradients_into(tg, m, s);
  CHECK(report.averaged == 1);
  // Densified: tower 0 row 1 = (3, 4), row 3 = (1 + 5, 2 + 6); tower 1 row 0 = (10, 20), row 3 = (30, 40).
  CHECK(mean == std::vector<float>{5, 10, 1.5f, 2, 0, 0, 18, 24, 0, 0});
  CHECK(square == std::vector<float>{50, 200, 4.5f, 8, 0, 0, (36 + 900) / 2.0f, (64 + 1600) / 2.0f, 0, 0});

  const auto result = gradavg::average_gradients(tg, gradavg::include_square);
  REQUIRE(result.gradients.size() == 1);
  CHECK(result.gradients[0].second == "emb");
  CHECK(result.gradients[0].first.indices == std::vector<std::int64_t>{0, 1, 3});
  CHECK(result.gradients[0].first.values == std::vector<float>{5, 10, 1.5f, 2, 18, 24});
  CHECK(result.squares[0].first.values == std::vector<float>{50, 200, 4.5f, 8, 468, 832});
  CHECK(result.squares[0].first.dense_shape == dense);
}

TEST_CASE("row-sparse: property sweep against densify-then-average, every type", "[sparse]") {
  const gradavg::options plain;
  for (std::size_t towers : {1, 2, 3, 5, 17}) {
    check_sweep<std::int32_t, float, float>(towers, plain, true);
    check_sweep<std::int64_t, float, float>(towers, plain, true);
    check_sweep<std::int64_t, double, double>(towers, plain, true);
    check_sweep<std::int32_t, half, half>(towers, plain, true);
    check_sweep<std::int64_t, half, float>(towers, plain, true);
    check_sweep<std::int32_t, bf16, bf16>(towers, plain, true);
    check_sweep<std::int64_t, bf16, float>(towers, plain, true);
  }
}

TEST_CASE("row-sparse: fused options bit for bit as the dense call over densified gradients", "[sparse]") {
  for (std::size_t towers : {2, 3, 17}) {
    std::vector<double> weights;
    for (std::size_t k = 0; k < towers; ++k) weights.push_back(0.5 + static_cast<double>(k % 3));
    gradavg::options weighted;
    weighted.compute.weights = weights;
    weighted.compute.scale = 1.0 / 1024;
    check_sweep<std::int64_t, float, float>(towers, weighted, false);
    check_sweep<std::int32_t, half, float>(towers, weighted, false);

    gradavg::options negative;  // the rows no tower lists are -0, as the dense call's
    negative.compute.scale = -2;
    check_sweep<std::int64_t, float, float>(towers, negative, false);
    check_sweep<std::int64_t, double, double>(towers, negative, false);

    gradavg::options in_double;
    in_double.compute.accumulate = gradavg::accumulation::double_precision;
    in_double.run.threads = 3;
    check_sweep<std::int64_t, float, float>(towers, in_double, false);
  }
}

TEST_CASE("row-sparse: statistics and non-finite detection per variable", "[sparse]") {
  std::mt19937 gen(7);
  std::vector<sparse_variable<std::int64_t, float>> variables;
  variables.push_back(random_variable<std::int64_t, float>(gen, 3, 50, 8, 20, true));
  variables.push_back(random_variable<std::int64_t, float>(gen, 3, 30, 5, 10, false));
  variables[1].towers[2].values[3] = std::numeric_limits<float>::infinity();
  const auto tg = towers_of(variables, 3);

  for (auto policy : {gradavg::nonfinite_policy::report, gradavg::nonfinite_policy::zero}) {
    std::vector<gradavg::variable_statistics> sparse_stats(2), dense_stats(2);
    gradavg::options opts;
    opts.compute.statistics = true;
    opts.compute.on_nonfinite = policy;
    opts.compute.per_variable = dense_stats;
    const auto reference = dense_call<float>(variables, 3, opts);
    opts.compute.per_variable = sparse_stats;
    std::vector<std::vector<float>> means{std::vector<float>(400), std::vector<float>(150)};
    std::vector<std::vector<float>> squares = means;
    const auto s = gradavg::average_gradients_into(tg, means, squares, opts);
    CHECK(s.nonfinite_variables == 1);
    CHECK_FALSE(sparse_stats[0].nonfinite);
    CHECK(sparse_stats[1].nonfinite);
    CHECK(same_bits(means[1].data(), reference.first[1].data(), 150));
    CHECK(same_bits(means[0].data(), reference.first[0].data(), 400));
    if (policy == gradavg::nonfinite_policy::zero) {
      CHECK(means[1] == std::vector<float>(150, 0.0f));
      CHECK(sparse_stats[1].sum_mean_squared == 0);
    }
    // The same sums in another order: equal within rounding.
    CHECK(sparse_stats[0].sum_mean_squared == Approx(dense_stats[0].sum_mean_squared).epsilon(1e-12));
    CHECK(sparse_stats[0].sum_mean_of_squares == Approx(dense_stats[0].sum_mean_of_squares).epsilon(1e-12));
    double expected = 0;  // the test's own: sum of mean^2 over every element of variable 0
    for (float x : means[0]) expected += static_cast<double>(x) * x;
    CHECK(sparse_stats[0].sum_mean_squared == Approx(expected).epsilon(1e-9));
  }
}

TEST_CASE("row-sparse: an Eigen vector of indices and a matrix of rows", "[sparse]") {
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> i0(2), i1(1);
  i0 << 4, 0;
  i1 << 4;
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> v0(2, 3), v1(1, 3);
  v0 << 1, 2, 3, 4, 5, 6;
  v1 << 7, 8, 9;
  using G = gradavg::row_sparse<std::int32_t, float>;
  std::vector<std::vector<std::pair<G, int>>> tg{{{gradavg::rows_of(i0, v0, 6), 1}}, {{gradavg::rows_of(i1, v1, 6), 1}}};
  Eigen::Matrix<float, 6, 3, Eigen::RowMajor> mean;
  mean.setConstant(-1);
  std::vector<Eigen::Matrix<float, 6, 3, Eigen::RowMajor>*> m{&mean};
  gradavg::average_gradients_into(tg, m);
  Eigen::Matrix<float, 6, 3, Eigen::RowMajor> expected = Eigen::Matrix<float, 6, 3, Eigen::RowMajor>::Zero();
  expected.row(0) << 2, 2.5f, 3;
  expected.row(4) << 4, 5, 6;
  CHECK(mean == expected);

  // Column-major values: their rows are not packed.
  Eigen::MatrixXf columns(2, 3);
  columns << 1, 2, 3, 4, 5, 6;
  tg[1][0].first = gradavg::rows_of(i0, columns, 6);
  const std::string what = message_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, m); });
  CHECK(contains(what, "variable #0 '1': gradient on tower 1"));
  CHECK(contains(what, "col-major"));
}

TEST_CASE("row-sparse: every error names the variable and towers, outputs untouched", "[sparse]") {
  using G = gradavg::row_sparse<std::int64_t, float>;
  const gradavg::shape dense = gradavg::shape::matrix(4, 2);
  std::vector<std::int64_t> a{0, 3}, b{2};
  std::vector<float> va{1, 2, 3, 4}, vb{5, 6};
  auto tower = [&](const std::vector<std::int64_t>& i, const std::vector<float>& v, gradavg::shape d) {
    return std::vector<std::pair<G, std::string>>{{gradavg::rows_of<std::int64_t, float>(i, v.data(), d), "emb"}};
  };
  std::vector<float> out(8, -7);
  std::vector<std::vector<float>*> m{&out};
  const std::vector<float> untouched = out;
  auto call = [&](const auto& tg) { gradavg::average_gradients_into(tg, m); };

  SECTION("an index past the rows") {
    std::vector<std::int64_t> bad{1, 4};
    std::vector<float> vbad{1, 2, 3, 4};
    const auto tg = std::vector{tower(a, va, dense), tower(bad, vbad, dense)};
    const auto e = exception_of<gradavg::index_error>([&] { call(tg); });
    CHECK(contains(e.what(), "variable #0 'emb': gradient on tower 1: index 1 is 4, outside the 4 rows"));
    CHECK(e.variable_index() == 0);
  }
  SECTION("a negative index") {
    std::vector<std::int64_t> bad{-1};
    const auto tg = std::vector{tower(bad, vb, dense), tower(b, vb, dense)};
    CHECK(contains(message_of<gradavg::index_error>([&] { call(tg); }), "tower 0: index 0 is -1"));
  }
  SECTION("values rows of another length than the dense shape's") {
    std::vector<float> three{1, 2, 3};
    G g = gradavg::rows_of<std::int64_t, float>(b, three.data(), dense);
    g.values_shape = gradavg::shape::matrix(1, 3);
    std::vector<std::vector<std::pair<G, std::string>>> tg{tower(a, va, dense), {{g, "emb"}}};
    const std::string what = message_of<gradavg::shape_error>([&] { call(tg); });
    CHECK(contains(what, "gradient on tower 1 holds 1 indices and values of shape [1, 3] row-major"));
    CHECK(contains(what, "must be [1, 2] row-major"));
  }
  SECTION("towers that disagree on the dense shape") {
    const auto tg = std::vector{tower(a, va, dense), tower(b, vb, gradavg::shape::matrix(5, 2))};
    CHECK(contains(message_of<gradavg::shape_error>([&] { call(tg); }),
                   "gradient on tower 1 has dense shape [5, 2] row-major but on tower 0 has [4, 2] row-major"));
  }
  SECTION("absent on some towers only") {
    using slot = std::pair<std::optional<G>, std::string>;
    std::vector<std::vector<slot>> tg{{{gradavg::rows_of<std::int64_t, float>(a, va.data(), dense), "emb"}},
                                      {{std::nullopt, "emb"}}};
    CHECK(contains(message_of<gradavg::missing_gradient_error>([&] { call(tg); }),
                   "gradient missing on tower 1 but present on tower 0"));
  }
  SECTION("towers that list another variable") {
    auto t1 = tower(b, vb, dense);
    t1[0].second = "pos";
    const auto tg = std::vector{tower(a, va, dense), t1};
    CHECK_THROWS_AS(call(tg), gradavg::variable_mismatch_error);
  }
  SECTION("a dense output of another shape") {
    const auto tg = std::vector{tower(a, va, dense), tower(b, vb, dense)};
    std::vector<float> small(6, -7);
    std::vector<std::vector<float>*> ms{&small};
    CHECK(contains(message_of<gradavg::output_error>([&] { gradavg::average_gradients_into(tg, ms); }),
                   "its means output has shape [6] but the gradients' dense shape is [4, 2] row-major"));
    CHECK(small == std::vector<float>(6, -7));
  }
  SECTION("an output over a gradient's values") {
    std::vector<float> shared(8, 1);
    const auto tg = std::vector{tower(a, shared, dense), tower(b, vb, dense)};
    std::vector<std::vector<float>*> ms{&shared};
    const std::string what = message_of<gradavg::aliasing_error>([&] { gradavg::average_gradients_into(tg, ms); });
    CHECK(contains(what, "'s means output overlaps variable #0 'emb''s gradient on tower 0 (its values)"));
    CHECK(shared == std::vector<float>(8, 1));
  }
  SECTION("one coalesced output for two variables") {
    auto t0 = tower(a, va, dense), t1 = tower(b, vb, dense);
    t0.push_back(t0[0]);
    t1.push_back(t1[0]);
    const auto tg = std::vector{t0, t1};
    gradavg::sparse_rows<std::int64_t, float> c;
    std::vector<gradavg::sparse_rows<std::int64_t, float>*> cs{&c, &c};
    CHECK_THROWS_AS(gradavg::average_gradients_into(tg, cs), gradavg::aliasing_error);
    CHECK(c.indices.empty());
  }
  SECTION("a range of elements") {
    const auto tg = std::vector{tower(a, va, dense), tower(b, vb, dense)};
    gradavg::options opts;
    opts.compute.range = {0, 4};
    CHECK_THROWS_AS(gradavg::average_gradients_into(tg, m, opts), gradavg::option_error);
  }
  CHECK(out == untouched);
}

TEST_CASE("row-sparse: many rows, few listed (ordered by sorting), and repeats on every tower", "[sparse]") {
  // 10^7 dense rows and 40 listed: past the counting order's bound.
  using G = gradavg::row_sparse<std::int64_t, double>;
  const std::int64_t rows = 10'000'000;
  std::mt19937 gen(3);
  std::uniform_int_distribution<std::int64_t> row(0, 50);  // repeats between and within towers
  std::vector<std::vector<std::int64_t>> indices(3);
  std::vector<std::vector<double>> values(3);
  std::vector<std::vector<std::pair<G, int>>> tg(3);
  for (std::size_t k = 0; k < 3; ++k) {
    for (int n = 0; n < 40; ++n) {
      indices[k].push_back(row(gen) * 1000 + 999'000 * static_cast<std::int64_t>(k));
      values[k].push_back(static_cast<double>(n) + 0.25 * static_cast<double>(k));
    }
  }
  for (std::size_t k = 0; k < 3; ++k)
    tg[k].emplace_back(gradavg::rows_of<std::int64_t, double>(indices[k], values[k].data(), gradavg::shape::vector(rows)), 0);
  const auto result = gradavg::average_gradients(tg);
  REQUIRE(result.gradients.size() == 1);
  const auto& c = result.gradients[0].first;
  // The test's own: a map from row to the sum of its values over every tower, in tower order.
  std::vector<std::pair<std::int64_t, double>> expected;
  for (std::size_t k = 0; k < 3; ++k)
    for (std::size_t n = 0; n < 40; ++n) expected.emplace_back(indices[k][n], 0);
  std::sort(expected.begin(), expected.end());
  expected.erase(std::unique(expected.begin(), expected.end()), expected.end());
  for (auto& [r, sum] : expected) {
    double total = 0;
    for (std::size_t k = 0; k < 3; ++k) {
      double tower_sum = 0;
      bool seen = false;
      for (std::size_t n = 0; n < 40; ++n)
        if (indices[k][n] == r) tower_sum = seen ? tower_sum + values[k][n] : values[k][n], seen = true;
      total += tower_sum;
    }
    sum = total / 3;
  }
  REQUIRE(c.indices.size() == expected.size());
  for (std::size_t n = 0; n < expected.size(); ++n) {
    CHECK(c.indices[n] == expected[n].first);
    CHECK(c.values[n] == expected[n].second);
  }
}
