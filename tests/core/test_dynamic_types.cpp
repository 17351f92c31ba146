// Tensor types whose element type is known at run time only (tensor_traits::element), the rank
// limit (shape::from_dims), and the traits contract: errors of tensor_traits functions re-raised
// naming the variable, other exceptions reaching the caller unchanged with nothing written.
#include <gradavg/gradavg.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"

namespace user {

/// A framework tensor with a run-time element type, possibly undefined, whose adapter can be
/// made to throw from one of its functions.
struct any_tensor {
  gradavg::element_type dtype = gradavg::element_type::float32;
  bool integer = false;  // an int32 tensor: not something gradavg reads
  bool defined = true;
  std::vector<std::int64_t> dims;
  std::vector<double> storage;  // 8-byte aligned room for the elements, of whichever type
  const char* fail = nullptr;   // name of the traits function that throws std::runtime_error
  const std::thread::id* only_on = nullptr;  // when set, data() throws on any other thread
  bool adapter_error = false;                // shape() throws a gradavg::weight_error naming no variable
};

template <class S>
gradavg::element_type element_of() {
  if constexpr (std::is_same_v<S, double>) return gradavg::element_type::float64;
  if constexpr (std::is_same_v<S, Eigen::half>) return gradavg::element_type::float16;
  if constexpr (std::is_same_v<S, Eigen::bfloat16>) return gradavg::element_type::bfloat16;
  return gradavg::element_type::float32;
}

template <class S>
any_tensor make_tensor(const std::vector<S>& values, std::vector<std::int64_t> dims) {
  any_tensor t;
  t.dtype = element_of<S>();
  t.dims = std::move(dims);
  t.storage.resize((values.size() * sizeof(S) + 7) / 8 + 1);
  std::memcpy(t.storage.data(), values.data(), values.size() * sizeof(S));
  return t;
}

template <class S>
const S* elements(const any_tensor& t) {
  return reinterpret_cast<const S*>(t.storage.data());
}

inline void maybe_fail(const any_tensor& t, const char* function) {
  if (t.fail != nullptr && std::strcmp(t.fail, function) == 0)
    throw std::runtime_error(std::string("user: ") + function + " failed");
  if (t.only_on != nullptr && std::strcmp(function, "data") == 0 && std::this_thread::get_id() != *t.only_on)
    throw std::runtime_error("user: data on another thread");
}

}  // namespace user

template <>
struct gradavg::tensor_traits<user::any_tensor> {
  using T = user::any_tensor;
  using value_type = gradavg::dynamic_element;
  using result_type = user::any_tensor;
  static bool present(const T& t) {
    user::maybe_fail(t, "present");
    return t.defined;
  }
  static gradavg::element_type element(const T& t) {
    user::maybe_fail(t, "element");
    if (t.integer) throw gradavg::element_type_error("gradavg: an int32 tensor; gradavg reads floating-point ones");
    return t.dtype;
  }
  static const void* data(const T& t) {
    user::maybe_fail(t, "data");
    return t.storage.data();
  }
  static void* mutable_data(T& t) {
    user::maybe_fail(t, "mutable_data");
    return t.storage.data();
  }
  static gradavg::shape shape(const T& t) {
    user::maybe_fail(t, "shape");
    if (t.adapter_error) throw gradavg::weight_error("gradavg: an adapter's error of a derived type");
    return gradavg::shape::from_dims(t.dims);
  }
  static result_type make(const gradavg::shape& s, gradavg::element_type e) {
    user::any_tensor t;
    t.dtype = e;
    t.dims.assign(s.dims.begin(), s.dims.begin() + static_cast<std::ptrdiff_t>(s.rank));
    t.storage.resize(s.size() + 1);
    return t;
  }
};

namespace user {

/// A run-time typed view of caller-owned memory: buffers of one call may lie next to each other.
struct typed_view {
  void* data;
  gradavg::element_type dtype;
  std::int64_t size;
};

}  // namespace user

template <>
struct gradavg::tensor_traits<user::typed_view> {
  using T = user::typed_view;
  using value_type = gradavg::dynamic_element;
  using result_type = user::any_tensor;
  static gradavg::element_type element(const T& t) { return t.dtype; }
  static const void* data(const T& t) { return t.data; }
  static void* mutable_data(T& t) { return t.data; }
  static gradavg::shape shape(const T& t) { return gradavg::shape::from_dims(std::vector<std::int64_t>{t.size}); }
  static result_type make(const gradavg::shape& s, gradavg::element_type e) {
    return gradavg::tensor_traits<user::any_tensor>::make(s, e);
  }
};

namespace {

using user::any_tensor;
using tower = std::vector<std::pair<any_tensor*, std::string>>;

/// towers[k][i] = &grads[k][i], named "v<i>".
std::vector<tower> towers_of(std::vector<std::vector<any_tensor>>& grads) {
  std::vector<tower> tg(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k)
    for (std::size_t i = 0; i < grads[k].size(); ++i) tg[k].push_back({&grads[k][i], "v" + std::to_string(i)});
  return tg;
}

/// Variables of 7 and 3x5 elements on `towers` towers, random values of S.
template <class S>
std::vector<std::vector<S>> random_gradients(std::size_t towers, std::uint32_t seed) {
  std::vector<std::vector<S>> v;
  for (std::size_t k = 0; k < towers; ++k) {
    v.push_back(gradavg_test::random_values<S>(7, seed + static_cast<std::uint32_t>(2 * k)));
    v.push_back(gradavg_test::random_values<S>(15, seed + static_cast<std::uint32_t>(2 * k + 1)));
  }
  return v;
}

template <class S>
std::vector<std::vector<any_tensor>> tensors_of(const std::vector<std::vector<S>>& values, std::size_t towers) {
  std::vector<std::vector<any_tensor>> grads(towers);
  for (std::size_t k = 0; k < towers; ++k) {
    grads[k].push_back(user::make_tensor(values[2 * k], {7}));
    grads[k].push_back(user::make_tensor(values[2 * k + 1], {3, 5}));
  }
  return grads;
}

/// Outputs of element type O for the two variables, filled with a sentinel.
template <class O>
std::vector<any_tensor> outputs_of() {
  return {user::make_tensor(std::vector<O>(7, O(-7)), {7}), user::make_tensor(std::vector<O>(15, O(-7)), {3, 5})};
}

/// The same call on std::span gradients (the static path) into std::vector<O> outputs.
template <class S, class O>
std::vector<std::vector<O>> static_means(const std::vector<std::vector<S>>& values, std::size_t towers,
                                         const gradavg::options& opts) {
  std::vector<std::vector<std::pair<std::span<const S>, int>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < 2; ++i) tg[k].push_back({std::span<const S>(values[2 * k + i]), static_cast<int>(i)});
  std::vector<std::vector<O>> means{std::vector<O>(7), std::vector<O>(15)};
  gradavg::average_gradients_into(tg, means, opts);
  return means;
}

template <class S>
bool storage_unchanged(const std::vector<any_tensor>& a, const std::vector<any_tensor>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].storage != b[i].storage) return false;
  return true;
}

/// Checks the dynamic call against the independent reference and, bit for bit, the static path.
template <class S, class O>
void check_element_type(std::size_t threads) {
  const std::size_t towers = 3;
  const auto values = random_gradients<S>(towers, 11);
  auto grads = tensors_of(values, towers);
  auto means = outputs_of<O>();
  const gradavg::options opts{.run = {.threads = threads}};
  const gradavg::summary s = gradavg::average_gradients_into(towers_of(grads), means, opts);
  CHECK(s.averaged == 2);
  const auto want = static_means<S, O>(values, towers, opts);
  for (std::size_t i = 0; i < 2; ++i) {
    INFO("variable " << i);
    CHECK(gradavg_test::same_bits(user::elements<O>(means[i]), want[i].data(), want[i].size()));
    std::vector<const S*> ptrs;
    for (std::size_t k = 0; k < towers; ++k) ptrs.push_back(values[2 * k + i].data());
    const gradavg_test::reference<S> ref(ptrs, want[i].size());
    const auto scale = gradavg_test::magnitude<S>(ptrs, want[i].size(), false);
    // Summed in float (16-bit gradients too) or double; a 16-bit output adds its own rounding,
    // at most one ulp relative to the mean (2^-10 for float16, 2^-7 for bfloat16).
    const double output_ulp = std::is_same_v<O, Eigen::half> ? 0x1p-10 : std::is_same_v<O, Eigen::bfloat16> ? 0x1p-7 : 0.0;
    const double sum_tol =
        std::is_same_v<S, double> ? gradavg_test::tolerance<double>(towers) : gradavg_test::tolerance<float>(towers);
    for (std::size_t j = 0; j < want[i].size(); ++j) {
      const double got = static_cast<double>(user::elements<O>(means[i])[j]);
      const double tol_native = sum_tol * scale[j] + output_ulp * std::abs(ref.mean[j]);
      CHECK(std::abs(got - ref.mean[j]) <= tol_native);
    }
  }
}

}  // namespace

TEST_CASE("run-time element types: every type, the same bits as the static path") {
  STATIC_REQUIRE(gradavg::dynamic_tensor<any_tensor>);
  STATIC_REQUIRE(gradavg::tensor<any_tensor>);
  STATIC_REQUIRE(gradavg::writable_tensor<any_tensor>);
  STATIC_REQUIRE(gradavg::resultable_tensor<any_tensor>);
  for (std::size_t threads : {1u, 2u}) {
    INFO("threads " << threads);
    check_element_type<float, float>(threads);
    check_element_type<double, double>(threads);
    check_element_type<Eigen::half, Eigen::half>(threads);
    check_element_type<Eigen::half, float>(threads);
    check_element_type<Eigen::bfloat16, Eigen::bfloat16>(threads);
    check_element_type<Eigen::bfloat16, float>(threads);
  }
}

TEST_CASE("run-time element types: the allocating API returns results of the gradients' type") {
  const std::size_t towers = 4;
  const auto values = random_gradients<Eigen::bfloat16>(towers, 5);
  auto grads = tensors_of(values, towers);
  const auto r = gradavg::average_gradients(towers_of(grads), gradavg::include_square);
  REQUIRE(r.gradients.size() == 2);
  REQUIRE(r.squares.size() == 2);
  const auto want = static_means<Eigen::bfloat16, Eigen::bfloat16>(values, towers, {});
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(r.gradients[i].first.dtype == gradavg::element_type::bfloat16);
    CHECK(r.gradients[i].first.dims == grads[0][i].dims);
    CHECK(r.gradients[i].second == "v" + std::to_string(i));
    CHECK(gradavg_test::same_bits(user::elements<Eigen::bfloat16>(r.gradients[i].first), want[i].data(), want[i].size()));
  }
}

TEST_CASE("run-time element types: static outputs take dynamic gradients of their type") {
  const std::size_t towers = 3;
  const auto values = random_gradients<float>(towers, 21);
  auto grads = tensors_of(values, towers);
  std::vector<std::vector<float>> means{std::vector<float>(7), std::vector<float>(15)};
  gradavg::average_gradients_into(towers_of(grads), means);
  CHECK(means == static_means<float, float>(values, towers, {}));

  std::vector<std::vector<double>> wrong{std::vector<double>(7, -1.0), std::vector<double>(15, -1.0)};
  const auto e = gradavg_test::exception_of<gradavg::output_error>(
      [&] { gradavg::average_gradients_into(towers_of(grads), wrong); });
  CHECK(e.variable_index() == 0);
  CHECK(std::string(e.what()) == "variable #0 'v0': the means output is float64 but the gradients are float32; "
                                 "outputs hold the gradients' element type (or float32 for 16-bit gradients)");
  CHECK(wrong[0] == std::vector<double>(7, -1.0));
}

TEST_CASE("run-time element types: one element type per call, checked before anything is written") {
  const std::size_t towers = 3;
  auto grads = tensors_of(random_gradients<float>(towers, 3), towers);
  auto means = outputs_of<float>();
  auto before = means;

  SECTION("a tower whose gradient has another type than the same variable's on tower 0") {
    grads[2][1] = user::make_tensor(gradavg_test::random_values<double>(15, 1), {3, 5});
    const auto e = gradavg_test::exception_of<gradavg::element_type_error>(
        [&] { gradavg::average_gradients_into(towers_of(grads), means); });
    CHECK(e.variable_index() == 1);
    CHECK(std::string(e.what()) ==
          "variable #1 'v1': gradient on tower 2 is float64 but on tower 0 is float32; every gradient of one call "
          "must have the same element type (convert, or average each element type in a call of its own)");
  }
  SECTION("a variable whose gradients have another type than an earlier variable's") {
    for (std::size_t k = 0; k < towers; ++k)
      grads[k][1] = user::make_tensor(gradavg_test::random_values<Eigen::half>(15, 1), {3, 5});
    const auto e = gradavg_test::exception_of<gradavg::element_type_error>(
        [&] { gradavg::average_gradients_into(towers_of(grads), means); });
    CHECK(e.variable_index() == 1);
    CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': gradient on tower 0 is float16 but variable #0 'v0''s "
                                           "gradient on tower 0 is float32"));
  }
  SECTION("an output of another type than the gradients'") {
    means[1] = user::make_tensor(std::vector<double>(15, -7.0), {3, 5});
    before[1] = means[1];
    const auto e = gradavg_test::exception_of<gradavg::output_error>(
        [&] { gradavg::average_gradients_into(towers_of(grads), means); });
    CHECK(e.variable_index() == 1);
    CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': the means output is float64 but the gradients are float32"));
  }
  SECTION("outputs of two types for 16-bit gradients (each alone would do)") {
    grads = tensors_of(random_gradients<Eigen::half>(towers, 3), towers);
    auto mixed = outputs_of<Eigen::half>();
    mixed[1] = outputs_of<float>()[1];
    const auto mixed_before = mixed;
    const auto e = gradavg_test::exception_of<gradavg::output_error>(
        [&] { gradavg::average_gradients_into(towers_of(grads), mixed); });
    CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': the means output is float32 but the means output of "
                                           "variable #0 'v0' is float16"));
    CHECK(storage_unchanged<float>(mixed, mixed_before));
  }
  SECTION("an element type the adapter does not read: its error, naming the variable and tower") {
    grads[1][0].integer = true;
    const auto e = gradavg_test::exception_of<gradavg::element_type_error>(
        [&] { gradavg::average_gradients_into(towers_of(grads), means); });
    CHECK(e.variable_index() == 0);
    CHECK(std::string(e.what()) ==
          "variable #0 'v0': gradient on tower 1: an int32 tensor; gradavg reads floating-point ones");
    // The allocating API too.
    CHECK_THROWS_AS(gradavg::average_gradients(towers_of(grads)), gradavg::element_type_error);
  }
  CHECK(storage_unchanged<float>(means, before));
}

TEST_CASE("run-time element types: undefined gradients are absent") {
  const std::size_t towers = 3;
  auto grads = tensors_of(random_gradients<double>(towers, 8), towers);
  for (std::size_t k = 0; k < towers; ++k) grads[k][0].defined = false;
  auto means = outputs_of<double>();
  means[0].defined = false;  // a skipped variable's output is not read
  const auto s = gradavg::average_gradients_into(towers_of(grads), means);
  CHECK(s.averaged == 1);
  CHECK(s.skipped == 1);

  // Undefined everywhere: nothing is read, whatever the outputs hold.
  for (std::size_t k = 0; k < towers; ++k) grads[k][1].defined = false;
  auto untouched = outputs_of<float>();
  const auto before = untouched;
  CHECK(gradavg::average_gradients_into(towers_of(grads), untouched).skipped == 2);
  CHECK(storage_unchanged<float>(untouched, before));
  CHECK(gradavg::average_gradients(towers_of(grads)).skipped.size() == 2);

  // Undefined on tower 2 only: the seed's error.
  grads = tensors_of(random_gradients<double>(towers, 8), towers);
  grads[2][1].defined = false;
  const auto e = gradavg_test::exception_of<gradavg::missing_gradient_error>(
      [&] { gradavg::average_gradients_into(towers_of(grads), means); });
  CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': gradient missing on tower 2 but present on towers 0 and 1 "
                                         "(2 of 3 towers)"));
}

TEST_CASE("the rank limit: shape::from_dims throws a shape_error, re-raised naming the variable and tower") {
  const std::vector<std::int64_t> nine(9, 1);
  const auto direct = gradavg_test::exception_of<gradavg::shape_error>([&] { (void)gradavg::shape::from_dims(nine); });
  CHECK(std::string(direct.what()) ==
        "a tensor of rank 9; gradavg reads tensors of rank 8 (shape::max_rank) at most: pass a reshaped view");
  CHECK(direct.variable_index() == gradavg::error::npos);
  const std::vector<std::int64_t> eight{1, 2, 1, 3, 1, 1, 1, 4};
  const gradavg::shape s = gradavg::shape::from_dims(eight, gradavg::storage_order::col_major);
  CHECK(s.rank == 8);
  CHECK(s.size() == 24);
  CHECK(s.order == gradavg::storage_order::col_major);
  CHECK_THROWS_AS(gradavg::shape::from_dims(std::vector<std::int64_t>{3, -1}), gradavg::shape_error);

  const std::size_t towers = 3;
  auto grads = tensors_of(random_gradients<float>(towers, 3), towers);
  grads[2][1].dims = {1, 1, 1, 3, 1, 1, 5, 1, 1};
  auto means = outputs_of<float>();
  const auto before = means;
  const auto e = gradavg_test::exception_of<gradavg::shape_error>(
      [&] { gradavg::average_gradients_into(towers_of(grads), means); });
  CHECK(e.variable_index() == 1);
  CHECK(std::string(e.what()) == "variable #1 'v1': gradient on tower 2: a tensor of rank 9; gradavg reads tensors "
                                 "of rank 8 (shape::max_rank) at most: pass a reshaped view");
  CHECK(storage_unchanged<float>(means, before));
  CHECK_THROWS_AS(gradavg::average_gradients(towers_of(grads)), gradavg::shape_error);
}

TEST_CASE("an exception from any tensor_traits function reaches the caller unchanged, nothing written") {
  // 2 variables: 7 elements, and 3x5.
  const std::size_t towers = 3;
  for (const char* function : {"present", "element", "data", "shape", "mutable_data"}) {
    for (std::size_t threads : {1u, 2u}) {
      for (auto aliasing : {gradavg::alias_check::all, gradavg::alias_check::same_variable, gradavg::alias_check::none}) {
        for (std::size_t tower : {0u, 2u}) {
          INFO(function << ", threads " << threads << ", aliasing " << static_cast<int>(aliasing) << ", tower " << tower);
          auto grads = tensors_of(random_gradients<float>(towers, 3), towers);
          auto means = outputs_of<float>();
          if (std::strcmp(function, "mutable_data") == 0)
            means[1].fail = function;
          else
            grads[tower][1].fail = function;
          const auto before = means;
          const std::string message = gradavg_test::message_of<std::runtime_error>([&] {
            gradavg::average_gradients_into(towers_of(grads), means, {.run = {.threads = threads}, .check = {.aliasing = aliasing}});
          });
          CHECK(message == std::string("user: ") + function + " failed");
          CHECK(storage_unchanged<float>(means, before));
          if (std::strcmp(function, "mutable_data") != 0) {
            CHECK(gradavg_test::message_of<std::runtime_error>([&] {
                    (void)gradavg::average_gradients(towers_of(grads), {.run = {.threads = threads}});
                  }) == message);
          }
        }
      }
    }
  }
}

TEST_CASE("the pass calls no tensor_traits function: on worker threads it reads the checks' table") {
  // More than 256 buffers, so the checks keep their table on the heap. 2 towers, a variable of
  // 2^20 floats split between 2 threads and 99 of one float; data() throws off the caller's
  // thread, so a worker that read a gradient through its traits would throw.
  const std::int64_t n = std::int64_t{1} << 20;
  const std::size_t variables = 100;
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<std::vector<any_tensor>> grads(2);
  for (std::size_t i = 0; i < variables; ++i) {
    const std::int64_t size = i == 0 ? n : 1;
    for (std::size_t k = 0; k < 2; ++k) {
      grads[k].push_back(user::make_tensor(std::vector<float>(static_cast<std::size_t>(size), k == 0 ? 1.0f : 3.0f), {size}));
      grads[k].back().only_on = &caller;
    }
  }
  for (const auto check : {gradavg::alias_check::none, gradavg::alias_check::same_variable, gradavg::alias_check::all}) {
    INFO("alias check " << static_cast<int>(check));
    std::vector<any_tensor> means;
    for (std::size_t i = 0; i < variables; ++i) {
      const std::int64_t size = i == 0 ? n : 1;
      means.push_back(user::make_tensor(std::vector<float>(static_cast<std::size_t>(size)), {size}));
    }
    gradavg::average_gradients_into(towers_of(grads), means, {.run = {.threads = 2}, .check = {.aliasing = check}});
    for (std::size_t i = 0; i < variables; ++i) {
      const float* m = user::elements<float>(means[i]);
      CHECK(std::all_of(m, m + (i == 0 ? n : 1), [](float x) { return x == 2.0f; }));
    }
  }
}

TEST_CASE("a gradavg::error of any type from a tensor_traits function keeps its type, naming the variable") {
  // weight_error derives from option_error: the most derived type is kept.
  const std::size_t towers = 3;
  auto grads = tensors_of(random_gradients<float>(towers, 3), towers);
  grads[1][0].adapter_error = true;
  auto means = outputs_of<float>();
  const auto before = means;
  const auto e = gradavg_test::exception_of<gradavg::weight_error>(
      [&] { gradavg::average_gradients_into(towers_of(grads), means); });
  CHECK(e.variable_index() == 0);
  CHECK(std::string(e.what()) == "variable #0 'v0': gradient on tower 1: an adapter's error of a derived type");
  CHECK(storage_unchanged<float>(means, before));
}

TEST_CASE("a plan re-proves the overlaps when the same buffers hold wider elements") {
  // Two float16 gradients of 4 elements on 2 towers; the means outputs of the 2 variables lie
  // next to each other in one buffer: 8 bytes apart, disjoint as float16, overlapping as float32.
  using half = Eigen::half;
  std::vector<half> g{half(1), half(2), half(3), half(4), half(3), half(4), half(5), half(6)};
  alignas(16) std::array<unsigned char, 24> room{};
  const auto view = [](void* p, gradavg::element_type e) { return user::typed_view{p, e, 4}; };
  const gradavg::element_type f16 = gradavg::element_type::float16, f32 = gradavg::element_type::float32;
  std::vector<std::vector<std::pair<user::typed_view, int>>> tg{{{view(&g[0], f16), 0}, {view(&g[4], f16), 1}},
                                                                {{view(&g[4], f16), 0}, {view(&g[0], f16), 1}}};
  std::vector<user::typed_view> means{view(room.data(), f16), view(room.data() + 8, f16)};
  gradavg::plan step;
  for (int s = 0; s < 2; ++s) {
    room.fill(0);
    gradavg::average_gradients_into(step, tg, means);
    const half* m = reinterpret_cast<const half*>(room.data());
    for (std::size_t j = 0; j < 8; ++j) CHECK(static_cast<float>(m[j]) == static_cast<float>(j % 4) + 2.0f);
  }
  CHECK(step.proofs() == 1);
  // The same first bytes and element counts, read as float32 outputs: 16 bytes each.
  means = {view(room.data(), f32), view(room.data() + 8, f32)};
  const auto before = room;
  const auto e = gradavg_test::exception_of<gradavg::aliasing_error>(
      [&] { gradavg::average_gradients_into(step, tg, means); });
  CHECK(gradavg_test::contains(e.what(), "variable #0 '0': the means output overlaps the means output of variable #1"));
  CHECK(room == before);
  CHECK_FALSE(step.ready());
}
