// The caller's x87 (long double) arithmetic after every call: see x87_check.hpp. Every API
// (_into with means, with means and squares; the allocating call with and without
// include_square) is called with and without a skipped variable, for float, double, Eigen::half
// and Eigen::bfloat16 gradients, static and run-time element types, plain and fused options, on
// one thread and on an executor's threads; x87 arithmetic of known result follows each call, on
// every thread that ran part of it. tests/CMakeLists.txt builds this file at the native level
// and at baseline x86-64 (test_x87_baseline); the no_mmx checks disassemble both.
#include <gradavg/eigen.hpp>
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "x87_check.hpp"

namespace {

using gradavg_test::check_x87_after;
using gradavg_test::x87_intact;

/// A thread_pool that checks x87 arithmetic on whichever thread ran a task, after the task.
class x87_checking_pool final : public gradavg::executor {
 public:
  explicit x87_checking_pool(std::size_t threads) : pool_(threads) {}

  [[nodiscard]] std::size_t concurrency() const noexcept override { return pool_.concurrency(); }
  void parallel_for(std::size_t n, gradavg::task_ref task) override {
    auto checked = [&](std::size_t i) {
      task(i);
      if (!x87_intact()) failures_.fetch_add(1, std::memory_order_relaxed);
      tasks_.fetch_add(1, std::memory_order_relaxed);
    };
    pool_.parallel_for(n, gradavg::task_ref(checked));
  }
  [[nodiscard]] std::size_t failures() const noexcept { return failures_.load(); }
  [[nodiscard]] std::size_t tasks() const noexcept { return tasks_.load(); }

 private:
  gradavg::thread_pool pool_;
  std::atomic<std::size_t> failures_{0};
  std::atomic<std::size_t> tasks_{0};
};

}  // namespace

// ---- A tensor whose element type is known at run time only. --------------------------------

namespace user {

struct dynamic_tensor {
  gradavg::element_type dtype = gradavg::element_type::float32;
  std::vector<std::int64_t> dims;
  std::vector<double> storage;  // 8-byte aligned room for the elements, of whichever type
};

}  // namespace user

template <>
struct gradavg::tensor_traits<user::dynamic_tensor> {
  using T = user::dynamic_tensor;
  using value_type = gradavg::dynamic_element;
  using result_type = user::dynamic_tensor;
  static gradavg::element_type element(const T& t) { return t.dtype; }
  static const void* data(const T& t) { return t.storage.data(); }
  static void* mutable_data(T& t) { return t.storage.data(); }
  static gradavg::shape shape(const T& t) { return gradavg::shape::from_dims(t.dims); }
  static result_type make(const gradavg::shape& s, gradavg::element_type e) {
    user::dynamic_tensor t;
    t.dtype = e;
    t.dims.assign(s.dims.begin(), s.dims.begin() + static_cast<std::ptrdiff_t>(s.rank));
    t.storage.resize(s.size() + 1);
    return t;
  }
};

namespace {

using half = Eigen::half;
using bf16 = Eigen::bfloat16;
template <class S>
using matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;

constexpr std::size_t tower_count = 3;
constexpr std::int64_t rows = 4, cols = 3;  // the second variable's shape
constexpr std::size_t first_size = 37;      // the first variable's element count

/// Small multiples of 1/4, exact in every element type.
template <class S>
std::vector<S> values_of(std::size_t n, std::size_t seed) {
  std::vector<S> v(n);
  for (std::size_t j = 0; j < n; ++j) v[j] = S(static_cast<float>((j + 3 * seed) % 9) * 0.25f - 1.0f);
  return v;
}

/// The option sets every API is called with: plain, and the fused step's features.
struct option_set {
  std::string name;
  gradavg::options opts;
};

std::vector<option_set> option_sets() {
  static const std::vector<double> weights{1, 2, 3};
  std::vector<option_set> sets(5);
  sets[0].name = "default options";
  sets[1].name = "weights, scale, statistics, non-finite reported";
  sets[1].opts.compute.weights = weights;
  sets[1].opts.compute.scale = 0.5;
  sets[1].opts.compute.statistics = true;
  sets[1].opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
  sets[2].name = "non-finite zeroed, double accumulation, streaming stores";
  sets[2].opts.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  sets[2].opts.compute.accumulate = gradavg::accumulation::double_precision;
  sets[2].opts.run.stores = gradavg::store_policy::streaming;
  sets[3].name = "overlaps checked within each variable";
  sets[3].opts.check.aliasing = gradavg::alias_check::same_variable;
  sets[4].name = "no overlap check";
  sets[4].opts.check.aliasing = gradavg::alias_check::none;
  return sets;
}

/// Calls every API on tg (variables: first_size elements, the skipped one when `skipped`, rows x
/// cols) with every option set, outputs of element type O in std::span, checking x87 arithmetic
/// after each call.
template <class O, class TG>
void call_every_api(const TG& tg, bool skipped, const std::string& what) {
  const std::size_t variables = skipped ? 3 : 2;
  const std::size_t last = variables - 1;
  std::vector<O> m0(first_size), q0(first_size), m1(rows * cols), q1(rows * cols);
  std::vector<std::span<O>> means(variables), squares(variables);  // empty for the skipped one
  means[0] = m0;
  squares[0] = q0;
  means[last] = m1;
  squares[last] = q1;

  for (option_set& set : option_sets()) {
    const std::string context = what + (skipped ? ", a skipped variable, " : ", none skipped, ") + set.name;
    std::vector<gradavg::variable_statistics> per_variable(variables);
    if (set.opts.compute.statistics) set.opts.compute.per_variable = per_variable;

    const gradavg::summary s1 = gradavg::average_gradients_into(tg, means, set.opts);
    check_x87_after("average_gradients_into(means): " + context);
    CHECK(s1.skipped == (skipped ? 1u : 0u));
    const gradavg::summary s2 = gradavg::average_gradients_into(tg, means, squares, set.opts);
    check_x87_after("average_gradients_into(means, squares): " + context);
    CHECK(s2.averaged == 2);
    gradavg::plan plan;  // the first call proves, the second runs on the proof
    for (int call = 0; call < 2; ++call) {
      CHECK(gradavg::average_gradients_into(plan, tg, means, squares, set.opts).averaged == 2);
      check_x87_after("average_gradients_into(plan, means, squares), call " + std::to_string(call) + ": " + context);
    }
    if (set.opts.compute.statistics) {
      CHECK(s2.global_norm() >= 0);
      check_x87_after("summary::global_norm(): " + context);
    }

    const gradavg::options& allocating = set.opts;
    const auto r1 = gradavg::average_gradients(tg, allocating);
    check_x87_after("average_gradients: " + context);
    CHECK(r1.gradients.size() == 2);
    const auto r2 = gradavg::average_gradients(tg, gradavg::include_square, allocating);
    check_x87_after("average_gradients with include_square: " + context);
    CHECK(r2.squares.size() == 2);
    CHECK(r2.skipped.size() == (skipped ? 1u : 0u));
  }

  // A part of the flat range, and a call that throws (an output missing for a present variable).
  gradavg::options range;
  range.compute.range = {5, 20};
  gradavg::average_gradients_into(tg, means, squares, range);
  check_x87_after("average_gradients_into(means, squares) over options.compute.range: " + what);
  std::vector<std::span<O>> missing = means;
  missing[last] = {};
  CHECK_THROWS_AS(gradavg::average_gradients_into(tg, missing, squares), gradavg::output_error);
  check_x87_after("average_gradients_into throwing output_error: " + what);
}

/// Gradients of element type S on tower_count towers, held in std::vector and Eigen::Matrix.
template <class S>
struct gradients {
  std::vector<std::vector<S>> first, second;  // [tower]
  std::vector<matrix<S>> first_m, second_m;

  gradients() {
    for (std::size_t k = 0; k < tower_count; ++k) {
      first.push_back(values_of<S>(first_size, k));
      second.push_back(values_of<S>(rows * cols, k + 7));
      first_m.push_back(Eigen::Map<const matrix<S>>(first[k].data(), first_size, 1));
      second_m.push_back(Eigen::Map<const matrix<S>>(second[k].data(), rows, cols));
    }
  }

  /// (pointer, name) entries; the skipped variable's gradient is null on every tower.
  template <class G, class V>
  static std::vector<std::vector<std::pair<const G*, V>>> towers_of(const std::vector<G>& a, const std::vector<G>& b,
                                                                     bool skipped, V name_a, V name_skipped, V name_b) {
    std::vector<std::vector<std::pair<const G*, V>>> tg(tower_count);
    for (std::size_t k = 0; k < tower_count; ++k) {
      tg[k].push_back({&a[k], name_a});
      if (skipped) tg[k].push_back({nullptr, name_skipped});
      tg[k].push_back({&b[k], name_b});
    }
    return tg;
  }
};

/// Every API over std::vector and Eigen::Matrix gradients of element type S, into outputs of S
/// (and of float for 16-bit S), with and without a skipped variable.
template <class S>
void check_static(const std::string& type) {
  const gradients<S> g;
  for (const bool skipped : {true, false}) {
    const auto tv = gradients<S>::towers_of(g.first, g.second, skipped, std::string("a"), std::string("frozen"),
                                             std::string("c"));
    const auto tm = gradients<S>::towers_of(g.first_m, g.second_m, skipped, 0, 1, 2);
    call_every_api<S>(tv, skipped, type + " std::vector");
    call_every_api<S>(tm, skipped, type + " Eigen::Matrix");
    if constexpr (!std::is_same_v<S, float> && !std::is_same_v<S, double>) {
      call_every_api<float>(tv, skipped, type + " std::vector into float");
      call_every_api<float>(tm, skipped, type + " Eigen::Matrix into float");
    }

    // Eigen::Map outputs (a null map for the skipped variable).
    matrix<S> m0(first_size, 1), q0(first_size, 1), m1(rows, cols), q1(rows, cols);
    std::vector<Eigen::Map<matrix<S>>> means, squares;
    means.emplace_back(m0.data(), first_size, 1);
    squares.emplace_back(q0.data(), first_size, 1);
    if (skipped) {
      means.emplace_back(nullptr, 0, 0);
      squares.emplace_back(nullptr, 0, 0);
    }
    means.emplace_back(m1.data(), rows, cols);
    squares.emplace_back(q1.data(), rows, cols);
    gradavg::average_gradients_into(tm, means, squares);
    check_x87_after("average_gradients_into(means, squares) into Eigen::Map: " + type);
    gradavg::average_gradients_into(tm, means);
    check_x87_after("average_gradients_into(means) into Eigen::Map: " + type);
  }
}

}  // namespace

TEST_CASE("x87 arithmetic after every call: float gradients") { check_static<float>("float"); }
TEST_CASE("x87 arithmetic after every call: double gradients") { check_static<double>("double"); }
TEST_CASE("x87 arithmetic after every call: Eigen::half gradients") { check_static<half>("Eigen::half"); }
TEST_CASE("x87 arithmetic after every call: Eigen::bfloat16 gradients") { check_static<bf16>("Eigen::bfloat16"); }

namespace {

template <class S>
user::dynamic_tensor dynamic_of(const std::vector<S>& values, std::vector<std::int64_t> dims, gradavg::element_type e) {
  user::dynamic_tensor t;
  t.dtype = e;
  t.dims = std::move(dims);
  t.storage.resize((values.size() * sizeof(S) + 7) / 8 + 1);
  if (!values.empty()) std::memcpy(t.storage.data(), values.data(), values.size() * sizeof(S));
  return t;
}

/// Every API over run-time-typed gradients of element type S (into run-time-typed outputs of the
/// same type, and of float for 16-bit S), with and without a skipped variable.
template <class S>
void check_dynamic(gradavg::element_type e, const std::string& type) {
  const gradients<S> g;
  std::vector<user::dynamic_tensor> a, b;
  for (std::size_t k = 0; k < tower_count; ++k) {
    a.push_back(dynamic_of(g.first[k], {static_cast<std::int64_t>(first_size)}, e));
    b.push_back(dynamic_of(g.second[k], {rows, cols}, e));
  }
  std::vector<gradavg::element_type> outputs{e};
  if (e == gradavg::element_type::float16 || e == gradavg::element_type::bfloat16)
    outputs.push_back(gradavg::element_type::float32);
  for (const bool skipped : {true, false}) {
    const auto tg = gradients<S>::towers_of(a, b, skipped, std::string("a"), std::string("frozen"), std::string("c"));
    const std::string context = type + " run-time typed" + (skipped ? ", a skipped variable" : ", none skipped");
    for (const gradavg::element_type o : outputs) {
      std::vector<user::dynamic_tensor> means, squares;
      means.push_back(dynamic_of(std::vector<double>(first_size), {static_cast<std::int64_t>(first_size)}, o));
      if (skipped) means.push_back(dynamic_of(std::vector<double>(), {0}, o));
      means.push_back(dynamic_of(std::vector<double>(rows * cols), {rows, cols}, o));  // room for any type
      squares = means;
      const std::string into = context + ", outputs " + std::string(gradavg::element_name(o));
      gradavg::average_gradients_into(tg, means);
      check_x87_after("average_gradients_into(means): " + into);
      gradavg::average_gradients_into(tg, means, squares);
      check_x87_after("average_gradients_into(means, squares): " + into);
      gradavg::options fused;
      fused.compute.statistics = true;
      fused.compute.on_nonfinite = gradavg::nonfinite_policy::report;
      fused.compute.scale = 2;
      gradavg::average_gradients_into(tg, means, squares, fused);
      check_x87_after("average_gradients_into(means, squares) with fused options: " + into);
    }
    CHECK(gradavg::average_gradients(tg).gradients.size() == 2);
    check_x87_after("average_gradients: " + context);
    CHECK(gradavg::average_gradients(tg, gradavg::include_square).squares.size() == 2);
    check_x87_after("average_gradients with include_square: " + context);
  }
}

}  // namespace

TEST_CASE("x87 arithmetic after every call: run-time element types") {
  check_dynamic<float>(gradavg::element_type::float32, "float32");
  check_dynamic<double>(gradavg::element_type::float64, "float64");
  check_dynamic<half>(gradavg::element_type::float16, "float16");
  check_dynamic<bf16>(gradavg::element_type::bfloat16, "bfloat16");
}

TEST_CASE("x87 arithmetic on every thread that ran part of a call") {
  // Two variables of 2^19 floats (2 MiB per tower): enough for the call to split into chunks.
  constexpr std::size_t n = std::size_t{1} << 19;
  std::vector<std::vector<float>> a, b;
  for (std::size_t k = 0; k < tower_count; ++k) {
    a.push_back(values_of<float>(n, k));
    b.push_back(values_of<float>(n, k + 5));
  }
  x87_checking_pool pool(2);
  gradavg::options opts;
  opts.run.pool = &pool;
  opts.compute.statistics = true;
  for (const bool skipped : {true, false}) {
    const auto tg = gradients<float>::towers_of(a, b, skipped, 0, 1, 2);
    const std::size_t variables = skipped ? 3 : 2;
    std::vector<float> m0(n), m1(n), q0(n), q1(n);
    std::vector<std::span<float>> means(variables), squares(variables);
    means.front() = m0;
    means.back() = m1;
    squares.front() = q0;
    squares.back() = q1;
    const std::size_t before = pool.tasks();
    gradavg::average_gradients_into(tg, means, squares, opts);
    check_x87_after(std::string("average_gradients_into on a pool") + (skipped ? ", a skipped variable" : ""));
    const auto r = gradavg::average_gradients(tg, opts);
    check_x87_after(std::string("average_gradients on a pool") + (skipped ? ", a skipped variable" : ""));
    CHECK(r.gradients.size() == 2);
    CHECK(pool.tasks() - before >= 4);  // each call ran in chunks
  }
  CHECK(pool.failures() == 0);  // x87 arithmetic after each task, on the thread that ran it
}
