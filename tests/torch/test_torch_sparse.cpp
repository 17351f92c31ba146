// libtorch's sparse COO gradients (gradavg/torch_sparse.hpp): every dtype against the test's own
// densify-then-average in scalar code, bit for bit (dense outputs and the coalesced sparse
// results); an Embedding(sparse=true) module's gradients of two replicas against libtorch's own
// mean of their to_dense(); absent gradients; what is rejected and how, with the outputs untouched;
// average_module_gradients over a module with a sparse embedding and a dense head (the sparse
// mean in every replica, bit for bit; absent_as_zeros; an error that writes nothing).
#include <gradavg/torch.hpp>
#include <gradavg/torch_data_parallel.hpp>
#include <gradavg/torch_sparse.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

namespace {

using gradavg_test::accumulator_of;
using gradavg_test::rounded_square;
using pairs = std::vector<std::pair<at::Tensor, at::Tensor>>;

/// The test's densify of a sparse COO tensor's rows (sparse_types.hpp's contract): zeros; each
/// row's first values row as it is, each next one with the same index added in S, in the order
/// the tensor lists them.
template <class S>
std::vector<S> densify(const at::Tensor& g) {
  const std::int64_t rows = g.size(0);
  const std::size_t length = static_cast<std::size_t>(g.numel() / std::max<std::int64_t>(rows, 1));
  std::vector<S> dense(static_cast<std::size_t>(rows) * length, S(0));
  std::vector<bool> seen(static_cast<std::size_t>(rows), false);
  const at::Tensor ix = g._indices().contiguous(), values = g._values().contiguous();
  const auto* index = ix.data_ptr<std::int64_t>();
  const auto* v = static_cast<const S*>(values.data_ptr());
  for (std::int64_t n = 0; n < ix.size(1); ++n) {
    const auto r = static_cast<std::size_t>(index[n]);
    for (std::size_t j = 0; j < length; ++j) {
      S& d = dense[r * length + j];
      d = seen[r] ? static_cast<S>(d + v[static_cast<std::size_t>(n) * length + j]) : v[static_cast<std::size_t>(n) * length + j];
    }
    seen[r] = true;
  }
  return dense;
}

/// The means and means of squares of the towers' densified gradients: summed in tower order in
/// the accumulator, divided by T, rounded once to O.
template <class S, class O>
std::pair<std::vector<O>, std::vector<O>> reference(const std::vector<at::Tensor>& towers) {
  using A = accumulator_of<S>;
  std::vector<A> sum, squares;
  for (std::size_t k = 0; k < towers.size(); ++k) {
    const std::vector<S> d = densify<S>(towers[k]);
    sum.resize(d.size()), squares.resize(d.size());
    for (std::size_t j = 0; j < d.size(); ++j) {
      const A x = static_cast<A>(d[j]), x2 = rounded_square(x);
      sum[j] = k == 0 ? x : sum[j] + x;
      squares[j] = k == 0 ? x2 : squares[j] + x2;
    }
  }
  std::pair<std::vector<O>, std::vector<O>> out;
  for (std::size_t j = 0; j < sum.size(); ++j) {
    out.first.push_back(static_cast<O>(sum[j] / static_cast<A>(towers.size())));
    out.second.push_back(static_cast<O>(squares[j] / static_cast<A>(towers.size())));
  }
  return out;
}

/// A [rows, length] uncoalesced sparse COO tensor of dtype `dtype`: `listed` random indices with
/// repeats, values in [-1, 1].
at::Tensor random_coo(std::mt19937& gen, std::int64_t rows, std::int64_t length, std::int64_t listed, at::ScalarType dtype) {
  std::uniform_int_distribution<std::int64_t> row(0, rows - 1);
  std::uniform_real_distribution<float> value(-1, 1);
  at::Tensor indices = at::empty({1, listed}, at::kLong);
  at::Tensor values = at::empty({listed, length}, at::kFloat);
  for (std::int64_t n = 0; n < listed; ++n) {
    indices[0][n] = row(gen);
    for (std::int64_t j = 0; j < length; ++j) values[n][j] = value(gen);
  }
  return at::sparse_coo_tensor(indices, values.to(dtype), {rows, length});
}

/// The elements of a dense tensor as O.
template <class O>
std::vector<O> elements(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const O*>(c.data_ptr());
  return std::vector<O>(p, p + c.numel());
}

template <class O>
bool same_bits(const std::vector<O>& a, const std::vector<O>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(O)) == 0);
}

/// Checks dtype S's gradients (over 3 towers, the third with no rows) into outputs of O, dense
/// and coalesced, against the reference.
template <class S, class O>
void check_dtype(at::ScalarType s, at::ScalarType o) {
  std::mt19937 gen(7);
  const std::int64_t rows = 40, length = 6;
  std::vector<at::Tensor> g = {random_coo(gen, rows, length, 30, s), random_coo(gen, rows, length, 9, s),
                               random_coo(gen, rows, length, 0, s)};
  const at::Tensor table = torch::zeros({rows, length});
  std::vector<pairs> towers(3);
  for (std::size_t k = 0; k < 3; ++k) towers[k] = {{g[k], table}};
  const auto [means_ref, squares_ref] = reference<S, O>(g);

  std::vector<at::Tensor> means{torch::full({rows, length}, -7.0, o)}, squares{torch::full({rows, length}, -7.0, o)};
  const gradavg::summary r = gradavg::libtorch::average_sparse_gradients_into(towers, means, squares);
  CHECK(r.averaged == 1);
  CHECK(same_bits(elements<O>(means[0]), means_ref));
  CHECK(same_bits(elements<O>(squares[0]), squares_ref));

  if constexpr (std::is_same_v<S, O>) {
    const auto result = gradavg::libtorch::average_sparse_gradients(towers, gradavg::include_square);
    REQUIRE(result.gradients.size() == 1);
    const at::Tensor& mean = result.gradients[0].first;
    CHECK(mean.is_sparse());
    CHECK(mean.is_coalesced());
    CHECK(mean.scalar_type() == s);
    CHECK(mean.sizes() == at::IntArrayRef{rows, length});
    CHECK(result.gradients[0].second.unsafeGetTensorImpl() == table.unsafeGetTensorImpl());
    // The listed rows, ascending, each once, and the reference's values there; to_dense() (zeros
    // elsewhere) equals the reference wherever no tower lists a row, which is +0 there.
    std::vector<std::int64_t> listed;
    for (const at::Tensor& t : g)
      for (std::int64_t n = 0; n < t._indices().size(1); ++n) listed.push_back(t._indices()[0][n].item<std::int64_t>());
    std::sort(listed.begin(), listed.end());
    listed.erase(std::unique(listed.begin(), listed.end()), listed.end());
    CHECK(elements<std::int64_t>(mean._indices()) == listed);
    CHECK(same_bits(elements<S>(mean.to_dense()), means_ref));
    CHECK(same_bits(elements<S>(result.squares[0].first.to_dense()), squares_ref));
  }
}

}  // namespace

TEST_CASE("sparse COO gradients of every dtype: dense and coalesced outputs, bit for bit the test's densify-then-average") {
  SECTION("float") { check_dtype<float, float>(at::kFloat, at::kFloat); }
  SECTION("double") { check_dtype<double, double>(at::kDouble, at::kDouble); }
  SECTION("half") { check_dtype<Eigen::half, Eigen::half>(at::kHalf, at::kHalf); }
  SECTION("half into float") { check_dtype<Eigen::half, float>(at::kHalf, at::kFloat); }
  SECTION("bfloat16") { check_dtype<Eigen::bfloat16, Eigen::bfloat16>(at::kBFloat16, at::kBFloat16); }
  SECTION("bfloat16 into float") { check_dtype<Eigen::bfloat16, float>(at::kBFloat16, at::kFloat); }
}

TEST_CASE("an Embedding(sparse=true) of two replicas: the mean of their gradients is libtorch's mean of to_dense()") {
  torch::manual_seed(3);
  torch::nn::Embedding a(torch::nn::EmbeddingOptions(100, 8).sparse(true));
  torch::nn::Embedding b(torch::nn::EmbeddingOptions(100, 8).sparse(true));
  b->weight.data().copy_(a->weight.data());
  const at::Tensor words_a = torch::randint(0, 100, {4, 12}, at::kLong), words_b = torch::randint(0, 100, {4, 12}, at::kLong);
  (a->forward(words_a).pow(2).sum()).backward();
  (b->forward(words_b) * 3).sum().backward();
  REQUIRE(a->weight.grad().is_sparse());
  std::vector<pairs> towers{{{a->weight.grad(), a->weight}}, {{b->weight.grad(), a->weight}}};
  std::vector<at::Tensor> means{torch::empty({100, 8})};
  gradavg::libtorch::average_sparse_gradients_into(towers, means);
  const at::Tensor expected = (a->weight.grad().to_dense() + b->weight.grad().to_dense()) / 2;
  CHECK(torch::allclose(means[0], expected, 1e-6, 1e-6));
  // Rows neither replica looked up are zero.
  const at::Tensor looked_up = torch::zeros({100}, at::kBool).index_fill_(0, torch::cat({words_a.flatten(), words_b.flatten()}), true);
  CHECK(means[0].index({looked_up.logical_not()}).abs().sum().item<float>() == 0);
}

TEST_CASE("sparse COO gradients: absent on every tower is skipped, on some a missing_gradient_error") {
  std::mt19937 gen(1);
  const at::Tensor table = torch::zeros({10, 2}), other = torch::zeros({5, 3});
  const at::Tensor g = random_coo(gen, 10, 2, 4, at::kFloat);
  std::vector<pairs> towers{{{g, table}, {at::Tensor(), other}}, {{g, table}, {at::Tensor(), other}}};
  std::vector<at::Tensor> means{torch::empty({10, 2}), at::Tensor()};
  const gradavg::summary r = gradavg::libtorch::average_sparse_gradients_into(towers, means);
  CHECK(r.averaged == 1);
  CHECK(r.skipped == 1);
  const auto allocated = gradavg::libtorch::average_sparse_gradients(towers);
  CHECK(allocated.gradients.size() == 1);
  CHECK(allocated.skipped.size() == 1);

  towers[1][0].first = at::Tensor();
  const at::Tensor before = means[0].clone();
  CHECK_THROWS_AS(gradavg::libtorch::average_sparse_gradients_into(towers, means), gradavg::missing_gradient_error);
  CHECK(torch::equal(means[0], before));
}

TEST_CASE("sparse COO gradients: what is rejected names the variable and the tower, and writes nothing") {
  std::mt19937 gen(2);
  const at::Tensor table = torch::zeros({10, 2}), bias = torch::zeros({2});
  const at::Tensor g = random_coo(gen, 10, 2, 4, at::kFloat);
  std::vector<at::Tensor> means{torch::full({10, 2}, -3.0), torch::full({2}, -3.0)};
  const at::Tensor before = means[0].clone();
  auto rejected = [&](std::vector<pairs> towers, std::vector<at::Tensor> outputs, const std::string& words) -> std::string {
    try {
      gradavg::libtorch::average_sparse_gradients_into(towers, outputs);
    } catch (const gradavg::error& e) {
      CHECK(torch::equal(means[0], before));
      CHECK(gradavg_test::contains(e.what(), words));
      return typeid(e).name();
    }
    FAIL("no error");
    return {};
  };
  const at::Tensor bias_g = random_coo(gen, 2, 1, 1, at::kFloat).to_dense().flatten();
  SECTION("a dense gradient") {
    const std::string t = rejected({{{g, table}, {bias_g, bias}}, {{g, table}, {bias_g, bias}}}, means,
                                   "variable #1");
    CHECK(t == typeid(gradavg::unsupported_tensor_error).name());
  }
  SECTION("another dtype on tower 1") {
    const std::string t = rejected({{{g, table}}, {{g.to(at::kDouble), table}}}, {means[0]}, "tower 1");
    CHECK(t == typeid(gradavg::element_type_error).name());
  }
  SECTION("an index outside the rows") {
    // libtorch's checked constructor refuses it; the unchecked one (as a custom op could) does not.
    const at::Tensor bad =
        at::_sparse_coo_tensor_unsafe(torch::tensor({{3, 12}}, at::kLong), torch::ones({2, 2}), {10, 2});
    std::vector<pairs> towers{{{g, table}}, {{bad, table}}};
    std::vector<at::Tensor> out{means[0]};
    CHECK_THROWS_AS(gradavg::libtorch::average_sparse_gradients_into(towers, out), gradavg::index_error);
    CHECK(torch::equal(means[0], before));
  }
  SECTION("towers of different dense shapes") {
    const at::Tensor wide = random_coo(gen, 10, 3, 2, at::kFloat);
    const std::string t = rejected({{{g, table}}, {{wide, table}}}, {means[0]}, "variable #0");
    CHECK(t == typeid(gradavg::shape_error).name());
  }
  SECTION("an output of another dtype") {
    const std::string t = rejected({{{g, table}}, {{g, table}}}, {torch::zeros({10, 2}, at::kDouble)}, "Double");
    CHECK(t == typeid(gradavg::output_error).name());
  }
  SECTION("a transposed output (its memory holds the dense shape, its sizes do not)") {
    const std::string t = rejected({{{g, table}}, {{g, table}}}, {torch::zeros({10, 2}).t()}, "[2, 10]");
    CHECK(t == typeid(gradavg::output_error).name());
  }
  SECTION("an output of another shape") {
    const std::string t = rejected({{{g, table}}, {{g, table}}}, {torch::zeros({2, 10})}, "variable #0");
    CHECK(t == typeid(gradavg::output_error).name());
  }
}

namespace {

/// An embedding with sparse gradients, then a dense head.
struct BagImpl : torch::nn::Module {
  BagImpl()
      : emb(register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(60, 4).sparse(true)))),
        head(register_module("head", torch::nn::Linear(4, 3))) {}
  at::Tensor forward(const at::Tensor& words) { return head->forward(emb->forward(words).mean(1)); }
  torch::nn::Embedding emb;
  torch::nn::Linear head;
};
TORCH_MODULE(Bag);

/// K replicas of one Bag (the same parameters, from seed 11).
std::vector<Bag> same_bags(std::size_t k_count) {
  torch::manual_seed(11);
  std::vector<Bag> bags;
  for (std::size_t k = 0; k < k_count; ++k) {
    bags.emplace_back();
    if (k > 0)
      for (std::size_t i = 0; i < bags[0]->parameters().size(); ++i)
        bags[k]->parameters()[i].data().copy_(bags[0]->parameters()[i].data());
  }
  return bags;
}

/// Each replica's backward on its own words (replica k's the same for every call).
void run_backward(std::vector<Bag>& bags) {
  for (std::size_t k = 0; k < bags.size(); ++k) {
    torch::manual_seed(100 + k);
    bags[k]->forward(torch::randint(0, 60, {5, 7}, at::kLong)).pow(2).sum().backward();
  }
}

std::vector<Bag> bags_after_backward(std::size_t k_count) {
  auto bags = same_bags(k_count);
  run_backward(bags);
  return bags;
}

}  // namespace

TEST_CASE("average_module_gradients over an Embedding(sparse=true): the sparse mean in every replica, the dense head as before") {
  const std::size_t k_count = 3;
  auto bags = bags_after_backward(k_count);
  std::vector<at::Tensor> emb_grads, head_grads;
  for (auto& b : bags) emb_grads.push_back(b->emb->weight.grad()), head_grads.push_back(b->head->weight.grad().clone());
  REQUIRE(emb_grads[0].is_sparse());
  const auto [means_ref, squares_ref] = reference<float, float>(emb_grads);

  gradavg::libtorch::module_options mopts;
  mopts.include_square = true;
  const auto report = gradavg::libtorch::average_module_gradients(bags, {}, mopts);
  CHECK(report.report.averaged == 3);
  CHECK(report.skipped.empty());
  for (auto& b : bags) {
    const at::Tensor g = b->emb->weight.grad();
    CHECK(g.is_sparse());
    CHECK(g.is_coalesced());
    CHECK(same_bits(elements<float>(g.to_dense()), means_ref));
    CHECK(torch::allclose(b->head->weight.grad(), (head_grads[0] + head_grads[1] + head_grads[2]) / 3, 1e-6, 1e-6));
    CHECK(torch::equal(b->head->weight.grad(), bags[0]->head->weight.grad()));
  }
  REQUIRE(report.squares.size() == 3);  // emb.weight, head.weight, head.bias
  CHECK(report.squares[0].is_sparse());
  CHECK(same_bits(elements<float>(report.squares[0].to_dense()), squares_ref));
  CHECK(torch::allclose(bags[0]->emb->weight.grad().to_dense(),
                        (emb_grads[0].to_dense() + emb_grads[1].to_dense() + emb_grads[2].to_dense()) / 3, 1e-6, 1e-6));
  // An optimizer that takes sparse gradients steps with it.
  torch::optim::SGD sgd(bags[0]->parameters(), torch::optim::SGDOptions(0.1));
  const at::Tensor before = bags[0]->emb->weight.detach().clone();
  sgd.step();
  CHECK(torch::allclose(bags[0]->emb->weight.detach(), before - 0.1 * bags[0]->emb->weight.grad().to_dense()));
}

TEST_CASE("average_module_gradients over an Embedding(sparse=true): absent on a replica, as zeros or an error that writes nothing") {
  auto bags = bags_after_backward(2);
  bags[1]->emb->weight.mutable_grad() = at::Tensor();
  const at::Tensor emb0 = bags[0]->emb->weight.grad();
  const at::Tensor head0 = bags[0]->head->weight.grad().clone(), head1 = bags[1]->head->weight.grad().clone();
  CHECK_THROWS_AS(gradavg::libtorch::average_module_gradients(bags), gradavg::missing_gradient_error);
  CHECK(torch::equal(bags[0]->head->weight.grad(), head0));
  CHECK(bags[0]->emb->weight.grad().unsafeGetTensorImpl() == emb0.unsafeGetTensorImpl());

  gradavg::libtorch::module_options mopts;
  mopts.absent_as_zeros = true;
  const auto report = gradavg::libtorch::average_module_gradients(bags, {}, mopts);
  CHECK(report.zero_filled == std::vector<std::string>{"emb.weight"});
  CHECK(report.report.averaged == 3);
  CHECK(torch::allclose(bags[1]->emb->weight.grad().to_dense(), emb0.to_dense() / 2));
  CHECK(torch::allclose(bags[1]->head->weight.grad(), (head0 + head1) / 2));
}

TEST_CASE("data_parallel over an Embedding(sparse=true): the embedding outside the buckets, its mean that of average_module_gradients") {
  auto reference = bags_after_backward(3);
  gradavg::libtorch::average_module_gradients(reference);

  auto bags = same_bags(3);
  gradavg::libtorch::data_parallel dp(bags, {}, {}, gradavg::libtorch::bucket_options{.bytes = 16});
  for (const auto& bucket : dp.buckets())
    CHECK(std::find(bucket.begin(), bucket.end(), std::size_t{0}) == bucket.end());  // emb.weight
  for (int step = 0; step < 2; ++step) {
    for (auto& b : bags) b->zero_grad(true);
    run_backward(bags);
    const auto report = dp.finish();
    CHECK(report.report.averaged == 3);
    CHECK(report.report.skipped == 0);
    CHECK(report.skipped.empty());
    for (auto& b : bags) {
      CHECK(b->emb->weight.grad().is_sparse());
      CHECK(torch::equal(b->emb->weight.grad().to_dense(), reference[0]->emb->weight.grad().to_dense()));
      CHECK(torch::equal(b->head->weight.grad(), reference[0]->head->weight.grad()));
      CHECK(torch::equal(b->head->bias.grad(), reference[0]->head->bias.grad()));
    }
  }
}
