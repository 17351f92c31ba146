// Eigen dense types as gradients and as outputs: Matrix and Array (fixed and dynamic size), Map
// (64-byte aligned, unaligned at misaligned starts, const), Ref, Block and Transpose, of float and
// double. Every value is checked against the independent double-precision reference of
// reference.hpp, over a sweep of element counts, tower counts and misaligned starts, through both
// average_gradients and average_gradients_into; then the stride, shape and result-type rules of
// gradavg/eigen.hpp (the stride and shape cases for float only: the rules do not depend on the
// element type, and a second one adds about 20 s to each of the five builds of this file).
//
// Tolerance (gradavg_test::tolerance / first_mismatch in reference.hpp): element j of a mean over
// T towers may differ from the double reference by at most
//     2 * (T + 1) * epsilon(S) * (mean over towers of |g_k[j]|)   + denorm_min(S)
// and element j of a mean of squares by the same factor times (mean over towers of g_k[j]^2):
// T + 1 roundings of at most half an ulp each (the T-term sum and the division), with a factor 2
// of slack that also covers the rounding of the products in the squares.
#include <gradavg/average.hpp>
#include <gradavg/eigen.hpp>

#include <Eigen/Core>

#include <algorithm>
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

template <class S>
using VecX = Eigen::Matrix<S, Eigen::Dynamic, 1>;
template <class S>
using RowVecX = Eigen::Matrix<S, 1, Eigen::Dynamic>;
template <class S>
using MatX = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;
template <class S>
using MatXR = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using ArrX = Eigen::Array<S, Eigen::Dynamic, Eigen::Dynamic>;

using Array35d = Eigen::Array<double, 3, 5>;
using Matrix23fR = Eigen::Matrix<float, 2, 3, Eigen::RowMajor>;

constexpr std::size_t element_counts[] = {0, 1, 3, 7, 15, 16, 17, 31, 63, 1000, 4099};
constexpr std::size_t tower_counts[] = {1, 2, 3, 8, 33};
constexpr std::size_t offsets = 4;  // maps start 0..3 elements past a 64-byte boundary

struct dims {
  Index rows;
  Index cols;
  [[nodiscard]] std::size_t size() const { return static_cast<std::size_t>(rows * cols); }
};

/// A matrix shape of n elements for each count above: factorised where n allows, else a single
/// row or column (alternating, so both orientations are swept).
dims matrix_shape(std::size_t n) {
  switch (n) {
    case 0: return {0, 5};
    case 1: return {1, 1};
    case 3: return {1, 3};
    case 7: return {7, 1};
    case 15: return {3, 5};
    case 16: return {4, 4};
    case 17: return {1, 17};
    case 31: return {31, 1};
    case 63: return {7, 9};
    case 1000: return {25, 40};
    default: return {1, static_cast<Index>(n)};  // 4099 is prime
  }
}

std::uint32_t seed_of(std::size_t n, std::size_t towers, std::size_t offset, std::size_t salt) {
  return static_cast<std::uint32_t>(n * 7919u + towers * 131u + offset * 17u + salt * 1000003u);
}

/// T towers of V variables with the given shapes, filled with random values in [-1, 1]. Tower k's
/// variable i starts (offset + k + 2i) % 4 elements past a 64-byte boundary, so towers and
/// variables mix alignments; `aligned` puts every one on a 64-byte boundary instead.
template <class S>
struct problem {
  std::vector<dims> shapes;
  std::size_t towers;
  std::vector<std::vector<buffer<S>>> grads;  // [tower][variable]
  std::vector<std::string> names;
  std::vector<expectation<S>> expected;

  problem(std::vector<dims> shapes_, std::size_t towers_, std::size_t offset, std::uint32_t seed, bool aligned = false)
      : shapes(std::move(shapes_)), towers(towers_) {
    const std::size_t V = shapes.size();
    grads.resize(towers);
    for (std::size_t k = 0; k < towers; ++k) {
      grads[k].reserve(V);
      for (std::size_t i = 0; i < V; ++i) {
        const std::size_t n = shapes[i].size();
        grads[k].emplace_back(n, aligned ? 0 : (offset + k + 2 * i) % offsets, S(0));
        const S* values = random_slice<S>(n, seed + static_cast<std::uint32_t>(k * 104729u + i * 15485863u));
        std::copy(values, values + n, grads[k][i].data());
      }
    }
    for (std::size_t i = 0; i < V; ++i) {
      names.push_back("layer" + std::to_string(i) + "/weights");
      expected.emplace_back(tower_data(i), shapes[i].size());
    }
  }

  [[nodiscard]] std::size_t variables() const { return shapes.size(); }
  [[nodiscard]] S* data(std::size_t k, std::size_t i) { return grads[k][i].data(); }
  [[nodiscard]] std::vector<const S*> tower_data(std::size_t i) const {
    std::vector<const S*> out;
    for (std::size_t k = 0; k < towers; ++k) out.push_back(grads[k][i].data());
    return out;
  }
  void require_matches(std::size_t i, const S* got, bool squares, const std::string& what) const {
    ::require_matches(got, expected[i], towers, squares, what + " (" + names[i] + ")");
  }
};

/// Copies of the problem's gradients as owned Eigen objects: owned[k][i].
template <class M, class S>
std::vector<std::vector<M>> owned_copies(problem<S>& p) {
  std::vector<std::vector<M>> owned(p.towers);
  for (std::size_t k = 0; k < p.towers; ++k)
    for (std::size_t i = 0; i < p.variables(); ++i)
      owned[k].push_back(Eigen::Map<const M>(p.data(k, i), p.shapes[i].rows, p.shapes[i].cols));
  return owned;
}

/// tower_grads[k][i] = (make_slot(k, i), p.names[i]).
template <class S, class MakeSlot>
auto make_tower_grads(problem<S>& p, MakeSlot make_slot) {
  using Slot = decltype(make_slot(std::size_t{}, std::size_t{}));
  std::vector<std::vector<std::pair<Slot, std::string>>> tg(p.towers);
  for (std::size_t k = 0; k < p.towers; ++k) {
    tg[k].reserve(p.variables());
    for (std::size_t i = 0; i < p.variables(); ++i) tg[k].emplace_back(make_slot(k, i), p.names[i]);
  }
  return tg;
}

/// Checks what average_gradients returned when every variable of p is averaged: pairing with
/// the variables, shapes, and values against the reference (squares when requested).
template <class Result, class S>
void check_allocated(const problem<S>& p, const gradavg::averaged_gradients<Result, std::string>& result,
                     bool with_squares, const std::string& what) {
  const std::size_t V = p.variables();
  REQUIRE(result.gradients.size() == V);
  REQUIRE(result.squares.size() == (with_squares ? V : 0));
  REQUIRE(result.skipped.empty());
  for (std::size_t i = 0; i < V; ++i) {
    REQUIRE(result.gradients[i].second == p.names[i]);
    const Result& mean = result.gradients[i].first;
    REQUIRE(mean.rows() == p.shapes[i].rows);
    REQUIRE(mean.cols() == p.shapes[i].cols);
    p.require_matches(i, mean.data(), false, what);
    if (!with_squares) continue;
    REQUIRE(result.squares[i].second == p.names[i]);
    const Result& square = result.squares[i].first;
    REQUIRE(square.rows() == p.shapes[i].rows);
    REQUIRE(square.cols() == p.shapes[i].cols);
    p.require_matches(i, square.data(), true, what);
  }
}

/// One output buffer per variable of p, at misaligned starts (first + i) % 4, sentinel around.
template <class S>
std::vector<buffer<S>> output_buffers(const problem<S>& p, std::size_t first) {
  std::vector<buffer<S>> out;
  out.reserve(p.variables());
  for (std::size_t i = 0; i < p.variables(); ++i)
    out.emplace_back(p.shapes[i].size(), (first + i) % offsets, sentinel<S>);
  return out;
}

/// Eigen::Map<Result> over each buffer, with variable i's shape.
template <class Result, class S>
std::vector<Eigen::Map<Result>> maps_over(const problem<S>& p, std::vector<buffer<S>>& bufs) {
  std::vector<Eigen::Map<Result>> maps;
  maps.reserve(bufs.size());
  for (std::size_t i = 0; i < bufs.size(); ++i) maps.emplace_back(bufs[i].data(), p.shapes[i].rows, p.shapes[i].cols);
  return maps;
}

/// Checks the outputs average_gradients_into wrote into buffers (squares may be null).
template <class S>
void check_into(const problem<S>& p, const gradavg::summary& s, const std::vector<buffer<S>>& means,
                const std::vector<buffer<S>>* squares, const std::string& what) {
  REQUIRE(s.averaged == p.variables());
  REQUIRE(s.skipped == 0);
  for (std::size_t i = 0; i < p.variables(); ++i) {
    p.require_matches(i, means[i].data(), false, what);
    REQUIRE(means[i].surroundings_intact());
    if (squares == nullptr) continue;
    p.require_matches(i, (*squares)[i].data(), true, what);
    REQUIRE((*squares)[i].surroundings_intact());
  }
}

/// Runs every API on tower_grads[k][i] = (make_slot(k, i), name i) and checks the result type
/// (Result), pairing with variables, shapes, values against the reference, and that nothing
/// around the outputs was written. Outputs of average_gradients_into are Eigen::Map<Result> at
/// misaligned starts (out_offset + ...) % 4; with MeansOnlyInto, also into owned Result objects
/// through pointers without squares (each extra overload costs compile time, so only some kinds).
template <class Result, bool MeansOnlyInto = false, class S, class MakeSlot>
void check_all_apis(problem<S>& p, MakeSlot make_slot, std::size_t out_offset, const std::string& what) {
  const auto tg = make_tower_grads(p, make_slot);

  const auto with_squares = gradavg::average_gradients(tg, gradavg::include_square);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(with_squares.gradients[0].first)>, Result>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(with_squares.squares[0].first)>, Result>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(with_squares.gradients[0].second)>, std::string>);
  check_allocated(p, with_squares, true, what + ", average_gradients");
  check_allocated(p, gradavg::average_gradients(tg), false, what + ", average_gradients (means only)");

  {  // Into maps at misaligned starts, means and squares.
    auto mean_bufs = output_buffers(p, out_offset), square_bufs = output_buffers(p, out_offset + 1);
    auto means = maps_over<Result>(p, mean_bufs), squares = maps_over<Result>(p, square_bufs);
    check_into(p, gradavg::average_gradients_into(tg, means, squares), mean_bufs, &square_bufs,
               what + ", average_gradients_into maps");
  }
  if constexpr (MeansOnlyInto) {  // Into owned objects through pointers, means only.
    std::vector<Result> owned(p.variables());
    std::vector<Result*> means;
    for (std::size_t i = 0; i < p.variables(); ++i) {
      owned[i].resize(p.shapes[i].rows, p.shapes[i].cols);
      means.push_back(&owned[i]);
    }
    const gradavg::summary s = gradavg::average_gradients_into(tg, means);
    REQUIRE(s.averaged == p.variables());
    for (std::size_t i = 0; i < p.variables(); ++i)
      p.require_matches(i, owned[i].data(), false, what + ", average_gradients_into pointers");
  }
}

}  // namespace

// ---- Property sweeps against the reference. -------------------------------------------------

TEMPLATE_TEST_CASE("Eigen vectors: Map, aligned Map, Ref and pointers match the reference over sizes, towers, "
                   "misaligned starts",
                   "[eigen][dense][sweep]", float, double) {
  using S = TestType;
  using V = VecX<S>;
  for (const std::size_t n : element_counts) {
    for (const std::size_t T : tower_counts) {
      for (std::size_t off = 0; off < offsets; ++off) {
        CAPTURE(n, T, off);
        // Two vector variables of different lengths in one call. Tower k's variable i starts
        // (off + k + 2i) % 4 elements past a 64-byte boundary.
        const std::vector<dims> shapes{{static_cast<Index>(n), 1}, {static_cast<Index>(n % 5 + 2), 1}};
        problem<S> p(shapes, T, off, seed_of(n, T, off, sizeof(S)));

        // Unaligned const maps at every offset; the other kinds take turns over the offsets.
        check_all_apis<V, true>(
            p, [&](std::size_t k, std::size_t i) { return Eigen::Map<const V>(p.data(k, i), p.shapes[i].rows); }, off,
            "Map<const VectorX>");
        switch (off) {
          case 0: {
            problem<S> aligned(shapes, T, 0, seed_of(n, T, 0, sizeof(S) + 1), true);
            check_all_apis<V>(
                aligned,
                [&](std::size_t k, std::size_t i) {
                  return Eigen::Map<V, Eigen::Aligned64>(aligned.data(k, i), aligned.shapes[i].rows);
                },
                0, "Map<VectorX, Aligned64>");
            break;
          }
          case 1:
            check_all_apis<V>(
                p, [&](std::size_t k, std::size_t i) { return Eigen::Map<V>(p.data(k, i), p.shapes[i].rows); }, off + 1,
                "Map<VectorX>");
            break;
          case 2:
            check_all_apis<V>(
                p,
                [&](std::size_t k, std::size_t i) {
                  Eigen::Ref<V> r(Eigen::Map<V>(p.data(k, i), p.shapes[i].rows));
                  REQUIRE(r.data() == p.data(k, i));  // a view, not a copy
                  return r;
                },
                off + 2, "Ref<VectorX>");
            break;
          default: {
            const auto owned = owned_copies<V>(p);
            check_all_apis<V>(
                p, [&](std::size_t k, std::size_t i) { return &owned[k][i]; }, off + 3, "const VectorX*");
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("Eigen matrices and arrays: three variables of different shapes match the reference over sizes, "
                   "towers, misaligned starts",
                   "[eigen][dense][sweep]", float, double) {
  using S = TestType;
  for (const std::size_t n : element_counts) {
    const dims d = matrix_shape(n);
    REQUIRE(d.size() == n);
    // rows x cols, its transpose, and a small third shape: three variables in every call.
    const std::vector<dims> shapes{d, {d.cols, d.rows}, {d.rows % 3 + 1, 2}};
    for (const std::size_t T : tower_counts) {
      for (std::size_t off = 0; off < offsets; ++off) {
        CAPTURE(n, d.rows, d.cols, T, off);
        problem<S> p(shapes, T, off, seed_of(n, T, off, 10 + sizeof(S)));
        auto rows = [&](std::size_t i) { return p.shapes[i].rows; };
        auto cols = [&](std::size_t i) { return p.shapes[i].cols; };

        // The kinds take turns over the offsets, so every kind sees every n and T.
        switch (off) {
          case 0: {
            check_all_apis<MatX<S>, true>(
                p, [&](std::size_t k, std::size_t i) { return Eigen::Map<MatX<S>>(p.data(k, i), rows(i), cols(i)); },
                off, "Map<MatrixX>");
            const auto owned = owned_copies<MatX<S>>(p);
            check_all_apis<MatX<S>>(
                p, [&](std::size_t k, std::size_t i) { return &owned[k][i]; }, off + 1, "const MatrixX*");
            break;
          }
          case 1:
            check_all_apis<MatXR<S>>(
                p,
                [&](std::size_t k, std::size_t i) {
                  return Eigen::Map<const MatXR<S>>(p.data(k, i), rows(i), cols(i));
                },
                off, "Map<const RowMajor MatrixX>");
            break;
          case 2:
            check_all_apis<ArrX<S>>(
                p, [&](std::size_t k, std::size_t i) { return Eigen::Map<ArrX<S>>(p.data(k, i), rows(i), cols(i)); },
                off, "Map<ArrayXX>");
            check_all_apis<ArrX<S>>(
                p,
                [&](std::size_t k, std::size_t i) {
                  return ArrX<S>(Eigen::Map<const ArrX<S>>(p.data(k, i), rows(i), cols(i)));
                },
                off + 1, "ArrayXX by value");
            break;
          default:
            check_all_apis<MatX<S>>(
                p,
                [&](std::size_t k, std::size_t i) {
                  Eigen::Ref<const MatX<S>> r(Eigen::Map<const MatX<S>>(p.data(k, i), rows(i), cols(i)));
                  REQUIRE(r.data() == p.data(k, i));  // a view, not a copy
                  return r;
                },
                off, "Ref<const MatrixX>");
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("Eigen fixed-size Matrix and Array: values, Map at misaligned starts, match the reference",
                   "[eigen][dense][sweep]", Eigen::Matrix4f, Array35d, Matrix23fR, Eigen::Vector3d) {
  using M = TestType;
  using S = typename M::Scalar;
  const dims d{M::RowsAtCompileTime, M::ColsAtCompileTime};
  for (const std::size_t T : tower_counts) {
    for (std::size_t off = 0; off < offsets; ++off) {
      CAPTURE(T, off);
      problem<S> p({d, d, d}, T, off, seed_of(d.size(), T, off, 20 + sizeof(S)));
      check_all_apis<M, true>(
          p, [&](std::size_t k, std::size_t i) { return M(Eigen::Map<const M>(p.data(k, i))); }, off,
          "fixed-size by value");
      check_all_apis<M>(
          p, [&](std::size_t k, std::size_t i) { return Eigen::Map<const M>(p.data(k, i)); }, off + 1,
          "Map<const fixed-size>");
    }
  }
}

// ---- Strides: rejected, nothing written. ------------------------------------------------------

TEMPLATE_TEST_CASE("Eigen: gradients with an inner stride are rejected with shape_error, outputs untouched",
                   "[eigen][dense][stride]", float) {
  using S = TestType;
  using V = VecX<S>;
  using Strided = Eigen::Map<V, 0, Eigen::InnerStride<2>>;
  for (const std::size_t n : {std::size_t{2}, std::size_t{17}, std::size_t{1000}}) {
    CAPTURE(n);
    const std::size_t T = 3;
    problem<S> p({{static_cast<Index>(2 * n), 1}}, T, 1, seed_of(n, T, 1, 30));
    const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t) { return Strided(p.data(k, 0), Index(n)); });

    const std::string m1 = message_of<gradavg::shape_error>([&] { (void)gradavg::average_gradients(tg); });
    REQUIRE(contains(m1, "contiguous"));

    buffer<S> mean(n, 1, sentinel<S>), square(n, 2, sentinel<S>);
    const auto mean_before = mean.snapshot(), square_before = square.snapshot();
    std::vector<Eigen::Map<V>> means{Eigen::Map<V>(mean.data(), Index(n))};
    std::vector<Eigen::Map<V>> squares{Eigen::Map<V>(square.data(), Index(n))};
    try {
      (void)gradavg::average_gradients_into(tg, means, squares);
      FAIL("strided gradients were accepted");
    } catch (const gradavg::shape_error& e) {
      REQUIRE(contains(e.what(), "contiguous"));
      REQUIRE(e.variable_index() == 0);
    }
    REQUIRE(mean.same_as(mean_before));
    REQUIRE(square.same_as(square_before));
  }
}

TEMPLATE_TEST_CASE("Eigen: one strided tower among contiguous ones is rejected before any variable is written",
                   "[eigen][dense][stride]", float) {
  using S = TestType;
  using V = VecX<S>;
  using Dyn = Eigen::Map<V, 0, Eigen::InnerStride<>>;
  const std::size_t T = 4, n = 33;
  // Variable 0 is fine everywhere; variable 1 is strided on tower 2 only.
  problem<S> p({{Index(n), 1}, {Index(2 * n), 1}}, T, 0, seed_of(n, T, 0, 31));
  const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t i) {
    if (i == 0) return Dyn(p.data(k, i), Index(n), Eigen::InnerStride<>(1));
    return Dyn(p.data(k, i), Index(n), Eigen::InnerStride<>(k == 2 ? 2 : 1));
  });

  buffer<S> mean0(n, 3, sentinel<S>), mean1(n, 1, sentinel<S>), square0(n, 2, sentinel<S>), square1(n, 0, sentinel<S>);
  const auto before = std::vector{mean0.snapshot(), mean1.snapshot(), square0.snapshot(), square1.snapshot()};
  std::vector<Eigen::Map<V>> means{Eigen::Map<V>(mean0.data(), Index(n)), Eigen::Map<V>(mean1.data(), Index(n))};
  std::vector<Eigen::Map<V>> squares{Eigen::Map<V>(square0.data(), Index(n)), Eigen::Map<V>(square1.data(), Index(n))};
  try {
    (void)gradavg::average_gradients_into(tg, means, squares);
    FAIL("a strided gradient was accepted");
  } catch (const gradavg::shape_error& e) {
    CAPTURE(e.what());
    REQUIRE(contains(e.what(), "contiguous"));
    REQUIRE(contains(e.what(), "tower 2"));
    REQUIRE(e.variable_index() == 1);
  }
  REQUIRE(mean0.same_as(before[0]));
  REQUIRE(mean1.same_as(before[1]));
  REQUIRE(square0.same_as(before[2]));
  REQUIRE(square1.same_as(before[3]));
  REQUIRE_THROWS_AS(gradavg::average_gradients(tg), gradavg::shape_error);
}

TEMPLATE_TEST_CASE("Eigen: outer strides larger than the inner size are rejected, equal ones and single columns are "
                   "contiguous and averaged",
                   "[eigen][dense][stride]", float) {
  using S = TestType;
  using M = MatX<S>;
  using Outer = Eigen::Map<M, 0, Eigen::OuterStride<>>;
  const std::size_t T = 3;

  SECTION("outer stride > rows: shape_error, outputs untouched") {
    for (const dims d : {dims{3, 4}, dims{1, 5}, dims{16, 2}}) {
      CAPTURE(d.rows, d.cols);
      const Index stride = d.rows + 3;
      problem<S> p({{stride, d.cols}}, T, 2, seed_of(d.size(), T, 2, 32));
      const auto tg = make_tower_grads(
          p, [&](std::size_t k, std::size_t) { return Outer(p.data(k, 0), d.rows, d.cols, Eigen::OuterStride<>(stride)); });
      REQUIRE(contains(message_of<gradavg::shape_error>([&] { (void)gradavg::average_gradients(tg); }), "contiguous"));

      buffer<S> mean(d.size(), 3, sentinel<S>);
      const auto before = mean.snapshot();
      std::vector<Eigen::Map<M>> means{Eigen::Map<M>(mean.data(), d.rows, d.cols)};
      REQUIRE(contains(message_of<gradavg::shape_error>([&] { (void)gradavg::average_gradients_into(tg, means); }),
                       "contiguous"));
      REQUIRE(mean.same_as(before));
    }
  }

  SECTION("outer stride == rows, or a single column with any outer stride: accepted and correct") {
    for (const auto& d_stride : {std::pair{dims{3, 4}, Index{3}}, std::pair{dims{5, 1}, Index{9}},
                                 std::pair{dims{1, 1}, Index{4}}, std::pair{dims{0, 3}, Index{2}}}) {
      // Named copies, not structured bindings: lambdas may capture those only from C++20 (Clang 16).
      const dims d = d_stride.first;
      const Index stride = d_stride.second;
      CAPTURE(d.rows, d.cols, stride);
      problem<S> p({d}, T, 1, seed_of(d.size(), T, 1, 33));
      const auto tg = make_tower_grads(
          p, [&](std::size_t k, std::size_t) { return Outer(p.data(k, 0), d.rows, d.cols, Eigen::OuterStride<>(stride)); });
      const auto result = gradavg::average_gradients(tg, gradavg::include_square);
      static_assert(std::is_same_v<std::remove_cvref_t<decltype(result.gradients[0].first)>, M>);
      REQUIRE(result.gradients.size() == 1);
      p.require_matches(0, result.gradients[0].first.data(), false, "OuterStride map");
      p.require_matches(0, result.squares[0].first.data(), true, "OuterStride map");
    }
  }

  SECTION("a single element with an inner stride is contiguous") {
    problem<S> p({{2, 1}}, T, 3, seed_of(2, T, 3, 34));
    const auto tg = make_tower_grads(
        p, [&](std::size_t k, std::size_t) { return Eigen::Map<VecX<S>, 0, Eigen::InnerStride<2>>(p.data(k, 0), 1); });
    const auto result = gradavg::average_gradients(tg, gradavg::include_square);
    REQUIRE(result.gradients[0].first.size() == 1);
    // Only element 0 of each tower is read: compare with the reference's first element.
    const expectation<S> e(p.tower_data(0), 1);
    require_matches(result.gradients[0].first.data(), e, T, false, "single strided element");
    require_matches(result.squares[0].first.data(), e, T, true, "single strided element");
  }
}

TEMPLATE_TEST_CASE("Eigen: strided outputs are rejected with output_error, every output untouched",
                   "[eigen][dense][stride]", float) {
  using S = TestType;
  using V = VecX<S>;
  using M = MatX<S>;
  const std::size_t T = 2, n = 12;
  problem<S> p({{Index(n), 1}}, T, 0, seed_of(n, T, 0, 35));
  const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t) { return Eigen::Map<const V>(p.data(k, 0), Index(n)); });

  buffer<S> wide(2 * n, 1, sentinel<S>), plain(n, 2, sentinel<S>);
  const auto wide_before = wide.snapshot(), plain_before = plain.snapshot();

  SECTION("strided means") {
    std::vector<Eigen::Map<V, 0, Eigen::InnerStride<2>>> means{Eigen::Map<V, 0, Eigen::InnerStride<2>>(wide.data(), Index(n))};
    REQUIRE(contains(message_of<gradavg::output_error>([&] { (void)gradavg::average_gradients_into(tg, means); }),
                     "contiguous"));
    std::vector<Eigen::Map<V>> squares{Eigen::Map<V>(plain.data(), Index(n))};
    REQUIRE(contains(
        message_of<gradavg::output_error>([&] { (void)gradavg::average_gradients_into(tg, means, squares); }),
        "contiguous"));
  }
  SECTION("strided squares next to contiguous means") {
    std::vector<Eigen::Map<V>> means{Eigen::Map<V>(plain.data(), Index(n))};
    std::vector<Eigen::Map<V, 0, Eigen::InnerStride<>>> squares{
        Eigen::Map<V, 0, Eigen::InnerStride<>>(wide.data(), Index(n), Eigen::InnerStride<>(2))};
    const std::string msg =
        message_of<gradavg::output_error>([&] { (void)gradavg::average_gradients_into(tg, means, squares); });
    REQUIRE(contains(msg, "contiguous"));
    REQUIRE(contains(msg, "squares"));
  }
  SECTION("a matrix output with an outer stride") {
    problem<S> pm({{3, 4}}, T, 0, seed_of(12, T, 0, 36));
    const auto tgm =
        make_tower_grads(pm, [&](std::size_t k, std::size_t) { return Eigen::Map<const M>(pm.data(k, 0), 3, 4); });
    std::vector<Eigen::Map<M, 0, Eigen::OuterStride<>>> means{
        Eigen::Map<M, 0, Eigen::OuterStride<>>(wide.data(), 3, 4, Eigen::OuterStride<>(5))};
    REQUIRE(contains(message_of<gradavg::output_error>([&] { (void)gradavg::average_gradients_into(tgm, means); }),
                     "contiguous"));
  }
  REQUIRE(wide.same_as(wide_before));
  REQUIRE(plain.same_as(plain_before));
}

// ---- Shapes: dimensions and storage order. ---------------------------------------------------

TEST_CASE("Eigen: a 6-vector and a 2x3 matrix are different shapes", "[eigen][dense][shape]") {
  using S = float;
  const std::size_t T = 2;
  problem<S> p({{6, 1}}, T, 1, seed_of(6, T, 1, 40));

  SECTION("between towers: shape_error") {
    for (const dims other : {dims{2, 3}, dims{3, 2}, dims{1, 6}}) {
      CAPTURE(other.rows, other.cols);
      const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t) {
        return k == 0 ? Eigen::Map<const MatX<S>>(p.data(k, 0), 6, 1)
                      : Eigen::Map<const MatX<S>>(p.data(k, 0), other.rows, other.cols);
      });
      buffer<S> mean(6, 0, sentinel<S>);
      const auto before = mean.snapshot();
      std::vector<Eigen::Map<MatX<S>>> means{Eigen::Map<MatX<S>>(mean.data(), 6, 1)};
      const std::string msg =
          message_of<gradavg::shape_error>([&] { (void)gradavg::average_gradients_into(tg, means); });
      REQUIRE(contains(msg, "tower 1"));
      REQUIRE(mean.same_as(before));
      REQUIRE_THROWS_AS(gradavg::average_gradients(tg), gradavg::shape_error);
    }
  }
  SECTION("a 6-vector gradient into a 2x3 or 1x6 output: accepted, elements in storage order") {
    const auto tg =
        make_tower_grads(p, [&](std::size_t k, std::size_t) { return Eigen::Map<const VecX<S>>(p.data(k, 0), 6); });
    VecX<S> want(6);
    std::vector<VecX<S>*> want_means{&want};
    gradavg::average_gradients_into(tg, want_means);
    buffer<S> mean(6, 0, sentinel<S>);
    std::vector<Eigen::Map<MatX<S>>> means{Eigen::Map<MatX<S>>(mean.data(), 2, 3)};
    gradavg::average_gradients_into(tg, means);
    for (Eigen::Index j = 0; j < 6; ++j) CHECK(mean.data()[j] == want(j));
    buffer<S> row(6, 0, sentinel<S>);
    std::vector<Eigen::Map<MatX<S>>> transposed{Eigen::Map<MatX<S>>(row.data(), 1, 6)};
    gradavg::average_gradients_into(tg, transposed);
    for (Eigen::Index j = 0; j < 6; ++j) CHECK(row.data()[j] == want(j));
  }
  SECTION("a 2x3 gradient into a 3x2 output: output_error, untouched") {
    const auto tg =
        make_tower_grads(p, [&](std::size_t k, std::size_t) { return Eigen::Map<const MatX<S>>(p.data(k, 0), 2, 3); });
    buffer<S> mean(6, 0, sentinel<S>);
    const auto before = mean.snapshot();
    std::vector<Eigen::Map<MatX<S>>> means{Eigen::Map<MatX<S>>(mean.data(), 3, 2)};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, means), gradavg::output_error);
    REQUIRE(mean.same_as(before));
  }
}

TEMPLATE_TEST_CASE("Eigen: storage order counts only where more than one dimension exceeds 1",
                   "[eigen][dense][shape]", float) {
  using S = TestType;
  const std::size_t T = 3;

  SECTION("2x3 col-major gradient, 2x3 row-major output (and the reverse): output_error, untouched") {
    problem<S> p({{2, 3}}, T, 2, seed_of(6, T, 2, 41));
    const auto tg_col =
        make_tower_grads(p, [&](std::size_t k, std::size_t) { return Eigen::Map<const MatX<S>>(p.data(k, 0), 2, 3); });
    const auto tg_row =
        make_tower_grads(p, [&](std::size_t k, std::size_t) { return Eigen::Map<const MatXR<S>>(p.data(k, 0), 2, 3); });
    buffer<S> mean(6, 1, sentinel<S>), square(6, 3, sentinel<S>);
    const auto mean_before = mean.snapshot(), square_before = square.snapshot();
    {
      std::vector<Eigen::Map<MatXR<S>>> means{Eigen::Map<MatXR<S>>(mean.data(), 2, 3)};
      std::vector<Eigen::Map<MatXR<S>>> squares{Eigen::Map<MatXR<S>>(square.data(), 2, 3)};
      REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg_col, means, squares), gradavg::output_error);
      // Means right, squares in the wrong order: still nothing written.
      std::vector<Eigen::Map<MatX<S>>> good_means{Eigen::Map<MatX<S>>(mean.data(), 2, 3)};
      REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg_col, good_means, squares), gradavg::output_error);
    }
    {
      std::vector<Eigen::Map<MatX<S>>> means{Eigen::Map<MatX<S>>(mean.data(), 2, 3)};
      REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg_row, means), gradavg::output_error);
      std::vector<Eigen::Matrix<S, 2, 3>> fixed_col(1);
      REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg_row, fixed_col), gradavg::output_error);
    }
    REQUIRE(mean.same_as(mean_before));
    REQUIRE(square.same_as(square_before));
  }

  SECTION("1xN and Nx1 are compatible across storage orders, values correct") {
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
      CAPTURE(n);
      const Index N = static_cast<Index>(n);
      problem<S> p({{1, N}}, T, 1, seed_of(n, T, 1, 42));
      // Col-major 1xN gradient (dynamic MatrixX) into row-major 1xN outputs.
      const auto tg =
          make_tower_grads(p, [&](std::size_t k, std::size_t) { return Eigen::Map<const MatX<S>>(p.data(k, 0), 1, N); });
      buffer<S> mean(n, 3, sentinel<S>), square(n, 1, sentinel<S>);
      std::vector<Eigen::Map<MatXR<S>>> means{Eigen::Map<MatXR<S>>(mean.data(), 1, N)};
      std::vector<Eigen::Map<RowVecX<S>>> squares{Eigen::Map<RowVecX<S>>(square.data(), N)};
      REQUIRE(gradavg::average_gradients_into(tg, means, squares).averaged == 1);
      p.require_matches(0, mean.data(), false, "col-major 1xN into row-major 1xN");
      p.require_matches(0, square.data(), true, "col-major 1xN into RowVectorX");
      REQUIRE(mean.surroundings_intact());
      REQUIRE(square.surroundings_intact());

      // VectorX (Nx1, col-major) gradient into a row-major Nx1 output.
      problem<S> q({{N, 1}}, T, 2, seed_of(n, T, 2, 43));
      const auto tgv =
          make_tower_grads(q, [&](std::size_t k, std::size_t) { return Eigen::Map<const VecX<S>>(q.data(k, 0), N); });
      MatXR<S> out(N, 1);
      std::vector<MatXR<S>*> outs{&out};
      REQUIRE(gradavg::average_gradients_into(tgv, outs).averaged == 1);
      q.require_matches(0, out.data(), false, "VectorX into row-major Nx1");
    }
  }

  SECTION("fixed and dynamic outputs of the same shape and order are interchangeable") {
    problem<S> p({{4, 4}}, T, 3, seed_of(16, T, 3, 44));
    const auto tg = make_tower_grads(
        p, [&](std::size_t k, std::size_t) { return Eigen::Map<const Eigen::Matrix<S, 4, 4>>(p.data(k, 0)); });
    MatX<S> out(4, 4), sq(4, 4);
    std::vector<MatX<S>*> means{&out}, squares{&sq};
    REQUIRE(gradavg::average_gradients_into(tg, means, squares).averaged == 1);
    p.require_matches(0, out.data(), false, "fixed 4x4 into MatrixX");
    p.require_matches(0, sq.data(), true, "fixed 4x4 into MatrixX");
    MatX<S> wrong(2, 8);
    std::vector<MatX<S>*> wrong_means{&wrong};
    REQUIRE_THROWS_AS(gradavg::average_gradients_into(tg, wrong_means), gradavg::output_error);
  }
}

TEST_CASE("Eigen: transposed gradients are row-major views: coefficient (i, j) is the mean of g_k(j, i)",
          "[eigen][dense][shape]") {
  using S = double;
  const std::size_t T = 5;
  problem<S> p({{3, 7}}, T, 1, seed_of(21, T, 1, 45));
  const auto owned = owned_copies<MatX<S>>(p);
  const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t) { return owned[k][0].transpose(); });
  const auto result = gradavg::average_gradients(tg, gradavg::include_square);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(result.gradients[0].first)>, MatXR<S>>);
  const MatXR<S>& mean = result.gradients[0].first;
  const MatXR<S>& square = result.squares[0].first;
  REQUIRE(mean.rows() == 7);
  REQUIRE(mean.cols() == 3);
  const double tol = gradavg_test::tolerance<S>(T);
  for (Index i = 0; i < 7; ++i)
    for (Index j = 0; j < 3; ++j) {
      double want = 0, want_sq = 0, scale = 0;
      for (std::size_t k = 0; k < T; ++k) {
        const double x = owned[k][0](j, i);
        want += x;
        want_sq += x * x;
        scale += std::abs(x);
      }
      want /= T;
      want_sq /= T;
      scale /= T;
      CAPTURE(i, j);
      REQUIRE(std::abs(mean(i, j) - want) <= tol * scale);
      REQUIRE(std::abs(square(i, j) - want_sq) <= tol * want_sq);
    }
}

// ---- Blocks and Refs that may or may not be contiguous. ----------------------------------------

TEMPLATE_TEST_CASE("Eigen: blocks and Ref<const MatrixX> to blocks are accepted when contiguous, else shape_error",
                   "[eigen][dense][stride]", float) {
  using S = TestType;
  using M = MatX<S>;
  const std::size_t T = 3;
  problem<S> p({{5, 4}}, T, 0, seed_of(20, T, 0, 46));
  const auto owned = owned_copies<M>(p);

  SECTION("leftCols: a contiguous Block") {
    const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t) { return owned[k][0].leftCols(3); });
    const auto result = gradavg::average_gradients(tg, gradavg::include_square);
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(result.gradients[0].first)>, M>);
    REQUIRE(result.gradients[0].first.rows() == 5);
    REQUIRE(result.gradients[0].first.cols() == 3);
    std::vector<const S*> towers;
    for (std::size_t k = 0; k < T; ++k) towers.push_back(owned[k][0].data());
    const expectation<S> e(towers, 15);  // the first 15 elements, column by column
    require_matches(result.gradients[0].first.data(), e, T, false, "leftCols(3)");
    require_matches(result.squares[0].first.data(), e, T, true, "leftCols(3)");
  }
  SECTION("topRows: outer stride 5 for 3 rows") {
    const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t) { return owned[k][0].topRows(3); });
    REQUIRE(contains(message_of<gradavg::shape_error>([&] { (void)gradavg::average_gradients(tg); }), "contiguous"));
    const auto tg_ref = make_tower_grads(
        p, [&](std::size_t k, std::size_t) { return Eigen::Ref<const M>(owned[k][0].topRows(3)); });
    REQUIRE(tg_ref[1][0].first.data() == owned[1][0].data());  // Ref views the block, no copy
    REQUIRE(contains(message_of<gradavg::shape_error>([&] { (void)gradavg::average_gradients(tg_ref); }),
                     "contiguous"));
  }
}

// ---- Result types and variables. -------------------------------------------------------------

TEST_CASE("Eigen: the allocating API returns the PlainObject of the gradient type", "[eigen][dense][types]") {
  problem<float> pf({{9, 1}, {4, 1}}, 2, 1, 50);
  problem<double> pd({{9, 1}, {4, 1}}, 2, 2, 51);
  auto rows_f = [&](std::size_t i) { return pf.shapes[i].rows; };
  auto rows_d = [&](std::size_t i) { return pd.shapes[i].rows; };

  {
    const auto tg = make_tower_grads(
        pf, [&](std::size_t k, std::size_t i) { return Eigen::Map<Eigen::VectorXf>(pf.data(k, i), rows_f(i)); });
    const auto result = gradavg::average_gradients(tg);
    static_assert(std::is_same_v<decltype(result.gradients[0].first), Eigen::VectorXf>);
    for (std::size_t i = 0; i < 2; ++i) pf.require_matches(i, result.gradients[i].first.data(), false, "Map<VectorXf>");
  }
  {
    const auto tg = make_tower_grads(pf, [&](std::size_t k, std::size_t i) {
      return Eigen::Ref<const Eigen::MatrixXf>(Eigen::Map<const Eigen::MatrixXf>(pf.data(k, i), rows_f(i), 1));
    });
    const auto result = gradavg::average_gradients(tg);
    static_assert(std::is_same_v<decltype(result.gradients[0].first), Eigen::MatrixXf>);
    for (std::size_t i = 0; i < 2; ++i)
      pf.require_matches(i, result.gradients[i].first.data(), false, "Ref<const MatrixXf>");
  }
  {
    const auto tg = make_tower_grads(pd, [&](std::size_t k, std::size_t i) {
      return Eigen::Ref<Eigen::VectorXd>(Eigen::Map<Eigen::VectorXd>(pd.data(k, i), rows_d(i)));
    });
    const auto result = gradavg::average_gradients(tg, gradavg::include_square);
    static_assert(std::is_same_v<decltype(result.gradients[0].first), Eigen::VectorXd>);
    static_assert(std::is_same_v<decltype(result.squares[0].first), Eigen::VectorXd>);
    for (std::size_t i = 0; i < 2; ++i) {
      pd.require_matches(i, result.gradients[i].first.data(), false, "Ref<VectorXd>");
      pd.require_matches(i, result.squares[i].first.data(), true, "Ref<VectorXd>");
    }
    // Ref<VectorXd> outputs too, over maps at misaligned starts.
    auto mean_bufs = output_buffers(pd, 1), square_bufs = output_buffers(pd, 2);
    std::vector<Eigen::Ref<Eigen::VectorXd>> means, squares;
    for (std::size_t i = 0; i < 2; ++i) {
      means.emplace_back(Eigen::Map<Eigen::VectorXd>(mean_bufs[i].data(), rows_d(i)));
      squares.emplace_back(Eigen::Map<Eigen::VectorXd>(square_bufs[i].data(), rows_d(i)));
    }
    check_into(pd, gradavg::average_gradients_into(tg, means, squares), mean_bufs, &square_bufs,
               "Ref<VectorXd> into Ref<VectorXd>");
  }
  {
    const auto tg = make_tower_grads(
        pd, [&](std::size_t k, std::size_t i) { return Eigen::Map<const Eigen::ArrayXd>(pd.data(k, i), rows_d(i)); });
    const auto result = gradavg::average_gradients(tg);
    static_assert(std::is_same_v<decltype(result.gradients[0].first), Eigen::ArrayXd>);
    for (std::size_t i = 0; i < 2; ++i)
      pd.require_matches(i, result.gradients[i].first.data(), false, "Map<const ArrayXd>");
  }
  // Explicit Tensor argument: documents the call, same result.
  {
    using G = Eigen::Map<const Eigen::VectorXf>;
    const auto tg = make_tower_grads(pf, [&](std::size_t k, std::size_t i) { return G(pf.data(k, i), rows_f(i)); });
    const auto result = gradavg::average_gradients<G>(tg);
    static_assert(std::is_same_v<decltype(result.gradients[0].first), Eigen::VectorXf>);
    for (std::size_t i = 0; i < 2; ++i)
      pf.require_matches(i, result.gradients[i].first.data(), false, "average_gradients<Map<const VectorXf>>");
  }
}

TEMPLATE_TEST_CASE("Eigen: variables pair with their means, variables absent on every tower are skipped",
                   "[eigen][dense][variables]", float, double) {
  using S = TestType;
  using V = VecX<S>;
  const std::size_t T = 3;
  // Variables 1 and 3 have no gradient on any tower.
  problem<S> p({{5, 1}, {2, 1}, {1000, 1}, {3, 1}, {17, 1}}, T, 1, seed_of(5, T, 1, 60));
  const std::vector<std::size_t> present{0, 2, 4};
  const auto owned = owned_copies<V>(p);
  const auto tg = make_tower_grads(p, [&](std::size_t k, std::size_t i) -> const V* {
    return (i == 1 || i == 3) ? nullptr : &owned[k][i];
  });

  const auto result = gradavg::average_gradients(tg, gradavg::include_square);
  REQUIRE(result.gradients.size() == present.size());
  REQUIRE(result.squares.size() == present.size());
  for (std::size_t r = 0; r < present.size(); ++r) {
    const std::size_t i = present[r];
    CAPTURE(r, i);
    REQUIRE(result.gradients[r].second == p.names[i]);
    REQUIRE(result.squares[r].second == p.names[i]);
    REQUIRE(result.gradients[r].first.size() == static_cast<Index>(p.shapes[i].size()));
    p.require_matches(i, result.gradients[r].first.data(), false, "skipping");
    p.require_matches(i, result.squares[r].first.data(), true, "skipping");
  }
  REQUIRE(result.skipped.size() == 2);
  REQUIRE(result.skipped[0].index == 1);
  REQUIRE(result.skipped[0].variable == p.names[1]);
  REQUIRE(result.skipped[1].index == 3);
  REQUIRE(result.skipped[1].variable == p.names[3]);

  // Into: skipped variables' outputs may be null (pointers) or anything (maps); left untouched.
  std::vector<buffer<S>> mean_bufs;
  mean_bufs.reserve(5);
  std::vector<Eigen::Map<V>> means;
  std::vector<V> square_store(5);
  std::vector<V*> squares(5, nullptr);
  for (std::size_t i = 0; i < 5; ++i) {
    const Index n = p.shapes[i].rows;
    mean_bufs.emplace_back(static_cast<std::size_t>(n), i % offsets, sentinel<S>);
    means.emplace_back(mean_bufs[i].data(), n);
    if (i != 1 && i != 3) {
      square_store[i].resize(n);
      squares[i] = &square_store[i];
    }
  }
  const auto skipped_before = std::vector{mean_bufs[1].snapshot(), mean_bufs[3].snapshot()};
  const gradavg::summary s = gradavg::average_gradients_into(tg, means, squares);
  REQUIRE(s.averaged == 3);
  REQUIRE(s.skipped == 2);
  for (const std::size_t i : present) {
    p.require_matches(i, mean_bufs[i].data(), false, "into, skipping");
    p.require_matches(i, square_store[i].data(), true, "into, skipping");
    REQUIRE(mean_bufs[i].surroundings_intact());
  }
  REQUIRE(mean_bufs[1].same_as(skipped_before[0]));
  REQUIRE(mean_bufs[3].same_as(skipped_before[1]));
}
