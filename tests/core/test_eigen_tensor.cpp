// Eigen's Tensor module as gradients and outputs: Eigen::Tensor<float/double, R> for R = 1..4 in
// both layouts, TensorMap<Tensor<...>> and TensorMap<const Tensor<...>> at misaligned starts.
// Values are checked against the independent double-precision reference of reference.hpp over a
// representative sweep of element counts and tower counts, through both average_gradients and
// average_gradients_into; then shape rules (dimensions, rank, layout) and result types.
//
// Tolerance (gradavg_test::tolerance / first_mismatch in reference.hpp): element j of a mean over
// T towers may differ from the double reference by at most
//     2 * (T + 1) * epsilon(S) * (mean over towers of |g_k[j]|)   + denorm_min(S)
// and element j of a mean of squares by the same factor times (mean over towers of g_k[j]^2):
// T + 1 roundings of at most half an ulp each (the T-term sum and the division), with a factor 2
// of slack that also covers the rounding of the products in the squares.
//
// Eigen::Tensor is heavy to compile: every tensor type here is only constructed, resized, mapped
// and indexed (no tensor expressions), and each configuration instantiates two gradient kinds.
// gradavg's headers come first (built without the precompiled header): they declare Tensor and
// TensorMap, which the module then declares again with its default arguments.
#include <gradavg/average.hpp>
#include <gradavg/eigen_tensor.hpp>

#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"

namespace {

using gradavg_test::buffer;
using gradavg_test::contains;
using gradavg_test::sentinel;
using gradavg_test::expectation;
using gradavg_test::message_of;
using gradavg_test::random_slice;
using gradavg_test::require_matches;

using Eigen::Index;

template <class S, int R, int Layout>
struct config {
  using scalar = S;
  static constexpr int rank = R;
  static constexpr int layout = Layout;
  using tensor = Eigen::Tensor<S, R, Layout>;
};

template <int R>
using dims = std::array<Index, R>;

template <std::size_t R>
std::size_t count(const std::array<Index, R>& d) {
  std::size_t n = 1;
  for (const Index x : d) n *= static_cast<std::size_t>(x);
  return n;
}

/// Representative shapes for each rank: element counts 0, 1, 7, 16, 17, 63, 1000 and 4099,
/// factorised over the dimensions where the count allows, with the non-trivial dimension moving.
template <int R>
std::vector<dims<R>> sweep_shapes() {
  if constexpr (R == 1)
    return {{0}, {1}, {7}, {16}, {17}, {63}, {1000}, {4099}};
  else if constexpr (R == 2)
    return {{0, 3}, {1, 1}, {1, 7}, {4, 4}, {17, 1}, {7, 9}, {25, 40}, {1, 4099}};
  else if constexpr (R == 3)
    return {{2, 0, 3}, {1, 1, 1}, {7, 1, 1}, {2, 2, 4}, {1, 17, 1}, {3, 3, 7}, {10, 10, 10}, {1, 4099, 1}};
  else
    return {{2, 3, 0, 1}, {1, 1, 1, 1}, {1, 1, 1, 7}, {2, 2, 2, 2},
            {1, 17, 1, 1}, {3, 1, 3, 7}, {2, 5, 10, 10}, {1, 1, 4099, 1}};
}

constexpr std::size_t tower_counts[] = {1, 2, 3, 8, 33};
constexpr std::size_t offsets = 4;  // maps start 0..3 elements past a 64-byte boundary

/// T towers of variables with the given rank-R shapes, filled with random values in [-1, 1].
/// Tower k's variable i starts (offset + k + 2i) % 4 elements past a 64-byte boundary.
template <class S, int R>
struct problem {
  std::vector<dims<R>> shapes;
  std::size_t towers;
  std::vector<std::vector<buffer<S>>> grads;  // [tower][variable]
  std::vector<std::string> names;
  std::vector<expectation<S>> expected;

  problem(std::vector<dims<R>> shapes_, std::size_t towers_, std::size_t offset, std::uint32_t seed)
      : shapes(std::move(shapes_)), towers(towers_) {
    grads.resize(towers);
    for (std::size_t k = 0; k < towers; ++k) {
      grads[k].reserve(shapes.size());
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        const std::size_t n = size(i);
        grads[k].emplace_back(n, (offset + k + 2 * i) % offsets, S(0));
        const S* values = random_slice<S>(n, seed + static_cast<std::uint32_t>(k * 104729u + i * 15485863u));
        std::copy(values, values + n, grads[k][i].data());
      }
    }
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      names.push_back("block" + std::to_string(i) + "/kernel");
      std::vector<const S*> data;
      for (std::size_t k = 0; k < towers; ++k) data.push_back(grads[k][i].data());
      expected.emplace_back(data, size(i));
    }
  }

  [[nodiscard]] std::size_t variables() const { return shapes.size(); }
  [[nodiscard]] std::size_t size(std::size_t i) const { return count(shapes[i]); }
  [[nodiscard]] S* data(std::size_t k, std::size_t i) { return grads[k][i].data(); }
  void require_matches(std::size_t i, const S* got, bool squares, const std::string& what) const {
    ::require_matches(got, expected[i], towers, squares, what + " (" + names[i] + ")");
  }
};

/// Whether t has dimensions d.
template <class T, std::size_t R>
bool has_dims(const T& t, const std::array<Index, R>& d) {
  for (std::size_t r = 0; r < R; ++r)
    if (t.dimension(r) != d[r]) return false;
  return true;
}

template <class S, class MakeSlot>
auto make_tower_grads(std::size_t towers, std::size_t variables, const std::vector<std::string>& names,
                      MakeSlot make_slot) {
  using Slot = decltype(make_slot(std::size_t{}, std::size_t{}));
  std::vector<std::vector<std::pair<Slot, std::string>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k) {
    tg[k].reserve(variables);
    for (std::size_t i = 0; i < variables; ++i) tg[k].emplace_back(make_slot(k, i), names[i]);
  }
  return tg;
}

/// Checks what average_gradients returned when every variable of p is averaged.
template <class Result, class S, int R>
void check_allocated(const problem<S, R>& p, const gradavg::averaged_gradients<Result, std::string>& result,
                     const std::string& what) {
  const std::size_t V = p.variables();
  REQUIRE(result.gradients.size() == V);
  REQUIRE(result.squares.size() == V);
  REQUIRE(result.skipped.empty());
  for (std::size_t i = 0; i < V; ++i) {
    REQUIRE(result.gradients[i].second == p.names[i]);
    REQUIRE(result.squares[i].second == p.names[i]);
    REQUIRE(has_dims(result.gradients[i].first, p.shapes[i]));
    REQUIRE(has_dims(result.squares[i].first, p.shapes[i]));
    p.require_matches(i, result.gradients[i].first.data(), false, what);
    p.require_matches(i, result.squares[i].first.data(), true, what);
  }
}

/// Runs average_gradients (with squares) and average_gradients_into (TensorMap outputs at
/// misaligned starts, with squares) on tower_grads[k][i] = (make_slot(k, i), name i); checks the
/// result type (Eigen::Tensor of the same scalar, rank and layout), pairing, dimensions, values
/// against the reference, and that nothing around the outputs was written.
template <class Config, class MakeSlot>
void check_both_apis(problem<typename Config::scalar, Config::rank>& p, MakeSlot make_slot, std::size_t out_offset,
                     const std::string& what) {
  using S = typename Config::scalar;
  using Tensor = typename Config::tensor;
  const auto tg = make_tower_grads<S>(p.towers, p.variables(), p.names, make_slot);

  const auto result = gradavg::average_gradients(tg, gradavg::include_square);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(result.gradients[0].first)>, Tensor>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(result.squares[0].first)>, Tensor>);
  check_allocated(p, result, what + ", average_gradients");

  std::vector<buffer<S>> mean_bufs, square_bufs;
  std::vector<Eigen::TensorMap<Tensor>> means, squares;
  mean_bufs.reserve(p.variables());
  square_bufs.reserve(p.variables());
  for (std::size_t i = 0; i < p.variables(); ++i) {
    mean_bufs.emplace_back(p.size(i), (out_offset + i) % offsets, sentinel<S>);
    square_bufs.emplace_back(p.size(i), (out_offset + i + 1) % offsets, sentinel<S>);
    means.emplace_back(mean_bufs[i].data(), p.shapes[i]);
    squares.emplace_back(square_bufs[i].data(), p.shapes[i]);
  }
  const gradavg::summary s = gradavg::average_gradients_into(tg, means, squares);
  REQUIRE(s.averaged == p.variables());
  REQUIRE(s.skipped == 0);
  for (std::size_t i = 0; i < p.variables(); ++i) {
    p.require_matches(i, mean_bufs[i].data(), false, what + ", average_gradients_into");
    p.require_matches(i, square_bufs[i].data(), true, what + ", average_gradients_into");
    REQUIRE(mean_bufs[i].surroundings_intact());
    REQUIRE(square_bufs[i].surroundings_intact());
  }
}

template <std::size_t R>
std::array<Index, R> rotated(const std::array<Index, R>& d) {
  std::array<Index, R> out;
  for (std::size_t r = 0; r < R; ++r) out[r] = d[(r + 1) % R];
  return out;
}

template <int R>
dims<R> small_shape() {
  dims<R> d;
  d.fill(2);
  d[0] = 3;
  return d;
}

using f1c = config<float, 1, Eigen::ColMajor>;
using f2c = config<float, 2, Eigen::ColMajor>;
using f3c = config<float, 3, Eigen::ColMajor>;
using f4c = config<float, 4, Eigen::ColMajor>;
using f1r = config<float, 1, Eigen::RowMajor>;
using f2r = config<float, 2, Eigen::RowMajor>;
using f3r = config<float, 3, Eigen::RowMajor>;
using f4r = config<float, 4, Eigen::RowMajor>;
using d1c = config<double, 1, Eigen::ColMajor>;
using d2c = config<double, 2, Eigen::ColMajor>;
using d3c = config<double, 3, Eigen::ColMajor>;
using d4c = config<double, 4, Eigen::ColMajor>;
using d1r = config<double, 1, Eigen::RowMajor>;
using d2r = config<double, 2, Eigen::RowMajor>;
using d3r = config<double, 3, Eigen::RowMajor>;
using d4r = config<double, 4, Eigen::RowMajor>;

}  // namespace

// ---- Property sweep against the reference. ----------------------------------------------------

TEMPLATE_TEST_CASE("Eigen::Tensor and TensorMap of every rank 1..4 and layout match the reference over sizes, towers, "
                   "misaligned starts",
                   "[eigen][tensor][sweep]", f1c, f2c, f3c, f4c, f1r, f2r, f3r, f4r, d1c, d2c, d3c, d4c, d1r, d2r, d3r,
                   d4r) {
  using C = TestType;
  using S = typename C::scalar;
  using Tensor = typename C::tensor;
  constexpr int R = C::rank;
  const std::vector<dims<R>> shapes = sweep_shapes<R>();
  for (std::size_t si = 0; si < shapes.size(); ++si) {
    for (std::size_t ti = 0; ti < std::size(tower_counts); ++ti) {
      const std::size_t T = tower_counts[ti];
      // The starting offset turns with the shape and tower count; within a call, towers and
      // variables start at (off + k + 2i) % 4 anyway.
      const std::size_t off = (si + ti) % offsets;
      CAPTURE(si, count(shapes[si]), T, off);
      // Three variables of different shapes: the swept one, its dimensions rotated, a small one.
      problem<S, R> p({shapes[si], rotated(shapes[si]), small_shape<R>()}, T, off,
                      static_cast<std::uint32_t>(si * 7919 + T * 131 + sizeof(S) * 17 + R * 3 + C::layout));

      check_both_apis<C>(
          p,
          [&](std::size_t k, std::size_t i) { return Eigen::TensorMap<const Tensor>(p.data(k, i), p.shapes[i]); },
          off, "TensorMap<const Tensor>");

      // One more gradient kind per configuration (alternating, to bound compile time).
      if constexpr (std::is_same_v<S, float>) {
        std::vector<std::vector<Tensor>> owned(T);
        for (std::size_t k = 0; k < T; ++k)
          for (std::size_t i = 0; i < p.variables(); ++i) {
            owned[k].emplace_back(p.shapes[i]);
            std::copy(p.data(k, i), p.data(k, i) + p.size(i), owned[k][i].data());
          }
        check_both_apis<C>(
            p, [&](std::size_t k, std::size_t i) { return static_cast<const Tensor*>(&owned[k][i]); }, off + 1,
            "const Tensor*");
      } else {
        check_both_apis<C>(
            p, [&](std::size_t k, std::size_t i) { return Eigen::TensorMap<Tensor>(p.data(k, i), p.shapes[i]); },
            off + 1, "TensorMap<Tensor>");
      }
    }
  }
}

// ---- Layout: coefficient (i, j, k) means the same in either layout. -----------------------------

TEST_CASE("Eigen::Tensor: ColMajor and RowMajor gradients with the same coefficients give the same coefficients",
          "[eigen][tensor][layout]") {
  using S = double;
  const std::size_t T = 5;
  const dims<3> d{3, 4, 5};
  const std::size_t n = count(d);
  std::vector<Eigen::Tensor<S, 3, Eigen::ColMajor>> col;
  std::vector<Eigen::Tensor<S, 3, Eigen::RowMajor>> row;
  for (std::size_t k = 0; k < T; ++k) {
    const S* values = random_slice<S>(n, static_cast<std::uint32_t>(900 + k));
    col.emplace_back(d);
    row.emplace_back(d);
    std::size_t next = 0;
    for (Index a = 0; a < d[0]; ++a)
      for (Index b = 0; b < d[1]; ++b)
        for (Index c = 0; c < d[2]; ++c) {
          col[k](a, b, c) = values[next];
          row[k](a, b, c) = values[next];
          ++next;
        }
  }
  std::vector<std::vector<std::pair<const Eigen::Tensor<S, 3, Eigen::ColMajor>*, std::string>>> tg_col(T);
  std::vector<std::vector<std::pair<const Eigen::Tensor<S, 3, Eigen::RowMajor>*, std::string>>> tg_row(T);
  for (std::size_t k = 0; k < T; ++k) {
    tg_col[k].emplace_back(&col[k], "w");
    tg_row[k].emplace_back(&row[k], "w");
  }
  const auto rc = gradavg::average_gradients(tg_col, gradavg::include_square);
  const auto rr = gradavg::average_gradients(tg_row, gradavg::include_square);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(rc.gradients[0].first)>, Eigen::Tensor<S, 3, Eigen::ColMajor>>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(rr.gradients[0].first)>, Eigen::Tensor<S, 3, Eigen::RowMajor>>);
  const double tol = gradavg_test::tolerance<S>(T);
  for (Index a = 0; a < d[0]; ++a)
    for (Index b = 0; b < d[1]; ++b)
      for (Index c = 0; c < d[2]; ++c) {
        double want = 0, want_sq = 0, scale = 0;
        for (std::size_t k = 0; k < T; ++k) {
          const double x = col[k](a, b, c);
          want += x;
          want_sq += x * x;
          scale += std::abs(x);
        }
        want /= T;
        want_sq /= T;
        scale /= T;
        CAPTURE(a, b, c);
        REQUIRE(std::abs(rc.gradients[0].first(a, b, c) - want) <= tol * scale);
        REQUIRE(std::abs(rr.gradients[0].first(a, b, c) - want) <= tol * scale);
        REQUIRE(std::abs(rc.squares[0].first(a, b, c) - want_sq) <= tol * want_sq);
        REQUIRE(std::abs(rr.squares[0].first(a, b, c) - want_sq) <= tol * want_sq);
      }
}

// ---- Shapes: dimensions, rank and layout; nothing written after an error. ------------------------

TEST_CASE("Eigen::Tensor: dimensions that differ between towers are a shape_error, outputs untouched",
          "[eigen][tensor][shape]") {
  using S = float;
  using Map3 = Eigen::TensorMap<const Eigen::Tensor<S, 3>>;
  const std::size_t T = 3;
  // Variable 0 agrees everywhere; variable 1 has other dimensions on tower 2.
  for (const dims<3> other : {dims<3>{4, 3, 2}, dims<3>{2, 4, 3}, dims<3>{2, 3, 5}, dims<3>{2, 3, 1}}) {
    CAPTURE(other[0], other[1], other[2]);
    const dims<3> d{2, 3, 4};
    problem<S, 3> p({d, {2, 3, 5}}, T, 1, 77);
    const auto tg = make_tower_grads<S>(T, 2, p.names, [&](std::size_t k, std::size_t i) {
      if (i == 1 && k == 2) return Map3(p.data(k, i), other);
      return Map3(p.data(k, i), d);  // variable 1's buffer holds 30 elements; 24 are mapped
    });
    REQUIRE(contains(message_of<gradavg::shape_error>([&] { (void)gradavg::average_gradients(tg); }), "tower 2"));

    buffer<S> m0(24, 1, sentinel<S>), m1(24, 2, sentinel<S>), s0(24, 3, sentinel<S>), s1(24, 0, sentinel<S>);
    const auto before = std::vector{m0.snapshot(), m1.snapshot(), s0.snapshot(), s1.snapshot()};
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 3>>> means{{m0.data(), d}, {m1.data(), d}};
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 3>>> squares{{s0.data(), d}, {s1.data(), d}};
    try {
      (void)gradavg::average_gradients_into(tg, means, squares);
      FAIL("mismatched dimensions were accepted");
    } catch (const gradavg::shape_error& e) {
      REQUIRE(e.variable_index() == 1);
    }
    REQUIRE(m0.same_as(before[0]));
    REQUIRE(m1.same_as(before[1]));
    REQUIRE(s0.same_as(before[2]));
    REQUIRE(s1.same_as(before[3]));
  }
}

TEST_CASE("Eigen::Tensor: outputs of other dimensions or another layout are an output_error, untouched",
          "[eigen][tensor][shape]") {
  using S = float;
  const std::size_t T = 2;
  problem<S, 2> p({{6, 4}}, T, 0, 78);
  const auto tg = make_tower_grads<S>(T, 1, p.names, [&](std::size_t k, std::size_t) {
    return Eigen::TensorMap<const Eigen::Tensor<S, 2>>(p.data(k, 0), p.shapes[0]);
  });
  buffer<S> out(24, 3, sentinel<S>);
  const auto before = out.snapshot();

  SECTION("rank 3 with a trailing 1 but the other layout") {
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 3, Eigen::RowMajor>>> rank3{{out.data(), dims<3>{6, 4, 1}}};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, rank3), gradavg::output_error);
    Eigen::Tensor<S, 2> good(6, 4);
    std::vector<Eigen::Tensor<S, 2>*> good_means{&good};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, good_means, rank3), gradavg::output_error);
  }
  SECTION("other dimensions") {
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 2>>> transposed{{out.data(), dims<2>{4, 6}}};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, transposed), gradavg::output_error);
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 2>>> smaller{{out.data(), dims<2>{6, 3}}};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, smaller), gradavg::output_error);
  }
  SECTION("RowMajor output for a ColMajor 6x4 gradient") {
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 2, Eigen::RowMajor>>> row{{out.data(), dims<2>{6, 4}}};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, row), gradavg::output_error);
  }
  REQUIRE(out.same_as(before));
}

TEST_CASE("Eigen::Tensor: outputs of another rank holding the elements in the same order are accepted",
          "[eigen][tensor][shape]") {
  using S = float;
  const std::size_t T = 2;
  problem<S, 2> p({{6, 4}}, T, 0, 78);
  const auto tg = make_tower_grads<S>(T, 1, p.names, [&](std::size_t k, std::size_t) {
    return Eigen::TensorMap<const Eigen::Tensor<S, 2>>(p.data(k, 0), p.shapes[0]);
  });
  Eigen::Tensor<S, 2> same(6, 4);
  std::vector<Eigen::Tensor<S, 2>*> same_means{&same};
  gradavg::average_gradients_into(tg, same_means);
  const std::vector<S> want(same.data(), same.data() + 24);

  buffer<S> out(24, 3, sentinel<S>);
  std::vector<Eigen::TensorMap<Eigen::Tensor<S, 3>>> rank3{{out.data(), dims<3>{6, 4, 1}}};  // a trailing 1
  gradavg::average_gradients_into(tg, rank3);
  CHECK(std::vector<S>(out.data(), out.data() + 24) == want);
  buffer<S> flat_out(24, 1, sentinel<S>);
  std::vector<Eigen::TensorMap<Eigen::Tensor<S, 1>>> rank1{{flat_out.data(), dims<1>{24}}};  // flat
  gradavg::average_gradients_into(tg, rank1);
  CHECK(std::vector<S>(flat_out.data(), flat_out.data() + 24) == want);
}

TEST_CASE("Eigen::Tensor: layouts are compatible where at most one dimension exceeds 1", "[eigen][tensor][shape]") {
  using S = double;
  const std::size_t T = 3;

  SECTION("rank 1") {
    problem<S, 1> p({{33}}, T, 1, 79);
    const auto tg = make_tower_grads<S>(T, 1, p.names, [&](std::size_t k, std::size_t) {
      return Eigen::TensorMap<const Eigen::Tensor<S, 1>>(p.data(k, 0), p.shapes[0]);
    });
    buffer<S> out(33, 2, sentinel<S>);
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 1, Eigen::RowMajor>>> means{{out.data(), p.shapes[0]}};
    REQUIRE(gradavg::average_gradients_into(tg, means).averaged == 1);
    p.require_matches(0, out.data(), false, "rank 1 ColMajor into RowMajor");
    REQUIRE(out.surroundings_intact());
  }
  SECTION("rank 4 with one non-trivial dimension; and empty") {
    for (const dims<4> d : {dims<4>{1, 1, 7, 1}, dims<4>{1, 1, 1, 1}, dims<4>{5, 1, 1, 1}, dims<4>{0, 3, 1, 1}}) {
      CAPTURE(d[0], d[1], d[2], d[3]);
      problem<S, 4> p({d}, T, 3, 80);
      const auto tg = make_tower_grads<S>(T, 1, p.names, [&](std::size_t k, std::size_t) {
        return Eigen::TensorMap<const Eigen::Tensor<S, 4, Eigen::RowMajor>>(p.data(k, 0), d);
      });
      buffer<S> out(count(d), 1, sentinel<S>), sq(count(d), 0, sentinel<S>);
      std::vector<Eigen::TensorMap<Eigen::Tensor<S, 4>>> means{{out.data(), d}}, squares{{sq.data(), d}};
      REQUIRE(gradavg::average_gradients_into(tg, means, squares).averaged == 1);
      p.require_matches(0, out.data(), false, "rank 4 RowMajor into ColMajor");
      p.require_matches(0, sq.data(), true, "rank 4 RowMajor into ColMajor");
      REQUIRE(out.surroundings_intact());
      REQUIRE(sq.surroundings_intact());
    }
  }
  SECTION("but not 2x3 against 3x2 or 2x3 across layouts") {
    problem<S, 4> p({{1, 2, 3, 1}}, T, 0, 81);
    const auto tg = make_tower_grads<S>(T, 1, p.names, [&](std::size_t k, std::size_t) {
      return Eigen::TensorMap<const Eigen::Tensor<S, 4, Eigen::RowMajor>>(p.data(k, 0), p.shapes[0]);
    });
    buffer<S> out(6, 1, sentinel<S>);
    const auto before = out.snapshot();
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 4>>> col{{out.data(), dims<4>{1, 2, 3, 1}}};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, col), gradavg::output_error);
    std::vector<Eigen::TensorMap<Eigen::Tensor<S, 4, Eigen::RowMajor>>> swapped{{out.data(), dims<4>{1, 3, 2, 1}}};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, swapped), gradavg::output_error);
    REQUIRE(out.same_as(before));
  }
}

// ---- Result types and skipped variables. -----------------------------------------------------

TEST_CASE("Eigen::Tensor: results are Eigen::Tensor of the same rank and layout, skipped variables pair correctly",
          "[eigen][tensor][types]") {
  using S = float;
  using G = Eigen::Tensor<S, 3, Eigen::RowMajor>;
  const std::size_t T = 4;
  problem<S, 3> p({{2, 3, 4}, {1, 1, 1}, {5, 1, 3}}, T, 2, 82);
  std::vector<std::vector<G>> owned(T);
  for (std::size_t k = 0; k < T; ++k)
    for (std::size_t i = 0; i < 3; ++i) {
      owned[k].emplace_back(p.shapes[i]);
      std::copy(p.data(k, i), p.data(k, i) + p.size(i), owned[k][i].data());
    }
  // Variable 1 has no gradient on any tower.
  const auto tg = make_tower_grads<S>(T, 3, p.names, [&](std::size_t k, std::size_t i) -> const G* {
    return i == 1 ? nullptr : &owned[k][i];
  });
  const auto result = gradavg::average_gradients<G>(tg, gradavg::include_square);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(result.gradients[0].first)>, G>);
  REQUIRE(result.gradients.size() == 2);
  REQUIRE(result.squares.size() == 2);
  REQUIRE(result.skipped.size() == 1);
  REQUIRE(result.skipped[0].index == 1);
  REQUIRE(result.skipped[0].variable == p.names[1]);
  const std::size_t present[] = {0, 2};
  for (std::size_t r = 0; r < 2; ++r) {
    const std::size_t i = present[r];
    CAPTURE(i);
    REQUIRE(result.gradients[r].second == p.names[i]);
    REQUIRE(result.squares[r].second == p.names[i]);
    REQUIRE(has_dims(result.gradients[r].first, p.shapes[i]));
    p.require_matches(i, result.gradients[r].first.data(), false, "Tensor*, skipping");
    p.require_matches(i, result.squares[r].first.data(), true, "Tensor*, skipping");
  }

  // TensorMap<const Tensor<double, 2, RowMajor>> gives Tensor<double, 2, RowMajor>.
  problem<double, 2> q({{3, 5}}, 2, 1, 83);
  const auto tgq = make_tower_grads<double>(2, 1, q.names, [&](std::size_t k, std::size_t) {
    return Eigen::TensorMap<const Eigen::Tensor<double, 2, Eigen::RowMajor>>(q.data(k, 0), q.shapes[0]);
  });
  const auto rq = gradavg::average_gradients(tgq);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(rq.gradients[0].first)>,
                               Eigen::Tensor<double, 2, Eigen::RowMajor>>);
  REQUIRE(has_dims(rq.gradients[0].first, q.shapes[0]));
  q.require_matches(0, rq.gradients[0].first.data(), false, "TensorMap<const Tensor<double, 2, RowMajor>>");
}

// ---- TensorFlow's ConstTensor spelling, and layouts checked against Eigen's dense types. -----

TEST_CASE("Eigen::TensorMap<Tensor<const float, N>> (TensorFlow's ConstTensor) reads like TensorMap<const Tensor>",
          "[eigen][tensor]") {
  using S = float;
  using const_elements = Eigen::TensorMap<Eigen::Tensor<const S, 2, Eigen::RowMajor>>;
  STATIC_REQUIRE(gradavg::tensor<const_elements>);
  STATIC_REQUIRE(!gradavg::writable_tensor<const_elements>);
  STATIC_REQUIRE(std::is_same_v<gradavg::tensor_value_t<const_elements>, S>);
  const std::size_t T = 3;
  problem<S, 2> p({{5, 7}, {1, 33}}, T, 1, 91);
  const auto tg = make_tower_grads<S>(T, 2, p.names, [&](std::size_t k, std::size_t i) {
    return const_elements(p.data(k, i), p.shapes[i]);
  });
  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
  STATIC_REQUIRE(std::is_same_v<decltype(r.gradients[0].first), Eigen::Tensor<S, 2, Eigen::RowMajor>>);
  check_allocated(p, r, "TensorMap<Tensor<const float, 2>>");
}

TEST_CASE("Eigen::Tensor: RowMajor and ColMajor mixed between gradients and outputs, each labelled as it is",
          "[eigen][tensor][shape]") {
  // The message names each side's storage order: layouts labelled the wrong way round show
  // even where gradients and outputs are swapped alike.
  using S = float;
  const std::size_t T = 2;
  problem<S, 2> p({{6, 4}}, T, 0, 92);
  buffer<S> out(24, 1, sentinel<S>);
  const auto before = out.snapshot();
  const auto row_tg = make_tower_grads<S>(T, 1, p.names, [&](std::size_t k, std::size_t) {
    return Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>>(p.data(k, 0), p.shapes[0]);
  });
  const auto col_tg = make_tower_grads<S>(T, 1, p.names, [&](std::size_t k, std::size_t) {
    return Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::ColMajor>>(p.data(k, 0), p.shapes[0]);
  });
  std::vector<Eigen::TensorMap<Eigen::Tensor<S, 2, Eigen::RowMajor>>> row_out{{out.data(), p.shapes[0]}};
  std::vector<Eigen::TensorMap<Eigen::Tensor<S, 2, Eigen::ColMajor>>> col_out{{out.data(), p.shapes[0]}};

  const auto row_msg = message_of<gradavg::output_error>([&] { gradavg::average_gradients_into(row_tg, col_out); });
  CHECK(contains(row_msg, "the means output has shape [6, 4] col-major but the gradient has shape [6, 4] row-major"));
  const auto col_msg = message_of<gradavg::output_error>([&] { gradavg::average_gradients_into(col_tg, row_out); });
  CHECK(contains(col_msg, "the means output has shape [6, 4] row-major but the gradient has shape [6, 4] col-major"));
  REQUIRE(out.same_as(before));

  // Same order on both sides: averaged, element by element in memory.
  REQUIRE(gradavg::average_gradients_into(row_tg, row_out).averaged == 1);
  p.require_matches(0, out.data(), false, "RowMajor into RowMajor");
  std::fill(out.data(), out.data() + 24, S(0));
  REQUIRE(gradavg::average_gradients_into(col_tg, col_out).averaged == 1);
  p.require_matches(0, out.data(), false, "ColMajor into ColMajor");
  REQUIRE(out.surroundings_intact());
}
