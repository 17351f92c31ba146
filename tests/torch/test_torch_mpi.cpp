// torch::Tensor gradients across processes (run-time element types, and the module helper of
// gradavg/torch_processes.hpp): built as test_torch_mpi for gradavg::mpi under mpiexec, and with
// GRADAVG_TEST_C10D as test_torch_c10d for gradavg::c10d over gloo, started by
// support/launch_ranks.sh (support/process_world.hpp); ctest runs each with 2 and 3 ranks, each
// with a timeout. Rank r holds r + 1 towers (replicas). Every rank regenerates every rank's
// gradients from a seed, so each can compute the references itself: the same call through
// std::span gradients of the static element type (bit for bit: the dispatch picked that kernel),
// and torch's double mean over all towers of all ranks. Results are compared bit for bit across
// ranks. Failures are provoked on one rank only: every rank throws, nothing is written.
#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "process_world.hpp"
#include "support.hpp"
#include "torch_models.hpp"

using namespace gradavg_test::models;  // Net, TwoHeads, BatchNormNet, Mixed

namespace {

using gradavg_test::contains;
using gradavg_test::exception_of;

using gradavg_test::same_on_every_rank;

std::size_t world_rank() { return static_cast<std::size_t>(gradavg_test::world_rank()); }
std::size_t world_size() { return static_cast<std::size_t>(gradavg_test::world_size()); }
/// Rank r's first tower and tower count (r + 1 towers each).
std::size_t first_tower(std::size_t r) { return r * (r + 1) / 2; }
std::size_t total_towers() { return first_tower(world_size()); }

/// fnv1a of the tensors' bytes in memory order (undefined ones hash as a marker).
std::uint64_t hash_of(const std::vector<at::Tensor>& tensors) {
  std::uint64_t h = gradavg_test::fnv_offset;
  for (const auto& t : tensors) {
    if (!t.defined()) {
      h = gradavg_test::fnv1a("undefined", 9, h);
      continue;
    }
    const at::Tensor c = t.contiguous();
    h = gradavg_test::fnv1a(c.data_ptr(), static_cast<std::size_t>(c.numel()) * c.element_size(), h);
  }
  return h;
}

using entry = gradavg_test::torch_entry;
using towers_t = gradavg_test::torch_towers;
using gradavg_test::outputs_like;
using gradavg_test::reference_mean;

/// Every rank's towers, the same on every rank: variable i has shape sizes[i].
towers_t all_towers(const std::vector<std::vector<std::int64_t>>& sizes, at::ScalarType dtype, std::uint64_t seed) {
  torch::manual_seed(seed);
  towers_t tg(total_towers());
  for (auto& tower : tg)
    for (std::size_t i = 0; i < sizes.size(); ++i)
      tower.emplace_back(torch::randn(sizes[i]).to(dtype), "v" + std::to_string(i));
  return tg;
}

towers_t local_towers(const towers_t& all) {
  const std::size_t r = world_rank();
  return towers_t(all.begin() + static_cast<std::ptrdiff_t>(first_tower(r)),
                  all.begin() + static_cast<std::ptrdiff_t>(first_tower(r) + r + 1));
}

/// The same call through std::span<const S> gradients into std::vector<O> outputs.
template <class S, class O>
std::vector<std::vector<O>> span_path(const towers_t& tg, const gradavg_test::world_options& opts) {
  return gradavg_test::through_spans<S, O>(tg, [&](const auto& st, auto& means) {
    gradavg_test::across::average_gradients_into(gradavg_test::world(), st, means, opts);
  });
}

template <class S, class O>
void check_dtype(at::ScalarType dtype, at::ScalarType out_dtype, double tolerance) {
  const towers_t all = all_towers({{4, 5}, {3000}, {}, {7, 3, 2}}, dtype, 17);
  const towers_t local = local_towers(all);
  for (std::size_t fusion_bytes : {std::size_t{60}, std::size_t{0}}) {
    INFO("fusion_bytes " << fusion_bytes);
    gradavg_test::world_options opts;
    opts.exchange.fusion_bytes = fusion_bytes;
    auto means = outputs_like(local, out_dtype);
    const gradavg::summary s = gradavg_test::across::average_gradients_into(gradavg_test::world(), local, means, opts);
    CHECK(s.averaged == 4);
    CHECK(s.towers == total_towers());
    const auto want = span_path<S, O>(local, opts);
    for (std::size_t i = 0; i < means.size(); ++i) {
      INFO("variable " << i);
      CHECK(means[i].scalar_type() == out_dtype);
      CHECK(gradavg_test::same_bits(static_cast<const O*>(means[i].data_ptr()), want[i].data(), want[i].size()));
      const at::Tensor ref = reference_mean(all, i);
      CHECK((means[i].to(at::kDouble) - ref).abs().max().item<double>() <= tolerance * (ref.abs().max().item<double>() + 1e-30));
    }
    CHECK(same_on_every_rank(hash_of(means)));
  }
}

/// Every rank's replicas (all of them, on every rank) of one model, each with the gradient of its
/// own 8 rows of a batch.
std::vector<Net> all_replicas(std::uint64_t seed) { return replicas_with_gradients(total_towers(), seed); }

std::vector<Net> local_replicas(const std::vector<Net>& all) {
  const std::size_t r = world_rank();
  return std::vector<Net>(all.begin() + static_cast<std::ptrdiff_t>(first_tower(r)),
                          all.begin() + static_cast<std::ptrdiff_t>(first_tower(r) + r + 1));
}

std::vector<at::Tensor> gradients_of(const Net& m) {
  std::vector<at::Tensor> g;
  for (const auto& p : m->parameters()) g.push_back(p.grad());
  return g;
}

}  // namespace

TEST_CASE("every dtype across ranks: the bits of the span path, the same on every rank, close to the double mean") {
  // Tolerances relative to the largest |mean|: the sum's rounding, and the output's for 16 bits.
  check_dtype<float, float>(at::kFloat, at::kFloat, 1e-6);
  check_dtype<double, double>(at::kDouble, at::kDouble, 1e-14);
  check_dtype<Eigen::half, Eigen::half>(at::kHalf, at::kHalf, 0x1p-10);
  check_dtype<Eigen::half, float>(at::kHalf, at::kFloat, 1e-6);
  check_dtype<Eigen::bfloat16, Eigen::bfloat16>(at::kBFloat16, at::kBFloat16, 0x1p-7);
  check_dtype<Eigen::bfloat16, float>(at::kBFloat16, at::kFloat, 1e-6);
}

TEST_CASE("the allocating API across ranks returns tensors of the gradients' dtype, the bits of the into call") {
  const towers_t all = all_towers({{3, 2}, {50}}, at::kBFloat16, 3);
  const towers_t local = local_towers(all);
  const auto r = gradavg_test::across::average_gradients(gradavg_test::world(), local, gradavg::include_square);
  REQUIRE(r.gradients.size() == 2);
  auto means = outputs_like(local, at::kBFloat16);
  auto squares = outputs_like(local, at::kBFloat16);
  gradavg_test::across::average_gradients_into(gradavg_test::world(), local, means, squares);
  std::vector<at::Tensor> got_means, got_squares;
  for (std::size_t i = 0; i < 2; ++i) {
    INFO("variable " << i);
    CHECK(r.gradients[i].first.scalar_type() == at::kBFloat16);
    CHECK(r.gradients[i].first.sizes() == local[0][i].first.sizes());
    CHECK(r.gradients[i].second == "v" + std::to_string(i));
    got_means.push_back(r.gradients[i].first);
    got_squares.push_back(r.squares[i].first);
  }
  CHECK(hash_of(got_means) == hash_of(means));
  CHECK(hash_of(got_squares) == hash_of(squares));
  CHECK(same_on_every_rank(hash_of(got_means) ^ hash_of(got_squares)));
}

TEST_CASE("module replicas across ranks: every replica of every rank holds the mean over all of them") {
  auto all = all_replicas(23);
  // References before the call, from every replica's own gradient.
  const std::size_t parameter_count = all[0]->parameters().size();
  std::vector<at::Tensor> want(parameter_count);
  for (std::size_t i = 0; i < parameter_count; ++i) {
    std::vector<at::Tensor> g;
    for (const auto& m : all)
      if (m->parameters()[i].grad().defined()) g.push_back(m->parameters()[i].grad().to(at::kDouble));
    if (!g.empty()) want[i] = torch::stack(g).mean(0);
  }
  auto local = local_replicas(all);
  gradavg_test::world_options opts;
  opts.compute.statistics = true;
  const auto r = gradavg::libtorch::average_module_gradients(gradavg_test::world(), local, opts);
  CHECK(r.report.averaged == 4);
  CHECK(r.report.towers == total_towers());
  CHECK(r.skipped == std::vector<std::string>{"frozen.weight", "frozen.bias"});
  const auto g0 = gradients_of(local[0]);
  double sum_squares = 0;
  for (std::size_t i = 0; i < parameter_count; ++i) {
    INFO("parameter " << i);
    REQUIRE(g0[i].defined() == want[i].defined());
    if (!want[i].defined()) continue;
    CHECK((g0[i].to(at::kDouble) - want[i]).abs().max().item<double>() <= 1e-6 * want[i].abs().max().item<double>());
    sum_squares += want[i].square().sum().item<double>();
  }
  CHECK(std::abs(r.report.sum_mean_squared - sum_squares) <= 1e-6 * sum_squares);
  for (const auto& m : local) CHECK(hash_of(gradients_of(m)) == hash_of(g0));
  CHECK(same_on_every_rank(hash_of(g0)));
}

TEST_CASE("sharded output of torch::Tensor gradients, then gather_shards of torch::Tensor parameters: the replicated "
          "means on every rank") {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    INFO("dtype " << dtype);
    const towers_t all = all_towers({{3, 40}, {700}, {5}}, dtype, 2);
    const towers_t local = local_towers(all);
    auto replicated = outputs_like(local, dtype);
    gradavg_test::across::average_gradients_into(gradavg_test::world(), local, replicated);
    auto sharded = outputs_like(local, dtype);
    gradavg_test::world_options opts;
    opts.exchange.output = gradavg::output_mode::sharded;
    opts.exchange.fusion_bytes = 256;
    const gradavg::summary s = gradavg_test::across::average_gradients_into(gradavg_test::world(), local, sharded, opts);
    CHECK(s.shard.end - s.shard.begin == 825 * (world_rank() + 1) / world_size() - 825 * world_rank() / world_size());
    gradavg_test::across::gather_shards(gradavg_test::world(), sharded, opts);
    CHECK(hash_of(sharded) == hash_of(replicated));
    CHECK(same_on_every_rank(hash_of(sharded)));
  }
  // Parameters of two dtypes: element_type_error on that rank, remote_error elsewhere.
  std::vector<at::Tensor> mixed = {at::zeros({4}, at::kFloat), at::zeros({4}, world_rank() == 0 ? at::kDouble : at::kFloat)};
  auto gather = [&] { gradavg_test::across::gather_shards(gradavg_test::world(), mixed); };
  if (world_rank() == 0)
    CHECK(contains(gradavg_test::message_of<gradavg::element_type_error>(gather), "every parameter holds one element type"));
  else
    CHECK(contains(gradavg_test::message_of<gradavg::remote_error>(gather), "rank 0 failed its own checks"));
}

TEST_CASE("another dtype on one rank: option_error on every rank naming it and what each side has, nothing written") {
  const towers_t all = all_towers({{4}, {5}}, at::kFloat, 5);
  // The odd rank is the last, then rank 0: with 3 ranks or more the others agree, and the message
  // names the odd one whichever it is (with 2, neither is the odd one: both are named).
  for (const std::size_t odd : {world_size() - 1, std::size_t{0}}) {
    INFO("rank " << odd << " passes float64");
    towers_t local = local_towers(all);
    if (world_rank() == odd)
      for (auto& tower : local)
        for (auto& e : tower) e.first = e.first.to(at::kDouble);
    auto means = outputs_like(local, world_rank() == odd ? at::kDouble : at::kFloat);
    const auto before = hash_of(means);
    const std::string m =
        exception_of<gradavg::option_error>([&] { gradavg_test::across::average_gradients_into(gradavg_test::world(), local, means); })
            .what();
    if (world_size() >= 3)
      CHECK(contains(m, "rank " + std::to_string(odd) + " passes float64 gradients into float64 outputs but ranks "));
    else
      CHECK(contains(m, "rank 1 passes float" + std::string(odd == 1 ? "64" : "32")));
    CHECK(contains(m, "float32 gradients into float32 outputs"));
    CHECK(contains(m, "float64 gradients into float64 outputs"));
    CHECK(hash_of(means) == before);
    CHECK(same_on_every_rank(42));
  }
}

TEST_CASE("mixed dtypes within one rank: element_type_error there, remote_error elsewhere, nothing written") {
  const towers_t all = all_towers({{4}, {5}}, at::kFloat, 6);
  towers_t local = local_towers(all);
  const std::size_t last = world_size() - 1;
  if (world_rank() == last) local.back()[1].first = local.back()[1].first.to(at::kHalf);
  auto means = outputs_like(local, at::kFloat);
  const auto before = hash_of(means);
  auto call = [&] { gradavg_test::across::average_gradients_into(gradavg_test::world(), local, means); };
  if (world_rank() == last) {
    CHECK(contains(exception_of<gradavg::element_type_error>(call).what(), "variable #1 'v1'"));
  } else {
    CHECK(contains(exception_of<gradavg::remote_error>(call).what(), "rank " + std::to_string(last)));
  }
  CHECK(hash_of(means) == before);
  CHECK(same_on_every_rank(42));
}

TEST_CASE("a module whose parameters differ on one rank: variable_mismatch_error on every rank, no gradient changed") {
  auto all = all_replicas(29);
  auto local = local_replicas(all);
  std::vector<std::uint64_t> before;
  for (const auto& m : local) before.push_back(hash_of(gradients_of(m)));
  // One rank's model lists its layers in another order: same count, different names in place.
  struct OtherImpl : torch::nn::Module {
    OtherImpl() {
      fc2 = register_module("fc2", torch::nn::Linear(16, 3));
      fc1 = register_module("fc1", torch::nn::Linear(6, 16));
      frozen = register_module("frozen", torch::nn::Linear(3, 3));
    }
    torch::nn::Linear fc2{nullptr}, fc1{nullptr}, frozen{nullptr};
  };
  // Rank 1's replicas all of that model: consistent within the rank, not with the others.
  std::vector<std::shared_ptr<OtherImpl>> others;
  std::vector<torch::nn::Module*> modules;
  for (auto& m : local) {
    modules.push_back(m.get());
    if (world_rank() != 1) continue;
    others.push_back(std::make_shared<OtherImpl>());
    for (auto& p : others.back()->parameters()) p.mutable_grad() = torch::zeros_like(p);
    modules.back() = others.back().get();
  }
  const std::string m = exception_of<gradavg::variable_mismatch_error>([&] {
                          gradavg::libtorch::average_module_gradients(gradavg_test::world(), std::span(modules));
                        }).what();
  CHECK(!m.empty());
  for (std::size_t k = 0; k < local.size(); ++k) CHECK(hash_of(gradients_of(local[k])) == before[k]);
  CHECK(same_on_every_rank(42));
}

TEST_CASE("a null replica on one rank: tower_error there, remote_error elsewhere, no gradient changed, no hang") {
  auto all = all_replicas(31);
  auto local = local_replicas(all);
  std::vector<std::uint64_t> before;
  std::vector<torch::nn::Module*> modules;
  for (auto& m : local) {
    before.push_back(hash_of(gradients_of(m)));
    modules.push_back(m.get());
  }
  const std::size_t last = world_size() - 1;
  if (world_rank() == last) modules.back() = nullptr;
  auto call = [&] { gradavg::libtorch::average_module_gradients(gradavg_test::world(), std::span(modules)); };
  if (world_rank() == last)
    CHECK(contains(exception_of<gradavg::tower_error>(call).what(), "is null"));
  else
    CHECK(contains(exception_of<gradavg::remote_error>(call).what(), "rank " + std::to_string(last)));
  for (std::size_t k = 0; k < local.size(); ++k) CHECK(hash_of(gradients_of(local[k])) == before[k]);
  CHECK(same_on_every_rank(42));
}

namespace {

/// Every rank's replicas of one TwoHeads (all of them, on every rank), each with the gradient of
/// its own 8 rows; the aux head takes part on the towers below aux_towers only.
std::vector<TwoHeads> all_two_heads(std::uint64_t seed, std::size_t aux_towers) {
  torch::manual_seed(seed);
  TwoHeads model;
  const std::size_t k_count = total_towers();
  std::vector<TwoHeads> r{model};
  for (std::size_t k = 1; k < k_count; ++k) r.push_back(std::dynamic_pointer_cast<TwoHeadsImpl>(model->clone()));
  const at::Tensor x = torch::randn({static_cast<std::int64_t>(8 * k_count), 6});
  const at::Tensor y = torch::randint(0, 3, {static_cast<std::int64_t>(8 * k_count)});
  for (std::size_t k = 0; k < k_count; ++k) {
    const auto first = static_cast<std::int64_t>(8 * k);
    const auto rows = torch::indexing::Slice(first, first + 8);
    torch::nn::functional::cross_entropy(r[k]->forward(x.index({rows}), k < aux_towers), y.index({rows})).backward();
  }
  return r;
}

/// Per parameter, the mean over all towers in double, a missing gradient counted as zeros.
std::vector<at::Tensor> mean_with_zeros(const std::vector<TwoHeads>& all) {
  std::vector<at::Tensor> want;
  for (std::size_t i = 0; i < all[0]->parameters().size(); ++i) {
    std::vector<at::Tensor> g;
    for (const auto& m : all) {
      const at::Tensor p = m->parameters()[i];
      g.push_back(p.grad().defined() ? p.grad().to(at::kDouble) : torch::zeros_like(p, torch::dtype(at::kDouble)));
    }
    want.push_back(torch::stack(g).mean(0));
  }
  return want;
}

std::vector<TwoHeads> local_of(const std::vector<TwoHeads>& all) {
  const std::size_t r = world_rank();
  return std::vector<TwoHeads>(all.begin() + static_cast<std::ptrdiff_t>(first_tower(r)),
                               all.begin() + static_cast<std::ptrdiff_t>(first_tower(r) + r + 1));
}

std::vector<at::Tensor> gradients_of(const TwoHeads& m) {
  std::vector<at::Tensor> g;
  for (const auto& p : m->parameters()) g.push_back(p.grad());
  return g;
}

}  // namespace

TEST_CASE("absent_as_zeros across ranks: the aux head's gradient absent on the last rank's replicas only") {
  const std::size_t last = world_size() - 1;
  auto all = all_two_heads(73, first_tower(last));  // the last rank's towers leave the aux head out
  const auto want = mean_with_zeros(all);
  auto local = local_of(all);
  std::vector<std::uint64_t> before;
  for (const auto& m : local) before.push_back(hash_of(gradients_of(m)));
  SECTION("by default: missing_gradient_error on every rank, nothing written") {
    const std::string m = exception_of<gradavg::missing_gradient_error>([&] {
                            gradavg::libtorch::average_module_gradients(gradavg_test::world(), local);
                          }).what();
    CHECK(contains(m, "'aux.weight': gradient missing on rank " + std::to_string(last)));
    for (std::size_t k = 0; k < local.size(); ++k) CHECK(hash_of(gradients_of(local[k])) == before[k]);
  }
  SECTION("absent_as_zeros: zeros in their place, every replica of every rank holds the mean") {
    const auto r = gradavg::libtorch::average_module_gradients(gradavg_test::world(), local, {}, {.absent_as_zeros = true});
    CHECK(r.report.averaged == 6);
    CHECK(r.report.towers == total_towers());
    CHECK(r.skipped.empty());
    CHECK(r.zero_filled == std::vector<std::string>{"aux.weight", "aux.bias"});
    const auto g0 = gradients_of(local[0]);
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO("parameter " << i);
      REQUIRE(g0[i].defined());
      CHECK((g0[i].to(at::kDouble) - want[i]).abs().max().item<double>() <= 1e-6 * want[i].abs().max().item<double>());
    }
    for (const auto& m : local) CHECK(hash_of(gradients_of(m)) == hash_of(g0));
    CHECK(same_on_every_rank(hash_of(g0)));
  }
  SECTION("absent_as_zeros set on rank 0 only: option_error on every rank, nothing written") {
    const std::string m = exception_of<gradavg::option_error>([&] {
                            gradavg::libtorch::average_module_gradients(gradavg_test::world(), local, {},
                                                                        {.absent_as_zeros = world_rank() == 0});
                          }).what();
    CHECK(contains(m, "absent_as_zeros is set on some ranks but not on others"));
    for (std::size_t k = 0; k < local.size(); ++k) CHECK(hash_of(gradients_of(local[k])) == before[k]);
  }
  CHECK(same_on_every_rank(42));
}

TEST_CASE("absent_as_zeros across ranks: a gradient absent on every replica of every rank is skipped") {
  auto all = all_two_heads(79, 0);
  const auto want = mean_with_zeros(all);
  auto local = local_of(all);
  const auto r = gradavg::libtorch::average_module_gradients(gradavg_test::world(), local, {}, {.absent_as_zeros = true});
  CHECK(r.report.averaged == 4);
  CHECK(r.skipped == std::vector<std::string>{"aux.weight", "aux.bias"});
  CHECK(r.zero_filled.empty());
  for (const auto& m : local) CHECK(!m->aux->weight.grad().defined());
  const at::Tensor g = local[0]->head->weight.grad();
  CHECK((g.to(at::kDouble) - want[2]).abs().max().item<double>() <= 1e-6 * want[2].abs().max().item<double>());
  CHECK(same_on_every_rank(hash_of(gradients_of(local[0]))));
}

namespace {

/// Rank r's r + 1 replicas as that rank builds them (any rank can rebuild them): a model of its
/// own seed, every replica's parameters perturbed and its running statistics from its own data.
std::vector<BatchNormNet> rank_replicas(std::size_t r, std::int64_t width = 8) {
  torch::manual_seed(1000 + r);
  BatchNormNet model(width);
  std::vector<BatchNormNet> replicas{model};
  for (std::size_t k = 1; k <= r; ++k)
    replicas.push_back(std::dynamic_pointer_cast<BatchNormNetImpl>(model->clone()));
  torch::NoGradGuard no_grad;
  for (std::size_t k = 0; k <= r; ++k) {
    for (auto& p : replicas[k]->parameters()) p.add_(torch::randn_like(p), 0.1);
    replicas[k]->forward(torch::randn({16, 6}) * static_cast<double>(k + 1));
  }
  return replicas;
}

at::Tensor eval_output(BatchNormNet& m, const at::Tensor& x) {
  m->eval();
  torch::NoGradGuard no_grad;
  return m->forward(x);
}

std::uint64_t state_hash(const BatchNormNet& m) {
  std::vector<at::Tensor> all = m->parameters();
  for (const auto& b : m->buffers()) all.push_back(b);
  return hash_of(all);
}

}  // namespace

TEST_CASE("broadcast_parameters and broadcast_buffers across ranks: every replica computes root's eval() outputs") {
  for (const std::size_t root : {std::size_t{0}, world_size() - 1}) {
    INFO("root " << root);
    auto local = rank_replicas(world_rank());
    const at::Tensor x = torch::randn({5, 6});
    // The reference: root's replica 0, rebuilt on this rank.
    auto reference = rank_replicas(root);
    const at::Tensor want = eval_output(reference[0], x);
    for (std::size_t k = 0; k < local.size(); ++k)
      if (world_rank() != root || k != 0) CHECK(!torch::equal(eval_output(local[k], x), want));
    gradavg::libtorch::broadcast_parameters(gradavg_test::world(), local, static_cast<int>(root));
    gradavg::libtorch::broadcast_buffers(gradavg_test::world(), local, static_cast<int>(root));
    for (auto& m : local) {
      CHECK(state_hash(m) == state_hash(reference[0]));
      const at::Tensor got = eval_output(m, x);
      CHECK(hash_of({got}) == hash_of({want}));
    }
    CHECK(same_on_every_rank(state_hash(local[0])));
  }
}

TEST_CASE("broadcast_buffers across ranks: a rank whose model differs is an error on every rank, nothing written") {
  const std::size_t last = world_size() - 1;
  SECTION("another width on the last rank: variable_mismatch_error on every rank") {
    auto local = rank_replicas(world_rank(), world_rank() == last ? 5 : 8);
    std::vector<std::uint64_t> before;
    for (const auto& m : local) before.push_back(state_hash(m));
    const std::string m = exception_of<gradavg::variable_mismatch_error>([&] {
                            gradavg::libtorch::broadcast_buffers(gradavg_test::world(), local);
                          }).what();
    CHECK(contains(m, "the ranks' replicas hold different buffers"));
    for (std::size_t k = 0; k < local.size(); ++k) CHECK(state_hash(local[k]) == before[k]);
  }
  SECTION("a null replica on the last rank: tower_error there, remote_error elsewhere") {
    auto local = rank_replicas(world_rank());
    std::vector<torch::nn::Module*> modules;
    for (auto& m : local) modules.push_back(m.get());
    if (world_rank() == last) modules.back() = nullptr;
    auto call = [&] { gradavg::libtorch::broadcast_parameters(gradavg_test::world(), std::span(modules)); };
    if (world_rank() == last)
      CHECK(contains(exception_of<gradavg::tower_error>(call).what(), "is null"));
    else
      CHECK(contains(exception_of<gradavg::remote_error>(call).what(), "rank " + std::to_string(last)));
  }
  CHECK(same_on_every_rank(42));
}


TEST_CASE("a bfloat16 body and a float head across ranks: each dtype in a call of its own, the same on every rank") {
  torch::manual_seed(103);
  Mixed model;
  const std::size_t k_count = total_towers();
  std::vector<Mixed> all{model};
  for (std::size_t k = 1; k < k_count; ++k) all.push_back(std::dynamic_pointer_cast<MixedImpl>(model->clone()));
  const at::Tensor x = torch::randn({static_cast<std::int64_t>(8 * k_count), 6});
  const at::Tensor y = torch::randint(0, 3, {static_cast<std::int64_t>(8 * k_count)});
  for (std::size_t k = 0; k < k_count; ++k) {
    const auto first = static_cast<std::int64_t>(8 * k);
    const auto rows = torch::indexing::Slice(first, first + 8);
    torch::nn::functional::cross_entropy(all[k]->forward(x.index({rows})), y.index({rows})).backward();
  }
  std::vector<at::Tensor> want;
  for (std::size_t i = 0; i < 4; ++i) {
    std::vector<at::Tensor> g;
    for (const auto& m : all) g.push_back(m->parameters()[i].grad().to(at::kDouble));
    want.push_back(torch::stack(g).mean(0));
  }
  const std::size_t r = world_rank();
  std::vector<Mixed> local(all.begin() + static_cast<std::ptrdiff_t>(first_tower(r)),
                           all.begin() + static_cast<std::ptrdiff_t>(first_tower(r) + r + 1));
  const auto report = gradavg::libtorch::average_module_gradients(gradavg_test::world(), local);
  CHECK(report.report.averaged == 4);
  CHECK(report.report.towers == k_count);
  std::vector<at::Tensor> g0;
  for (std::size_t i = 0; i < 4; ++i) {
    INFO("parameter " << i);
    g0.push_back(local[0]->parameters()[i].grad());
    CHECK(g0[i].scalar_type() == (i < 2 ? at::kBFloat16 : at::kFloat));
    const double tolerance = i < 2 ? 0x1p-7 : 1e-6;
    const double error = (g0[i].to(at::kDouble) - want[i]).abs().max().item<double>();
    CHECK(error <= tolerance * want[i].abs().max().item<double>());
  }
  for (const auto& m : local) {
    std::vector<at::Tensor> g;
    for (const auto& p : m->parameters()) g.push_back(p.grad());
    CHECK(hash_of(g) == hash_of(g0));
  }
  CHECK(same_on_every_rank(hash_of(g0)));
}

TEST_CASE("module replicas across ranks: module_options::include_square gives every rank the means of squares over all") {
  auto all = all_replicas(37);
  const std::size_t parameter_count = all[0]->parameters().size();
  std::vector<at::Tensor> want(parameter_count);
  for (std::size_t i = 0; i < parameter_count; ++i) {
    std::vector<at::Tensor> g;
    for (const auto& m : all)
      if (m->parameters()[i].grad().defined()) g.push_back(m->parameters()[i].grad().to(at::kDouble).square());
    if (!g.empty()) want[i] = torch::stack(g).mean(0);
  }
  auto local = local_replicas(all);
  const auto r = gradavg::libtorch::average_module_gradients(gradavg_test::world(), local, {}, {.include_square = true});
  CHECK(r.report.averaged == 4);
  REQUIRE(r.squares.size() == parameter_count);
  for (std::size_t i = 0; i < parameter_count; ++i) {
    INFO("parameter " << i);
    REQUIRE(r.squares[i].defined() == want[i].defined());
    if (!want[i].defined()) continue;
    const double error = (r.squares[i].to(at::kDouble) - want[i]).abs().max().item<double>();
    CHECK(error <= 1e-6 * want[i].abs().max().item<double>());
  }
  CHECK(same_on_every_rank(hash_of(r.squares)));
}
