// torch::Tensor gradients (gradavg/torch.hpp): every dtype against the plain-pointer path and an
// independent reference, undefined = absent, what is rejected and how, and the module helper.
// CUDA tensors cannot be tested on a machine without a GPU: the device check is tested with
// tensors on the meta device, which takes the same branch.
#include <gradavg/torch.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

// `using namespace gradavg;` leaves every later `torch::` naming libtorch's (gradavg's own names
// are in gradavg::libtorch): this unit would not compile otherwise.
namespace with_gradavg_in_scope {
using namespace gradavg;
inline at::Tensor three_zeros() { return torch::zeros({3}); }
inline auto mean_of_replicas(std::span<torch::nn::Module* const> replicas) {
  return libtorch::average_module_gradients(replicas);
}
}  // namespace with_gradavg_in_scope

namespace {

using entry = std::pair<at::Tensor, std::string>;
using towers_t = std::vector<std::vector<entry>>;

/// Gradients of variables of the given sizes on `towers` towers, values from randn in dtype.
towers_t random_towers(std::size_t towers, const std::vector<std::vector<std::int64_t>>& sizes, at::ScalarType dtype,
                       std::uint64_t seed) {
  torch::manual_seed(seed);
  towers_t tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < sizes.size(); ++i)
      tg[k].emplace_back(torch::randn(sizes[i]).to(dtype), "v" + std::to_string(i));
  return tg;
}

/// Outputs shaped like tower 0's gradients, of dtype, filled with -7.
std::vector<at::Tensor> outputs_like(const towers_t& tg, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& e : tg[0]) out.push_back(torch::full(e.first.sizes(), -7.0, torch::dtype(dtype)));
  return out;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> c;
  for (const auto& t : v) c.push_back(t.defined() ? t.clone() : t);
  return c;
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<std::size_t>(a.numel()) * a.element_size()) == 0;
}

bool all_bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!bitwise_equal(a[i], b[i])) return false;
  return true;
}

/// The same call through std::span gradients (the plain-pointer path) into std::vector<O>.
template <class S, class O>
std::vector<std::vector<O>> span_path(const towers_t& tg, const gradavg::options& opts) {
  std::vector<std::vector<std::pair<std::span<const S>, std::string>>> st(tg.size());
  for (std::size_t k = 0; k < tg.size(); ++k)
    for (const auto& [g, name] : tg[k])
      st[k].emplace_back(std::span<const S>(static_cast<const S*>(g.data_ptr()), static_cast<std::size_t>(g.numel())),
                         name);
  std::vector<std::vector<O>> means;
  for (const auto& e : tg[0]) means.emplace_back(static_cast<std::size_t>(e.first.numel()));
  gradavg::average_gradients_into(st, means, opts);
  return means;
}

/// The mean of variable i over the towers, computed by torch in double.
at::Tensor reference_mean(const towers_t& tg, std::size_t i) {
  std::vector<at::Tensor> g;
  for (const auto& tower : tg) g.push_back(tower[i].first.to(at::kDouble));
  return torch::stack(g).mean(0);
}

template <class S, class O>
void check_dtype(at::ScalarType dtype, at::ScalarType out_dtype, double tolerance) {
  // Variable 1 is large enough (3 towers, 300,000 elements) to be split across threads.
  const towers_t tg = random_towers(3, {{4, 5}, {300, 1000}, {}}, dtype, 17);
  for (std::size_t threads : {1u, 2u, 3u}) {
    INFO("threads " << threads);
    auto means = outputs_like(tg, out_dtype);
    const gradavg::summary s = gradavg::average_gradients_into(tg, means, {.threads = threads});
    CHECK(s.averaged == 3);
    const auto want = span_path<S, O>(tg, {.threads = threads});
    for (std::size_t i = 0; i < means.size(); ++i) {
      INFO("variable " << i);
      CHECK(means[i].scalar_type() == out_dtype);
      CHECK(gradavg_test::same_bits(static_cast<const O*>(means[i].data_ptr()), want[i].data(), want[i].size()));
      const at::Tensor ref = reference_mean(tg, i);
      const double err = (means[i].to(at::kDouble) - ref).abs().max().item<double>();
      const double scale = ref.abs().max().item<double>() + 1e-30;
      CHECK(err <= tolerance * scale);
    }
  }
}

}  // namespace

TEST_CASE("every dtype: the same bits as the plain-pointer path, close to torch's double mean") {
  STATIC_REQUIRE(gradavg::dynamic_tensor<at::Tensor>);
  STATIC_REQUIRE(gradavg::resultable_tensor<at::Tensor>);
  // Tolerances relative to the largest |mean|: the sum's rounding, and the output's for 16 bits.
  check_dtype<float, float>(at::kFloat, at::kFloat, 1e-6);
  check_dtype<double, double>(at::kDouble, at::kDouble, 1e-14);
  check_dtype<Eigen::half, Eigen::half>(at::kHalf, at::kHalf, 0x1p-10);
  check_dtype<Eigen::half, float>(at::kHalf, at::kFloat, 1e-6);
  check_dtype<Eigen::bfloat16, Eigen::bfloat16>(at::kBFloat16, at::kBFloat16, 0x1p-7);
  check_dtype<Eigen::bfloat16, float>(at::kBFloat16, at::kFloat, 1e-6);
}

TEST_CASE("the allocating API returns CPU tensors of the gradients' dtype") {
  const towers_t tg = random_towers(4, {{3, 2}, {5}}, at::kHalf, 3);
  const auto r = gradavg::average_gradients(tg, {.include_square = true});
  REQUIRE(r.gradients.size() == 2);
  const auto want = span_path<Eigen::half, Eigen::half>(tg, {});
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(r.gradients[i].first.scalar_type() == at::kHalf);
    CHECK(r.gradients[i].first.sizes() == tg[0][i].first.sizes());
    CHECK(r.gradients[i].second == "v" + std::to_string(i));
    CHECK(gradavg_test::same_bits(static_cast<const Eigen::half*>(r.gradients[i].first.data_ptr()), want[i].data(),
                                  want[i].size()));
    std::vector<at::Tensor> sq;
    for (const auto& tower : tg) sq.push_back(tower[i].first.to(at::kDouble).square());
    const at::Tensor ref = torch::stack(sq).mean(0);
    CHECK((r.squares[i].first.to(at::kDouble) - ref).abs().max().item<double>() <=
          0x1p-10 * ref.abs().max().item<double>());
  }
}

TEST_CASE("in place into tower 0's gradients") {
  towers_t tg = random_towers(3, {{6, 7}, {9}}, at::kFloat, 5);
  const auto want = span_path<float, float>(tg, {});
  std::vector<at::Tensor> means{tg[0][0].first, tg[0][1].first};  // the same storage
  gradavg::average_gradients_into(tg, means);
  for (std::size_t i = 0; i < 2; ++i)
    CHECK(gradavg_test::same_bits(static_cast<const float*>(tg[0][i].first.data_ptr()), want[i].data(), want[i].size()));
}

TEST_CASE("undefined tensors are absent gradients") {
  towers_t tg = random_towers(3, {{4}, {5}, {6}}, at::kFloat, 9);
  for (auto& tower : tg) tower[1].first = at::Tensor();
  auto means = outputs_like(random_towers(1, {{4}, {5}, {6}}, at::kFloat, 1), at::kFloat);
  means[1] = at::Tensor();  // a skipped variable's output is not read
  const auto s = gradavg::average_gradients_into(tg, means);
  CHECK(s.averaged == 2);
  CHECK(s.skipped == 1);
  CHECK(gradavg::average_gradients(tg).skipped.size() == 1);

  tg[2][2].first = at::Tensor();  // undefined on tower 2 only
  const auto before = clones(means);
  const auto e = gradavg_test::exception_of<gradavg::missing_gradient_error>(
      [&] { gradavg::average_gradients_into(tg, means); });
  CHECK(e.variable_index() == 2);
  CHECK(gradavg_test::contains(e.what(), "variable #2 'v2': gradient missing on tower 2 but present on towers 0 and 1 "
                                         "(2 of 3 towers)"));
  CHECK(all_bitwise_equal(means, before));
}

TEST_CASE("tensors gradavg does not read: its errors, naming the variable and the tower, nothing written") {
  towers_t tg = random_towers(3, {{4, 5}, {6}}, at::kFloat, 11);
  auto means = outputs_like(tg, at::kFloat);
  const auto before = clones(means);

  SECTION("non-contiguous") {
    tg[1][0].first = torch::randn({5, 4}).t();
    const auto e = gradavg_test::exception_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(std::string(e.what()) ==
          "variable #0 'v0': gradient on tower 1 is not contiguous (strided); pass a contiguous tensor or a copy");
  }
  SECTION("a non-contiguous output") {
    means[0] = torch::full({5, 4}, -7.0).t();
    const auto e = gradavg_test::exception_of<gradavg::output_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(gradavg_test::contains(e.what(), "variable #0 'v0': the means output is not contiguous"));
    means[0] = before[0].clone();
  }
  SECTION("an integer dtype") {
    tg[2][1].first = torch::ones({6}, torch::dtype(torch::kInt32));
    const auto e =
        gradavg_test::exception_of<gradavg::element_type_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(e.variable_index() == 1);
    CHECK(std::string(e.what()) == "variable #1 'v1': gradient on tower 2: a tensor of dtype Int; gradavg reads "
                                   "Float, Double, Half and BFloat16 tensors");
  }
  SECTION("dtypes that differ across replicas") {
    tg[1][1].first = tg[1][1].first.to(at::kDouble);
    const auto e =
        gradavg_test::exception_of<gradavg::element_type_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': gradient on tower 1 is float64 but on tower 0 is float32"));
  }
  SECTION("an output of the wrong dtype") {
    means[1] = torch::full({6}, -7.0, torch::dtype(torch::kDouble));
    const auto e = gradavg_test::exception_of<gradavg::output_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': the means output is float64 but the gradients are float32"));
    means[1] = before[1].clone();
  }
  SECTION("another device (meta: the branch a CUDA tensor takes)") {
    tg[0][1].first = at::empty({6}, at::TensorOptions().device(at::kMeta));
    const auto e =
        gradavg_test::exception_of<gradavg::unsupported_tensor_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': gradient on tower 0: a tensor on device meta; gradavg "
                                           "reads CPU tensors"));
  }
  SECTION("sparse") {
    tg[2][0].first = torch::randn({4, 5}).to_sparse();
    const auto e =
        gradavg_test::exception_of<gradavg::unsupported_tensor_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(gradavg_test::contains(e.what(), "variable #0 'v0': gradient on tower 2: a sparse"));
  }
  SECTION("more than 8 dimensions") {
    tg[1][1].first = torch::randn({1, 1, 1, 1, 6, 1, 1, 1, 1});
    const auto e = gradavg_test::exception_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(gradavg_test::contains(e.what(), "variable #1 'v1': gradient on tower 1: a tensor of rank 9"));
  }
  CHECK(all_bitwise_equal(means, before));
}

TEST_CASE("using namespace gradavg: torch:: is still libtorch's") {
  CHECK(with_gradavg_in_scope::three_zeros().sum().item<float>() == 0.0f);
  torch::nn::Linear a(2, 1), b(2, 1);
  b->weight.data().copy_(a->weight.data());
  b->bias.data().copy_(a->bias.data());
  for (auto* m : {a.ptr().get(), b.ptr().get()})
    for (auto& p : m->parameters()) p.mutable_grad() = torch::ones_like(p) * (m == a.ptr().get() ? 1.0f : 3.0f);
  std::vector<torch::nn::Module*> replicas{a.ptr().get(), b.ptr().get()};
  const auto report = with_gradavg_in_scope::mean_of_replicas(replicas);
  CHECK(report.report.averaged == 2);
  CHECK(torch::allclose(b->weight.grad(), torch::full_like(b->weight, 2.0f)));
}

TEST_CASE("parameter tensors as variables: the same TensorImpl on every tower, printed without elements") {
  const at::Tensor w = torch::randn({3}), other = torch::randn({3});
  std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> tg(2);
  tg[0].emplace_back(torch::randn({3}), w);
  tg[1].emplace_back(torch::randn({3}), w);
  std::vector<at::Tensor> means{torch::zeros({3})};
  CHECK(gradavg::average_gradients_into(tg, means).averaged == 1);
  tg[1][0].second = other;
  const auto e =
      gradavg_test::exception_of<gradavg::variable_mismatch_error>([&] { gradavg::average_gradients_into(tg, means); });
  // Same dtype and shape: the two parameters are told apart by their TensorImpl.
  auto at_of = [](const at::Tensor& t) {
    std::ostringstream os;
    os << static_cast<const void*>(t.unsafeGetTensorImpl());
    return os.str();
  };
  CHECK(std::string(e.what()) == "variable #0 'Float[3] at " + at_of(w) + "': tower 1 has variable 'Float[3] at " +
                                     at_of(other) + "' at this position but tower 0 has 'Float[3] at " + at_of(w) +
                                     "'; every tower must list the same variables in the same order");
}

namespace {

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
    frozen = register_module("frozen", torch::nn::Linear(3, 3));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return frozen(fc2(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, frozen{nullptr};
};
TORCH_MODULE(Net);

/// K replicas of one model, each with the gradient of its slice of a batch.
std::vector<Net> replicas_with_gradients(std::size_t k_count, std::uint64_t seed) {
  torch::manual_seed(seed);
  Net model;
  std::vector<Net> r{model};
  for (std::size_t k = 1; k < k_count; ++k) r.push_back(std::dynamic_pointer_cast<NetImpl>(model->clone()));
  // clone() makes submodules afresh: their parameters require gradients again.
  for (auto& replica : r)
    for (auto& p : replica->frozen->parameters()) p.set_requires_grad(false);
  const at::Tensor x = torch::randn({static_cast<std::int64_t>(8 * k_count), 6});
  const at::Tensor y = torch::randint(0, 3, {static_cast<std::int64_t>(8 * k_count)});
  for (std::size_t k = 0; k < k_count; ++k) {
    const auto rows = torch::indexing::Slice(static_cast<std::int64_t>(8 * k), static_cast<std::int64_t>(8 * (k + 1)));
    torch::nn::functional::cross_entropy(r[k]->forward(x.index({rows})), y.index({rows})).backward();
  }
  return r;
}

}  // namespace

TEST_CASE("module replicas: averaged into replica 0's .grad() in place, copied to the others") {
  for (std::size_t k_count : {1u, 2u, 3u}) {
    for (std::size_t threads : {1u, 2u, 3u}) {
      INFO(k_count << " replicas, threads " << threads);
      auto replicas = replicas_with_gradients(k_count, 23);
      // References before the call: the span path bit for bit, torch's double mean within 1e-6.
      towers_t tg(k_count);
      for (std::size_t k = 0; k < k_count; ++k)
        for (const auto& p : replicas[k]->named_parameters())
          if (p.value().grad().defined()) tg[k].emplace_back(p.value().grad().clone(), p.key());
      const auto want = span_path<float, float>(tg, {});

      const auto r = gradavg::libtorch::average_module_gradients(replicas, {.threads = threads, .statistics = true});
      CHECK(r.report.averaged == 4);
      CHECK(r.report.towers == k_count);
      CHECK(r.skipped == std::vector<std::string>{"frozen.weight", "frozen.bias"});
      double sum_squares = 0;
      std::size_t i = 0;
      for (const auto& p : replicas[0]->named_parameters()) {
        if (!p.value().requires_grad()) {
          CHECK(!p.value().grad().defined());
          continue;
        }
        INFO(p.key());
        const at::Tensor& g = p.value().grad();
        CHECK(gradavg_test::same_bits(static_cast<const float*>(g.data_ptr()), want[i].data(), want[i].size()));
        const at::Tensor ref = reference_mean(tg, i);
        CHECK((g.to(at::kDouble) - ref).abs().max().item<double>() <= 1e-6 * ref.abs().max().item<double>());
        sum_squares += ref.square().sum().item<double>();
        for (std::size_t k = 1; k < k_count; ++k)
          CHECK(bitwise_equal(replicas[k]->named_parameters()[p.key()].grad(), g));
        ++i;
      }
      CHECK(std::abs(r.report.sum_mean_squared - sum_squares) <= 1e-6 * sum_squares);
    }
  }
}

TEST_CASE("module replicas: a module pointer span, and mismatches reported before anything is written") {
  auto replicas = replicas_with_gradients(2, 29);
  std::vector<torch::nn::Module*> modules{replicas[0].ptr().get(), replicas[1].ptr().get()};
  std::vector<at::Tensor> before;
  for (auto* m : modules)
    for (const auto& p : m->parameters())
      if (p.grad().defined()) before.push_back(p.grad().clone());
  auto grads_now = [&] {
    std::vector<at::Tensor> g;
    for (auto* m : modules)
      for (const auto& p : m->parameters())
        if (p.grad().defined()) g.push_back(p.grad());
    return g;
  };

  SECTION("a parameter frozen on one replica only, with gradients elsewhere") {
    replicas[1]->fc2->bias.set_requires_grad(false);
    const auto e = gradavg_test::exception_of<gradavg::missing_gradient_error>(
        [&] { gradavg::libtorch::average_module_gradients(std::span<torch::nn::Module* const>(modules)); });
    CHECK(gradavg_test::contains(e.what(), "variable #3 'fc2.bias': gradient missing on tower 1 but present on tower 0 "
                                           "(1 of 2 towers)"));
    replicas[1]->fc2->bias.set_requires_grad(true);
  }
  SECTION("replicas of different models") {
    torch::nn::Sequential other(torch::nn::Linear(6, 16), torch::nn::Linear(16, 3), torch::nn::Linear(3, 3));
    modules[1] = other.ptr().get();
    const auto e = gradavg_test::exception_of<gradavg::variable_mismatch_error>(
        [&] { gradavg::libtorch::average_module_gradients(std::span<torch::nn::Module* const>(modules)); });
    CHECK(gradavg_test::contains(e.what(), "variable #0 'fc1.weight': tower 1 has variable '0.weight'"));
    modules[1] = replicas[1].ptr().get();
  }
  SECTION("a null replica") {
    modules[1] = nullptr;
    CHECK_THROWS_AS(gradavg::libtorch::average_module_gradients(std::span<torch::nn::Module* const>(modules)),
                    gradavg::tower_error);
    modules[1] = replicas[1].ptr().get();
  }
  CHECK(all_bitwise_equal(grads_now(), before));
}
