// torch::Tensor gradients (gradavg/torch.hpp): every dtype against the plain-pointer path and an
// independent reference, undefined = absent, what is rejected and how, and the module helper.
// CUDA tensors cannot be tested on a machine without a GPU: the device check is tested with
// tensors on the meta device, which takes the same branch.
#include <gradavg/torch.hpp>
#include <gradavg/torch_data_parallel.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"
#include "torch_models.hpp"
#include "x87_check.hpp"

using namespace gradavg_test::models;  // Net, TwoHeads, BatchNormNet, Mixed, to_channels_last

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

using entry = gradavg_test::torch_entry;
using towers_t = gradavg_test::torch_towers;
using gradavg_test::outputs_like;
using gradavg_test::reference_mean;

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

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> c;
  for (const auto& t : v) c.push_back(t.defined() ? t.clone() : t);
  return c;
}

using gradavg_test::bitwise_equal;

bool all_bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!bitwise_equal(a[i], b[i])) return false;
  return true;
}

/// The same call through std::span gradients (the plain-pointer path) into std::vector<O>.
template <class S, class O>
std::vector<std::vector<O>> span_path(const towers_t& tg, const gradavg::options& opts) {
  return gradavg_test::through_spans<S, O>(
      tg, [&](const auto& st, auto& means) { gradavg::average_gradients_into(st, means, opts); });
}

template <class S, class O>
void check_dtype(at::ScalarType dtype, at::ScalarType out_dtype, double tolerance) {
  // Variable 1 is large enough (3 towers, 300,000 elements) to be split across threads.
  const towers_t tg = random_towers(3, {{4, 5}, {300, 1000}, {}}, dtype, 17);
  for (std::size_t threads : {1u, 2u, 3u}) {
    INFO("threads " << threads);
    auto means = outputs_like(tg, out_dtype);
    const gradavg::summary s = gradavg::average_gradients_into(tg, means, {.run = {.threads = threads}});
    CHECK(s.averaged == 3);
    const auto want = span_path<S, O>(tg, {.run = {.threads = threads}});
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
  const auto r = gradavg::average_gradients(tg, gradavg::include_square);
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
  gradavg_test::check_x87_after("average_gradients_into with an undefined (absent) gradient");
  CHECK(s.averaged == 2);
  CHECK(s.skipped == 1);
  CHECK(gradavg::average_gradients(tg).skipped.size() == 1);
  gradavg_test::check_x87_after("average_gradients with an undefined (absent) gradient");

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

  SECTION("strided: gaps between elements") {
    tg[1][0].first = torch::randn({4, 10}).slice(1, 0, 10, 2);
    const auto e =
        gradavg_test::exception_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(std::string(e.what()) ==
          "variable #0 'v0': gradient on tower 1 is not contiguous (strided); pass a contiguous tensor or a copy");
  }
  SECTION("strided: overlapping elements (expand)") {
    tg[2][0].first = torch::randn({5}).expand({4, 5});
    const auto e =
        gradavg_test::exception_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(std::string(e.what()) ==
          "variable #0 'v0': gradient on tower 2 is not contiguous (strided); pass a contiguous tensor or a copy");
  }
  SECTION("dense in another memory order (a transpose): named by its sizes and strides, as the user made it") {
    tg[1][0].first = torch::randn({5, 4}).t();  // sizes [4, 5], strides [1, 4]
    const auto e =
        gradavg_test::exception_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(std::string(e.what()) == "variable #0 'v0': gradient on tower 1 has shape [4, 5] with strides [1, 4], "
                                   "memory order [5, 4] but on tower 0 has shape [4, 5]");
  }
  SECTION("a strided output") {
    means[0] = torch::full({4, 10}, -7.0).slice(1, 0, 10, 2);
    const auto e =
        gradavg_test::exception_of<gradavg::output_error>([&] { gradavg::average_gradients_into(tg, means); });
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
    CHECK(gradavg_test::contains(e.what(), "gradavg::libtorch::average_sparse_gradients_into"));
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

      const auto r = gradavg::libtorch::average_module_gradients(replicas, {.compute = {.statistics = true}, .run = {.threads = threads}});
      gradavg_test::check_x87_after("average_module_gradients with frozen (skipped) parameters");
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

namespace {

/// A convolution and a linear head: conv.weight is the one 4-d parameter.
struct ConvNetImpl : torch::nn::Cloneable<ConvNetImpl> {
  ConvNetImpl() { reset(); }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(4 * 4 * 4, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(torch::relu(conv(x)).flatten(1)); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvNet);

/// K channels_last replicas of one ConvNet, each with the gradient of its 8 rows of a
/// channels_last batch.
std::vector<ConvNet> channels_last_replicas(std::size_t k_count, std::uint64_t seed) {
  torch::manual_seed(seed);
  ConvNet model;
  std::vector<ConvNet> r{model};
  for (std::size_t k = 1; k < k_count; ++k) r.push_back(std::dynamic_pointer_cast<ConvNetImpl>(model->clone()));
  for (auto& replica : r) to_channels_last(*replica);
  const auto n = static_cast<std::int64_t>(8 * k_count);
  const at::Tensor x = torch::randn({n, 2, 6, 6}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor y = torch::randint(0, 3, {n});
  for (std::size_t k = 0; k < k_count; ++k) {
    const auto rows = torch::indexing::Slice(static_cast<std::int64_t>(8 * k), static_cast<std::int64_t>(8 * (k + 1)));
    torch::nn::functional::cross_entropy(r[k]->forward(x.index({rows})), y.index({rows})).backward();
  }
  return r;
}

bool is_channels_last(const at::Tensor& t) {
  return t.is_contiguous(at::MemoryFormat::ChannelsLast) && !t.is_contiguous();
}

}  // namespace

TEST_CASE("channels_last gradients: averaged in memory order into a channels_last output") {
  auto replicas = channels_last_replicas(3, 41);
  towers_t tg(3), nhwc(3);
  std::vector<at::Tensor> grads;
  for (std::size_t k = 0; k < 3; ++k) {
    const at::Tensor g = replicas[k]->conv->weight.grad();
    REQUIRE(is_channels_last(g));  // libtorch gives the gradient the parameter's strides
    tg[k].emplace_back(g.clone(), "conv.weight");
    nhwc[k].emplace_back(g.permute({0, 2, 3, 1}).contiguous(), "conv.weight");
    grads.push_back(g);
  }
  const at::Tensor torch_mean = torch::stack(grads).mean(0);
  const at::Tensor ref = reference_mean(tg, 0);
  const double scale = ref.abs().max().item<double>();
  // The same elements in the same memory order, row-major [O, kH, kW, I]: the same bits.
  const auto want = span_path<float, float>(nhwc, {});
  for (std::size_t threads : {1u, 2u}) {
    INFO("threads " << threads);
    std::vector<at::Tensor> means{at::empty_like(tg[0][0].first)};
    REQUIRE(is_channels_last(means[0]));
    const void* where = means[0].data_ptr();
    CHECK(gradavg::average_gradients_into(tg, means, {.run = {.threads = threads}}).averaged == 1);
    CHECK(is_channels_last(means[0]));
    CHECK(means[0].data_ptr() == where);
    CHECK(gradavg_test::same_bits(static_cast<const float*>(means[0].data_ptr()), want[0].data(), want[0].size()));
    CHECK((means[0].to(at::kDouble) - ref).abs().max().item<double>() <= 1e-6 * scale);
    CHECK((means[0] - torch_mean).abs().max().item<double>() <= 1e-6 * scale);
  }
  // The allocating API returns row-major tensors of the memory-order shape.
  const auto r = gradavg::average_gradients(tg);
  CHECK(r.gradients[0].first.sizes() == at::IntArrayRef({4, 3, 3, 2}));
  CHECK(gradavg_test::same_bits(static_cast<const float*>(r.gradients[0].first.data_ptr()), want[0].data(),
                                want[0].size()));
}

TEST_CASE("channels_last gradients: another memory order is a shape error naming both, nothing written") {
  auto replicas = channels_last_replicas(3, 43);
  towers_t tg(3);
  for (std::size_t k = 0; k < 3; ++k) tg[k].emplace_back(replicas[k]->conv->weight.grad(), "conv.weight");
  SECTION("a contiguous output") {
    std::vector<at::Tensor> means{torch::full({4, 2, 3, 3}, -7.0)};
    const auto e =
        gradavg_test::exception_of<gradavg::output_error>([&] { gradavg::average_gradients_into(tg, means); });
    // channels_last [O = 4, I = 2, kH = 3, kW = 3]: strides [I kH kW, 1, kW I, I].
    CHECK(std::string(e.what()) == "variable #0 'conv.weight': the means output has shape [4, 2, 3, 3] but the "
                                   "gradient has shape [4, 2, 3, 3] with strides [18, 1, 6, 2], memory order "
                                   "[4, 3, 3, 2]");
    CHECK(torch::equal(means[0], torch::full({4, 2, 3, 3}, -7.0)));
  }
  SECTION("a contiguous gradient on one tower") {
    tg[1][0].first = tg[1][0].first.contiguous();
    std::vector<at::Tensor> means{torch::full({4, 2, 3, 3}, -7.0).contiguous(at::MemoryFormat::ChannelsLast)};
    const auto e =
        gradavg_test::exception_of<gradavg::shape_error>([&] { gradavg::average_gradients_into(tg, means); });
    CHECK(std::string(e.what()) == "variable #0 'conv.weight': gradient on tower 1 has shape [4, 2, 3, 3] but on "
                                   "tower 0 has shape [4, 2, 3, 3] with strides [18, 1, 6, 2], memory order "
                                   "[4, 3, 3, 2]");
    CHECK(torch::equal(means[0], torch::full({4, 2, 3, 3}, -7.0)));
  }
}

TEST_CASE("module replicas in channels_last: the means in place, every replica's gradient channels_last") {
  for (std::size_t threads : {1u, 2u}) {
    INFO("threads " << threads);
    auto replicas = channels_last_replicas(3, 47);
    std::vector<at::Tensor> want, where;
    for (const auto& p : replicas[0]->parameters()) {
      std::vector<at::Tensor> g;
      for (const auto& m : replicas) g.push_back(m->parameters()[want.size()].grad().to(at::kDouble));
      want.push_back(torch::stack(g).mean(0));
      where.push_back(p.grad());
    }
    const auto r = gradavg::libtorch::average_module_gradients(replicas, {.run = {.threads = threads}});
    CHECK(r.report.averaged == 4);
    CHECK(r.skipped.empty());
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO("parameter " << i);
      const at::Tensor g = replicas[0]->parameters()[i].grad();
      CHECK(g.data_ptr() == where[i].data_ptr());
      CHECK(g.strides() == replicas[0]->parameters()[i].strides());
      CHECK((g.to(at::kDouble) - want[i]).abs().max().item<double>() <= 1e-6 * want[i].abs().max().item<double>());
      for (std::size_t k = 1; k < 3; ++k) {
        const at::Tensor gk = replicas[k]->parameters()[i].grad();
        CHECK(gk.strides() == g.strides());
        CHECK(bitwise_equal(gk, g));
      }
    }
    CHECK(is_channels_last(replicas[2]->conv->weight.grad()));
  }
}

namespace {

/// One 1 Mi-float parameter and a small one: large enough for the averaging and the copies to
/// split into chunks.
struct WideImpl : torch::nn::Cloneable<WideImpl> {
  WideImpl() { reset(); }
  void reset() override {
    w = register_parameter("w", torch::zeros({1024, 1024}));
    b = register_parameter("b", torch::zeros({1000}));
  }
  at::Tensor w, b;
};
TORCH_MODULE(Wide);

/// K replicas of one Wide, each with gradients from randn.
std::vector<Wide> wide_replicas(std::size_t k_count, std::uint64_t seed) {
  torch::manual_seed(seed);
  Wide model;
  std::vector<Wide> r{model};
  for (std::size_t k = 1; k < k_count; ++k) r.push_back(std::dynamic_pointer_cast<WideImpl>(model->clone()));
  for (auto& replica : r)
    for (auto& p : replica->parameters()) p.mutable_grad() = torch::randn_like(p);
  return r;
}

/// Runs the tasks inline and counts its parallel_for calls; call number fail_at (from 1) throws
/// std::runtime_error instead.
class counting_executor final : public gradavg::executor {
 public:
  explicit counting_executor(std::size_t fail_at = 0) : fail_at_(fail_at) {}
  [[nodiscard]] std::size_t concurrency() const noexcept override { return 2; }
  void parallel_for(std::size_t n, gradavg::task_ref task) override {
    if (++calls == fail_at_) throw std::runtime_error("executor call " + std::to_string(calls) + " failed");
    for (std::size_t i = 0; i < n; ++i) task(i);
  }
  std::size_t calls = 0;

 private:
  std::size_t fail_at_;
};

}  // namespace

TEST_CASE("module replicas: the copies into replicas 1..K-1 run on the options' executor, bitwise replica 0's") {
  gradavg::thread_pool pool(2);
  for (const char* how : {"threads 1", "threads 2", "a thread_pool of 2", "streaming stores, threads 2"}) {
    INFO(how);
    auto replicas = wide_replicas(4, 53);
    towers_t tg(4);
    for (std::size_t k = 0; k < 4; ++k)
      for (const auto& p : replicas[k]->named_parameters()) tg[k].emplace_back(p.value().grad().clone(), p.key());
    const auto want = span_path<float, float>(tg, {});
    gradavg::options opts;
    const std::string h = how;
    if (h == "a thread_pool of 2")
      opts.run.pool = &pool;
    else
      opts.run.threads = h == "threads 1" ? 1 : 2;
    opts.run.stores = (h.starts_with("streaming")) ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
    CHECK(gradavg::libtorch::average_module_gradients(replicas, opts).report.averaged == 2);
    for (std::size_t i = 0; i < 2; ++i) {
      INFO("parameter " << i);
      const at::Tensor g = replicas[0]->parameters()[i].grad();
      CHECK(gradavg_test::same_bits(static_cast<const float*>(g.data_ptr()), want[i].data(), want[i].size()));
      for (std::size_t k = 1; k < 4; ++k) CHECK(bitwise_equal(replicas[k]->parameters()[i].grad(), g));
    }
  }
}

TEST_CASE("module replicas: the executor runs the copies, and its exception reaches the caller") {
  auto replicas = wide_replicas(4, 59);
  counting_executor counter;
  gradavg::libtorch::average_module_gradients(replicas, {.run = {.pool = &counter}});
  CHECK(counter.calls == 2);  // the averaging, then the copies
  counting_executor failing(2);
  CHECK_THROWS_WITH(gradavg::libtorch::average_module_gradients(replicas, {.run = {.pool = &failing}}),
                    "executor call 2 failed");
}

namespace {

/// Three replicas of one TwoHeads and a batch of 8 rows per replica.
struct two_heads_step {
  std::vector<TwoHeads> replicas;
  at::Tensor x, y;

  explicit two_heads_step(std::uint64_t seed) {
    torch::manual_seed(seed);
    TwoHeads model;
    replicas.push_back(model);
    for (std::size_t k = 1; k < 3; ++k) replicas.push_back(std::dynamic_pointer_cast<TwoHeadsImpl>(model->clone()));
    x = torch::randn({24, 6});
    y = torch::randint(0, 3, {24});
  }
  /// Each replica's gradient of its rows, the aux head in the loss where use_aux says.
  void backward(const std::vector<bool>& use_aux) {
    for (std::size_t k = 0; k < 3; ++k) {
      const auto first = static_cast<std::int64_t>(8 * k);
      const auto rows = torch::indexing::Slice(first, first + 8);
      torch::nn::functional::cross_entropy(replicas[k]->forward(x.index({rows}), use_aux[k]), y.index({rows}))
          .backward();
    }
  }
  /// Per parameter, the mean over the replicas in double, a missing gradient counted as zeros.
  std::vector<at::Tensor> mean_with_zeros() const {
    std::vector<at::Tensor> want;
    const std::size_t n = replicas[0]->parameters().size();
    for (std::size_t i = 0; i < n; ++i) {
      std::vector<at::Tensor> g;
      for (const auto& m : replicas) {
        const at::Tensor p = m->parameters()[i];
        g.push_back(p.grad().defined() ? p.grad().to(at::kDouble) : torch::zeros_like(p, torch::dtype(at::kDouble)));
      }
      want.push_back(torch::stack(g).mean(0));
    }
    return want;
  }
  /// Every replica holds want's means (replica 0 within 1e-6 of the largest |mean|, the others its bits).
  void check_means(const std::vector<at::Tensor>& want) const {
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO("parameter " << replicas[0]->named_parameters().keys()[i]);
      const at::Tensor g = replicas[0]->parameters()[i].grad();
      REQUIRE(g.defined());
      CHECK((g.to(at::kDouble) - want[i]).abs().max().item<double>() <= 1e-6 * want[i].abs().max().item<double>());
      for (std::size_t k = 1; k < 3; ++k) CHECK(bitwise_equal(replicas[k]->parameters()[i].grad(), g));
    }
  }
};

}  // namespace

TEST_CASE("a parameter used on some replicas only: zeros after zero_grad(), an error after zero_grad(true)") {
  two_heads_step s(61);
  s.backward({true, true, true});
  SECTION("zero_grad() (libtorch 1.13 fills zeros): averaged with those zeros") {
    for (auto& m : s.replicas) m->zero_grad();
    s.backward({true, false, true});
    REQUIRE(s.replicas[1]->aux->weight.grad().defined());
    CHECK(s.replicas[1]->aux->weight.grad().abs().max().item<float>() == 0.0f);
    const auto want = s.mean_with_zeros();
    const auto r = gradavg::libtorch::average_module_gradients(s.replicas);
    CHECK(r.report.averaged == 6);
    CHECK(r.zero_filled.empty());
    s.check_means(want);
  }
  SECTION("zero_grad(true) (set to none): missing_gradient_error, nothing written") {
    for (auto& m : s.replicas) m->zero_grad(true);
    s.backward({true, false, true});
    REQUIRE(!s.replicas[1]->aux->weight.grad().defined());
    const at::Tensor before = s.replicas[0]->aux->weight.grad().clone();
    const auto e = gradavg_test::exception_of<gradavg::missing_gradient_error>(
        [&] { gradavg::libtorch::average_module_gradients(s.replicas); });
    CHECK(gradavg_test::contains(e.what(), "'aux.weight': gradient missing on tower 1 but present on towers 0 and 2"));
    CHECK(bitwise_equal(s.replicas[0]->aux->weight.grad(), before));
    CHECK(!s.replicas[1]->aux->weight.grad().defined());
  }
}

TEST_CASE("module_options::absent_as_zeros: a gradient absent on some replicas counts as zeros, as in DDP") {
  for (std::size_t missing : {0u, 1u}) {
    INFO("replica " << missing << " without the aux head's gradient");
    two_heads_step s(67);
    std::vector<bool> use_aux{true, true, true};
    use_aux[missing] = false;
    s.backward(use_aux);
    REQUIRE(!s.replicas[missing]->aux->bias.grad().defined());
    const auto want = s.mean_with_zeros();
    const auto r = gradavg::libtorch::average_module_gradients(s.replicas, {.run = {.threads = 2}}, {.absent_as_zeros = true});
    CHECK(r.report.averaged == 6);
    CHECK(r.skipped.empty());
    CHECK(r.zero_filled == std::vector<std::string>{"aux.weight", "aux.bias"});
    s.check_means(want);
    CHECK(s.replicas[missing]->aux->weight.grad().sizes() == s.replicas[missing]->aux->weight.sizes());
  }
  SECTION("absent on every replica: skipped, nothing attached") {
    two_heads_step s(71);
    s.backward({false, false, false});
    const auto want = s.mean_with_zeros();
    const auto r = gradavg::libtorch::average_module_gradients(s.replicas, {}, {.absent_as_zeros = true});
    CHECK(r.report.averaged == 4);
    CHECK(r.skipped == std::vector<std::string>{"aux.weight", "aux.bias"});
    CHECK(r.zero_filled.empty());
    for (const auto& m : s.replicas) CHECK(!m->aux->weight.grad().defined());
    CHECK((s.replicas[2]->head->weight.grad().to(at::kDouble) - want[2]).abs().max().item<double>() <=
          1e-6 * want[2].abs().max().item<double>());
  }
}

TEST_CASE("module replicas: mean_target::first_replica writes replica 0's gradients only, the others keep theirs") {
  auto replicas = wide_replicas(4, 61);
  towers_t tg(4);
  std::vector<std::vector<at::Tensor>> own(4);
  for (std::size_t k = 0; k < 4; ++k)
    for (const auto& p : replicas[k]->named_parameters()) {
      tg[k].emplace_back(p.value().grad().clone(), p.key());
      own[k].push_back(p.value().grad().clone());
    }
  const auto want = span_path<float, float>(tg, {});
  counting_executor counter;
  const gradavg::libtorch::module_options mopts{.means_to = gradavg::libtorch::mean_target::first_replica};
  CHECK(gradavg::libtorch::average_module_gradients(replicas, {.run = {.pool = &counter}}, mopts).report.averaged == 2);
  CHECK(counter.calls == 1);  // the averaging only: nothing to copy
  for (std::size_t i = 0; i < 2; ++i) {
    INFO("parameter " << i);
    const at::Tensor g = replicas[0]->parameters()[i].grad();
    CHECK(gradavg_test::same_bits(static_cast<const float*>(g.data_ptr()), want[i].data(), want[i].size()));
    for (std::size_t k = 1; k < 4; ++k) CHECK(bitwise_equal(replicas[k]->parameters()[i].grad(), own[k][i]));
  }
}

namespace {

/// Three replicas of one BatchNormNet whose running statistics differ (a train-mode forward of
/// other data on each); replica 2's parameters differ as well.
std::vector<BatchNormNet> diverged_replicas(std::uint64_t seed) {
  torch::manual_seed(seed);
  BatchNormNet model;
  std::vector<BatchNormNet> r{model};
  for (std::size_t k = 1; k < 3; ++k) r.push_back(std::dynamic_pointer_cast<BatchNormNetImpl>(model->clone()));
  torch::NoGradGuard no_grad;
  for (auto& p : r[2]->parameters()) p.add_(torch::randn_like(p), 0.1);
  for (std::size_t k = 0; k < 3; ++k) r[k]->forward(torch::randn({16, 6}) * static_cast<double>(k + 1));
  return r;
}

at::Tensor eval_output(BatchNormNet& m, const at::Tensor& x) {
  m->eval();
  torch::NoGradGuard no_grad;
  return m->forward(x);
}

std::vector<at::Tensor> clones_of(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> c;
  for (const auto& t : v) c.push_back(t.clone());
  return c;
}

}  // namespace

TEST_CASE("broadcast_buffers, broadcast_parameters: replica 0's values in every replica, the same eval() outputs") {
  auto replicas = diverged_replicas(83);
  const at::Tensor x = torch::randn({5, 6});
  const auto buffers0 = clones_of(replicas[0]->buffers());
  const auto params0 = clones_of(replicas[0]->parameters());
  REQUIRE(buffers0.size() == 3);
  const at::Tensor want = eval_output(replicas[0], x);
  CHECK(!torch::equal(eval_output(replicas[1], x), want));
  CHECK(!torch::equal(eval_output(replicas[2], x), want));

  gradavg::libtorch::broadcast_buffers(replicas);
  for (std::size_t k = 0; k < 3; ++k)
    for (std::size_t i = 0; i < 3; ++i) CHECK(bitwise_equal(replicas[k]->buffers()[i], buffers0[i]));
  CHECK(bitwise_equal(eval_output(replicas[1], x), want));  // same parameters, now the same statistics
  CHECK(!torch::equal(eval_output(replicas[2], x), want));

  std::vector<torch::nn::Module*> modules{replicas[0].get(), replicas[1].get(), replicas[2].get()};
  gradavg::libtorch::broadcast_parameters(std::span<torch::nn::Module* const>(modules));
  for (std::size_t k = 0; k < 3; ++k) {
    for (std::size_t i = 0; i < params0.size(); ++i) CHECK(bitwise_equal(replicas[k]->parameters()[i], params0[i]));
    CHECK(bitwise_equal(eval_output(replicas[k], x), want));
  }
}

TEST_CASE("broadcast_buffers: replicas of different models are an error before anything is written") {
  auto replicas = diverged_replicas(89);
  const auto before = clones_of(replicas[2]->buffers());
  SECTION("another width on replica 1") {
    BatchNormNet other(5);
    std::vector<BatchNormNet> mixed{replicas[0], other, replicas[2]};
    const auto e =
        gradavg_test::exception_of<gradavg::shape_error>([&] { gradavg::libtorch::broadcast_buffers(mixed); });
    CHECK(gradavg_test::contains(e.what(), "buffer #0 'bn.running_mean': replica 1 has sizes [5]"));
  }
  SECTION("a null replica") {
    std::vector<torch::nn::Module*> modules{replicas[0].get(), nullptr, replicas[2].get()};
    CHECK_THROWS_AS(gradavg::libtorch::broadcast_buffers(std::span<torch::nn::Module* const>(modules)),
                    gradavg::tower_error);
  }
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(bitwise_equal(replicas[2]->buffers()[i], before[i]));
}

TEST_CASE("broadcast_parameters, broadcast_buffers on the options' executor: replica 0's bytes in every replica") {
  gradavg::thread_pool pool(2);
  for (const char* how : {"threads 2", "a thread_pool of 2", "streaming stores, threads 2", "a counting executor"}) {
    INFO(how);
    auto replicas = wide_replicas(3, 67);
    {
      torch::NoGradGuard no_grad;
      for (auto& replica : replicas)
        for (auto& p : replica->parameters()) p.add_(torch::randn_like(p));
    }
    const auto params0 = clones_of(replicas[0]->parameters());
    const auto grads1 = clones_of({replicas[1]->parameters()[0].grad(), replicas[1]->parameters()[1].grad()});
    const std::string h = how;
    counting_executor counter;
    gradavg::options opts;
    if (h == "a thread_pool of 2")
      opts.run.pool = &pool;
    else if (h == "a counting executor")
      opts.run.pool = &counter;
    else
      opts.run.threads = 2;
    opts.run.stores = (h.starts_with("streaming")) ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
    gradavg::libtorch::broadcast_parameters(replicas, opts);
    gradavg::libtorch::broadcast_buffers(replicas, opts);  // Wide has none: nothing to do
    for (std::size_t k = 0; k < 3; ++k)
      for (std::size_t i = 0; i < params0.size(); ++i) {
        INFO("replica " << k << ", parameter " << i);
        CHECK(bitwise_equal(replicas[k]->parameters()[i], params0[i]));
      }
    CHECK(bitwise_equal(replicas[1]->parameters()[0].grad(), grads1[0]));  // gradients untouched
    CHECK(bitwise_equal(replicas[1]->parameters()[1].grad(), grads1[1]));
    if (h == "a counting executor") CHECK(counter.calls == 1);
  }
}

namespace {

std::vector<Mixed> mixed_replicas(std::size_t k_count, std::uint64_t seed) {
  torch::manual_seed(seed);
  Mixed model;
  std::vector<Mixed> r{model};
  for (std::size_t k = 1; k < k_count; ++k) r.push_back(std::dynamic_pointer_cast<MixedImpl>(model->clone()));
  const at::Tensor x = torch::randn({static_cast<std::int64_t>(8 * k_count), 6});
  const at::Tensor y = torch::randint(0, 3, {static_cast<std::int64_t>(8 * k_count)});
  for (std::size_t k = 0; k < k_count; ++k) {
    const auto first = static_cast<std::int64_t>(8 * k);
    const auto rows = torch::indexing::Slice(first, first + 8);
    torch::nn::functional::cross_entropy(r[k]->forward(x.index({rows})), y.index({rows})).backward();
  }
  return r;
}

}  // namespace

TEST_CASE("a bfloat16 body and a float head: each dtype averaged in a call of its own") {
  for (std::size_t threads : {1u, 2u}) {
    INFO("threads " << threads);
    auto replicas = mixed_replicas(3, 97);
    REQUIRE(replicas[0]->body->weight.grad().scalar_type() == at::kBFloat16);
    REQUIRE(replicas[0]->head->weight.grad().scalar_type() == at::kFloat);
    // References: each dtype's own call through the span path, and torch's double mean.
    towers_t body(3), head(3);
    for (std::size_t k = 0; k < 3; ++k)
      for (const auto& p : replicas[k]->named_parameters())
        (p.value().scalar_type() == at::kBFloat16 ? body : head)[k].emplace_back(p.value().grad().clone(), p.key());
    const auto want_body = span_path<Eigen::bfloat16, Eigen::bfloat16>(body, {});
    const auto want_head = span_path<float, float>(head, {});
    const auto sb = gradavg::average_gradients(body, {.compute = {.statistics = true}}).report;
    const auto sh = gradavg::average_gradients(head, {.compute = {.statistics = true}}).report;

    const auto r = gradavg::libtorch::average_module_gradients(replicas, {.compute = {.statistics = true}, .run = {.threads = threads}});
    CHECK(r.report.averaged == 4);
    CHECK(r.report.towers == 3);
    CHECK(r.report.sum_mean_squared == sb.sum_mean_squared + sh.sum_mean_squared);
    CHECK(r.report.sum_mean_of_squares == sb.sum_mean_of_squares + sh.sum_mean_of_squares);
    for (std::size_t i = 0; i < 2; ++i) {
      const at::Tensor gb = replicas[0]->body->parameters()[i].grad(), gh = replicas[0]->head->parameters()[i].grad();
      CHECK(gradavg_test::same_bits(static_cast<const Eigen::bfloat16*>(gb.data_ptr()), want_body[i].data(),
                                    want_body[i].size()));
      CHECK(gradavg_test::same_bits(static_cast<const float*>(gh.data_ptr()), want_head[i].data(),
                                    want_head[i].size()));
      const at::Tensor rb = reference_mean(body, i), rh = reference_mean(head, i);
      CHECK((gb.to(at::kDouble) - rb).abs().max().item<double>() <= 0x1p-7 * rb.abs().max().item<double>());
      CHECK((gh.to(at::kDouble) - rh).abs().max().item<double>() <= 1e-6 * rh.abs().max().item<double>());
      for (std::size_t k = 1; k < 3; ++k) {
        CHECK(bitwise_equal(replicas[k]->body->parameters()[i].grad(), gb));
        CHECK(bitwise_equal(replicas[k]->head->parameters()[i].grad(), gh));
      }
    }
  }
}

TEST_CASE("a bfloat16 body and a float head: an error in the second dtype's call leaves every replica as it was") {
  auto replicas = mixed_replicas(3, 101);
  std::vector<at::Tensor> before;
  for (const auto& m : replicas)
    for (const auto& p : m->parameters()) before.push_back(p.grad().clone());
  replicas[1]->head->bias.mutable_grad() = at::Tensor();
  const auto e = gradavg_test::exception_of<gradavg::missing_gradient_error>(
      [&] { gradavg::libtorch::average_module_gradients(replicas); });
  CHECK(gradavg_test::contains(e.what(), "'head.bias': gradient missing on tower 1"));
  std::size_t j = 0;
  for (const auto& m : replicas)
    for (const auto& p : m->parameters()) {
      const at::Tensor g = p.grad();
      if (g.defined()) CHECK(bitwise_equal(g, before[j]));
      ++j;
    }
  gradavg::options range_opts;
  range_opts.compute.range = {0, 10};
  CHECK_THROWS_AS(gradavg::libtorch::average_module_gradients(replicas, range_opts), gradavg::option_error);

  // A mean_target cast from an integer no enumerator has is refused, every replica left as it was.
  gradavg::libtorch::module_options odd;
  odd.means_to = static_cast<gradavg::libtorch::mean_target>(2);
  replicas = mixed_replicas(3, 103);
  before.clear();
  for (const auto& m : replicas)
    for (const auto& p : m->parameters()) before.push_back(p.grad().clone());
  CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::option_error>(
                                   [&] { gradavg::libtorch::average_module_gradients(replicas, {}, odd); }),
                               "module_options::means_to holds 2"));
  j = 0;
  for (const auto& m : replicas)
    for (const auto& p : m->parameters()) CHECK(bitwise_equal(p.grad(), before[j++]));
}

TEST_CASE("module replicas: module_options::include_square returns the means of squares, one per parameter") {
  for (std::size_t threads : {1u, 2u}) {
    INFO("threads " << threads);
    auto replicas = replicas_with_gradients(3, 29);
    towers_t tg(3);
    for (std::size_t k = 0; k < 3; ++k)
      for (const auto& p : replicas[k]->named_parameters())
        if (p.value().grad().defined()) tg[k].emplace_back(p.value().grad().clone(), p.key());
    const auto want = gradavg::average_gradients(tg, gradavg::include_square, {.compute = {.statistics = true}});

    const auto r = gradavg::libtorch::average_module_gradients(
        replicas, {.compute = {.statistics = true}, .run = {.threads = threads}}, {.include_square = true});
    CHECK(r.report.averaged == 4);
    CHECK(r.report.sum_mean_of_squares == want.report.sum_mean_of_squares);
    const auto params = replicas[0]->named_parameters();
    REQUIRE(r.squares.size() == params.size());
    std::size_t i = 0;
    for (std::size_t j = 0; j < params.size(); ++j) {
      INFO(params[j].key());
      if (!params[j].value().requires_grad()) {
        CHECK(!r.squares[j].defined());  // skipped
        continue;
      }
      REQUIRE(r.squares[j].defined());
      CHECK(r.squares[j].sizes() == params[j].value().sizes());
      CHECK(bitwise_equal(r.squares[j], want.squares[i].first));
      // torch's own mean of squares, in double.
      std::vector<at::Tensor> sq;
      for (const auto& tower : tg) sq.push_back(tower[i].first.to(at::kDouble).square());
      const at::Tensor ref = torch::stack(sq).mean(0);
      CHECK((r.squares[j].to(at::kDouble) - ref).abs().max().item<double>() <= 1e-6 * ref.abs().max().item<double>());
      ++i;
    }
  }
  // Without include_square: no squares.
  auto replicas = replicas_with_gradients(2, 31);
  CHECK(gradavg::libtorch::average_module_gradients(replicas).squares.empty());
}

TEST_CASE("a bfloat16 body and a float head: the means of squares of each dtype") {
  auto replicas = mixed_replicas(3, 103);
  towers_t body(3), head(3);
  for (std::size_t k = 0; k < 3; ++k)
    for (const auto& p : replicas[k]->named_parameters())
      (p.value().scalar_type() == at::kBFloat16 ? body : head)[k].emplace_back(p.value().grad().clone(), p.key());
  const auto want_body = gradavg::average_gradients(body, gradavg::include_square);
  const auto want_head = gradavg::average_gradients(head, gradavg::include_square);
  const auto r = gradavg::libtorch::average_module_gradients(replicas, {}, {.include_square = true});
  const auto params = replicas[0]->named_parameters();
  REQUIRE(r.squares.size() == params.size());
  std::size_t b = 0, h = 0;
  for (std::size_t j = 0; j < params.size(); ++j) {
    INFO(params[j].key());
    CHECK(r.squares[j].scalar_type() == params[j].value().scalar_type());
    if (params[j].value().scalar_type() == at::kBFloat16)
      CHECK(bitwise_equal(r.squares[j], want_body.squares[b++].first));
    else
      CHECK(bitwise_equal(r.squares[j], want_head.squares[h++].first));
  }
  CHECK(b == 2);
  CHECK(h == 2);
}

// A name declared in the level's inline namespace carries it in its mangled name (the typeid name
// on GCC and Clang).
TEST_CASE("libtorch: the options and report are one type for every level, data_parallel one per level", "[torch]") {
  auto in_level_namespace = [](const std::type_info& type) {
    return std::string(type.name()).find(gradavg::isa_namespace) != std::string::npos;
  };
  CHECK_FALSE(in_level_namespace(typeid(gradavg::libtorch::module_options)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::libtorch::module_report)));
  CHECK_FALSE(in_level_namespace(typeid(gradavg::libtorch::mean_target)));
  CHECK(in_level_namespace(typeid(gradavg::libtorch::data_parallel)));
}
