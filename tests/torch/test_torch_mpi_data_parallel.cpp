// gradavg::libtorch's data parallel across processes (gradavg/torch_processes.hpp): built as
// test_torch_mpi_data_parallel for mpi_data_parallel under mpiexec, and with GRADAVG_TEST_C10D as
// test_torch_c10d_data_parallel for c10d_data_parallel over gloo, started by
// support/launch_ranks.sh (support/process_world.hpp); ctest runs each with 2 and 3 ranks, each
// with a timeout. The cases' names say mpi_data_parallel for both. Rank r holds r + 1 replicas of one Deep model, each running its
// backward on a thread of its own, and a second set of the same replicas fed the same batches is
// averaged by the one-shot average_module_gradients(world(), ...): the gradients and reports are
// compared bit for bit, and across ranks. Failures are provoked on one rank only: every rank
// throws, none hangs.
#include <torch/torch.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "process_world.hpp"
#include "support.hpp"
#include "torch_models.hpp"

using namespace gradavg_test::models;  // Net, Deep, to_channels_last

namespace {

std::size_t world_rank() { return static_cast<std::size_t>(gradavg_test::world_rank()); }
using gradavg_test::same_on_every_rank;

using gradavg_test::bitwise_equal;

/// fnv1a of the bytes of every gradient of a replica (undefined ones as a marker).
std::uint64_t gradient_hash(Deep& m) {
  std::uint64_t h = gradavg_test::fnv_offset;
  for (const auto& p : m->parameters()) {
    const at::Tensor g = p.grad();
    const unsigned char defined = g.defined() ? 1 : 2;
    h = gradavg_test::fnv1a(&defined, 1, h);
    if (g.defined()) h = gradavg_test::fnv1a(g.data_ptr(), g.nbytes(), h);
  }
  return h;
}

/// This rank's r + 1 replicas twice: `overlapped` for mpi_data_parallel, `one_shot` for the
/// one-shot call; replica k of rank r is global replica r(r+1)/2 + k, whose rows of a batch are
/// drawn from a seed of its own.
struct twin_replicas {
  std::vector<Deep> overlapped, one_shot;
  std::size_t first;

  explicit twin_replicas(std::uint64_t seed) : first(world_rank() * (world_rank() + 1) / 2) {
    torch::manual_seed(seed);
    Deep model;
    to_channels_last(*model);
    for (std::size_t i = 0; i < 2 * (world_rank() + 1); ++i) {
      Deep r = std::dynamic_pointer_cast<DeepImpl>(model->clone());
      to_channels_last(*r);
      (i <= world_rank() ? overlapped : one_shot).push_back(r);
    }
  }

  /// Every replica of `set` runs forward and backward of its rows on a thread of its own (aux in
  /// the loss unless no_aux names the replica; `failing` fails its backward); the first exception
  /// is returned, not thrown.
  std::exception_ptr backward(std::vector<Deep>& set, std::uint64_t batch, std::size_t no_aux = ~std::size_t{0},
                              std::size_t failing = ~std::size_t{0}) {
    std::vector<std::pair<at::Tensor, at::Tensor>> data;
    for (std::size_t k = 0; k < set.size(); ++k) {
      torch::manual_seed(1000 * batch + first + k);
      data.emplace_back(torch::randn({4, 2, 6, 6}).contiguous(at::MemoryFormat::ChannelsLast),
                        torch::randint(0, 3, {4}));
    }
    return gradavg_test::first_failure_on_threads(set.size(), [&](std::size_t k) {
      const at::Tensor out = set[k]->forward(data[k].first, k != no_aux, k == failing);
      torch::nn::functional::cross_entropy(out, data[k].second).backward();
    });
  }

  void zero_grad(bool set_to_none) {
    for (auto* set : {&overlapped, &one_shot})
      for (auto& m : *set) m->zero_grad(set_to_none);
  }

  void check_same_gradients() {
    for (std::size_t k = 0; k < overlapped.size(); ++k) {
      const auto a = overlapped[k]->named_parameters(), b = one_shot[k]->named_parameters();
      for (std::size_t i = 0; i < a.size(); ++i) {
        INFO("rank " << world_rank() << ", replica " << k << ", parameter " << a[i].key());
        CHECK(bitwise_equal(a[i].value().grad(), b[i].value().grad()));
      }
    }
    CHECK(same_on_every_rank(gradient_hash(overlapped[0])));
  }
};

void check_same_reports(const gradavg::libtorch::module_report& a, const gradavg::libtorch::module_report& b) {
  CHECK(a.report.averaged == b.report.averaged);
  CHECK(a.report.skipped == b.report.skipped);
  CHECK(a.report.towers == b.report.towers);
  CHECK(a.report.shard.begin == b.report.shard.begin);  // the averaged elements, end to end
  CHECK(a.report.shard.end == b.report.shard.end);
  CHECK(a.skipped == b.skipped);
  CHECK(a.zero_filled == b.zero_filled);
}

}  // namespace

TEST_CASE("mpi_data_parallel: the one-shot call's gradients bit for bit on every rank, buckets started in backward") {
  at::set_num_threads(1);
  for (std::size_t bucket_bytes : {std::size_t{1}, std::size_t{700}, std::size_t{1} << 20}) {
    INFO("buckets of " << bucket_bytes << " bytes");
    twin_replicas t(7);
    gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, {}, {}, {.bytes = bucket_bytes});
    for (std::uint64_t step = 0; step < 3; ++step) {
      t.zero_grad(step % 2 == 0);
      REQUIRE(!t.backward(t.overlapped, step));
      const auto got = dp.finish();
      REQUIRE(!t.backward(t.one_shot, step));
      const auto want = gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot);
      check_same_reports(got, want);
      CHECK(got.report.averaged == 12);
      CHECK(dp.overlapped_buckets() == dp.buckets().size());
      t.check_same_gradients();
    }
  }
}

TEST_CASE("mpi_data_parallel, means_to first_replica and statistics: one optimizer per rank, one norm everywhere") {
  at::set_num_threads(1);
  twin_replicas t(17);
  const gradavg::libtorch::module_options first{.means_to = gradavg::libtorch::mean_target::first_replica};
  gradavg_test::world_options opts;
  opts.compute.statistics = true;
  gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, opts, first, {.bytes = 700});
  const auto adam = [](Deep& m) { return torch::optim::Adam(m->parameters(), torch::optim::AdamOptions(1e-2)); };
  torch::optim::Adam one = adam(t.overlapped[0]);
  std::vector<torch::optim::Adam> each;
  for (auto& m : t.one_shot) each.push_back(adam(m));
  for (std::uint64_t step = 0; step < 3; ++step) {
    INFO("step " << step);
    t.zero_grad(step % 2 == 0);
    REQUIRE(!t.backward(t.overlapped, step));
    std::vector<std::vector<at::Tensor>> own(t.overlapped.size());
    for (std::size_t k = 1; k < t.overlapped.size(); ++k)
      for (const auto& p : t.overlapped[k]->parameters()) own[k].push_back(p.grad().clone());
    const auto got = dp.finish();
    REQUIRE(!t.backward(t.one_shot, step));
    const auto want = gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot, opts);
    check_same_reports(got, want);
    // Buckets sum the statistics in another order than the one-shot call: the same within
    // rounding, and the same bits on every rank.
    REQUIRE(got.report.statistics);
    CHECK(got.report.sum_mean_squared == Approx(want.report.sum_mean_squared).epsilon(1e-12));
    CHECK(got.report.sum_mean_of_squares == Approx(want.report.sum_mean_of_squares).epsilon(1e-12));
    CHECK(same_on_every_rank(std::bit_cast<std::uint64_t>(got.report.sum_mean_squared)));
    CHECK(same_on_every_rank(std::bit_cast<std::uint64_t>(got.report.sum_mean_of_squares)));
    const auto params = t.overlapped[0]->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      INFO("rank " << world_rank() << ", parameter " << i);
      CHECK(bitwise_equal(params[i].grad(), t.one_shot[0]->parameters()[i].grad()));
      for (std::size_t k = 1; k < t.overlapped.size(); ++k)
        CHECK(bitwise_equal(t.overlapped[k]->parameters()[i].grad(), own[k][i]));
    }
    one.step();
    for (auto& o : each) o.step();
    gradavg::libtorch::broadcast_parameters(t.overlapped);
    for (std::size_t k = 0; k < t.overlapped.size(); ++k)
      for (std::size_t i = 0; i < params.size(); ++i) {
        INFO("rank " << world_rank() << ", replica " << k << ", parameter " << i);
        CHECK(bitwise_equal(t.overlapped[k]->parameters()[i], t.one_shot[k]->parameters()[i]));
      }
  }
}

TEST_CASE("mpi_data_parallel, int8 with error feedback kept: ranks alike, the means of many steps converge to the "
          "exact ones, reset_feedback restarts") {
  // The same batch every step: each step's int8 means are off by a rounding; with the residuals
  // kept, what one step drops the next sends, so the mean over K steps approaches the exact
  // means (the fp32 exchange's) K times closer than one step does.
  at::set_num_threads(1);
  twin_replicas t(29);
  REQUIRE(!t.backward(t.one_shot, 0));
  (void)gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot);  // the exact means
  std::vector<at::Tensor> exact;
  for (const auto& p : t.one_shot[0]->parameters()) exact.push_back(p.grad().to(at::kDouble));
  gradavg_test::world_options opts;
  opts.exchange.compression = gradavg::compression::int8;
  opts.exchange.feedback = gradavg::error_feedback::kept;
  opts.exchange.seed = 5;
  gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, opts, {}, {.bytes = 700});
  const int steps = 32;
  std::vector<at::Tensor> sum;
  double first_error = 0;
  std::uint64_t first_hash = 0;
  for (int step = 0; step < steps; ++step) {
    t.zero_grad(false);
    REQUIRE(!t.backward(t.overlapped, 0));
    dp.finish();
    const auto params = t.overlapped[0]->parameters();
    CHECK(same_on_every_rank(gradient_hash(t.overlapped[0])));
    if (step == 0) first_hash = gradient_hash(t.overlapped[0]);
    for (std::size_t i = 0; i < params.size(); ++i) {
      const at::Tensor g = params[i].grad().to(at::kDouble);
      if (step == 0) {
        sum.push_back(g.clone());
        first_error = std::max(first_error, (g - exact[i]).abs().max().item<double>());
      } else {
        sum[i] += g;
      }
    }
  }
  double error = 0;
  for (std::size_t i = 0; i < sum.size(); ++i) error = std::max(error, (sum[i] / steps - exact[i]).abs().max().item<double>());
  INFO("one step: " << first_error << ", the mean of " << steps << " steps: " << error);
  CHECK(first_error > 0);
  CHECK(error < first_error / 4);
  // Reset: zero residuals, the seeds from the start: the first step's bits again.
  dp.reset_feedback();
  t.zero_grad(false);
  REQUIRE(!t.backward(t.overlapped, 0));
  dp.finish();
  CHECK(gradient_hash(t.overlapped[0]) == first_hash);
}

TEST_CASE("mpi_data_parallel: error feedback kept without a lossy format is an option_error on every rank, no hang") {
  at::set_num_threads(1);
  twin_replicas t(31);
  gradavg_test::world_options opts;
  opts.exchange.feedback = gradavg::error_feedback::kept;  // compression none
  gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, opts, {}, {.bytes = 700});
  REQUIRE(!t.backward(t.overlapped, 0));
  const std::string m = gradavg_test::message_of<gradavg::option_error>([&] { dp.finish(); });
  CHECK(gradavg_test::contains(m, "options.exchange.feedback is kept"));
  // A direct call takes its residual in options.exchange.residual: kept there is refused too.
  opts.exchange.compression = gradavg::compression::int8;
  REQUIRE(!t.backward(t.one_shot, 0));
  const std::string direct = gradavg_test::message_of<gradavg::option_error>(
      [&] { gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot, opts); });
  CHECK(gradavg_test::contains(direct, "only the libtorch module helpers keep residuals"));
  // The one-shot call over parameters of one dtype is one call: it takes a residual of the caller's.
  std::size_t elements = 0;
  for (const auto& p : t.one_shot[0]->parameters()) elements += static_cast<std::size_t>(p.numel());
  std::vector<float> residual(elements, 0.0f);
  opts.exchange.feedback = gradavg::error_feedback::off;
  opts.exchange.residual = residual;
  t.zero_grad(false);
  REQUIRE(!t.backward(t.one_shot, 1));
  CHECK(gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot, opts).report.averaged == 12);
  CHECK(std::any_of(residual.begin(), residual.end(), [](float r) { return r != 0.0f; }));
  CHECK(same_on_every_rank(gradient_hash(t.one_shot[0])));
}

TEST_CASE("the module helpers refuse sharded output: an option_error on every rank, no gradient changed") {
  at::set_num_threads(1);
  twin_replicas t(37);
  gradavg_test::world_options opts;
  opts.exchange.output = gradavg::output_mode::sharded;
  REQUIRE(!t.backward(t.one_shot, 0));
  const std::uint64_t before = gradient_hash(t.one_shot[0]);
  const std::string m = gradavg_test::message_of<gradavg::option_error>(
      [&] { gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot, opts); });
  CHECK(gradavg_test::contains(m, "options.exchange.output is not replicated"));
  CHECK(gradient_hash(t.one_shot[0]) == before);
  gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, opts, {}, {.bytes = 700});
  REQUIRE(!t.backward(t.overlapped, 0));
  CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::option_error>([&] { dp.finish(); }),
                               "options.exchange.output is not replicated"));
  CHECK(same_on_every_rank(42));
}

TEST_CASE("mpi_data_parallel: a parameter unused on one rank's replica, as the one-shot call says on every rank") {
  at::set_num_threads(1);
  const std::size_t no_aux = world_rank() == 1 ? 0 : ~std::size_t{0};
  SECTION("set to none: the one-shot call's missing_gradient_error on every rank") {
    twin_replicas t(11);
    gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, {}, {}, {.bytes = 1});
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 0, no_aux));
    REQUIRE(!t.backward(t.one_shot, 0, no_aux));
    const std::string got = gradavg_test::message_of<gradavg::missing_gradient_error>([&] { dp.finish(); });
    const std::string want = gradavg_test::message_of<gradavg::missing_gradient_error>(
        [&] { gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot); });
    CHECK(got == want);
    CHECK(gradavg_test::contains(got, "'aux.weight'"));
    // Usable again.
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 1));
    REQUIRE(!t.backward(t.one_shot, 1));
    const auto finished = dp.finish();  // before the one-shot call: one call at a time on the communicator
    check_same_reports(finished, gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot));
    t.check_same_gradients();
  }
  SECTION("absent_as_zeros: zeros in their place, listed on every rank, the one-shot bits") {
    twin_replicas t(13);
    gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, {}, {.absent_as_zeros = true},
                                            {.bytes = 700});
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 0, no_aux));
    REQUIRE(!t.backward(t.one_shot, 0, no_aux));
    const auto got = dp.finish();
    const auto want =
        gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot, {}, {.absent_as_zeros = true});
    check_same_reports(got, want);
    CHECK(got.zero_filled == std::vector<std::string>{"aux.weight", "aux.bias"});
    t.check_same_gradients();
  }
}

TEST_CASE("mpi_data_parallel: a backward that throws on one rank hangs no rank, every rank reports it") {
  at::set_num_threads(1);
  const bool failing_rank = world_rank() == 1;
  for (const bool abandon : {false, true}) {
    INFO((abandon ? "abandon()" : "finish()"));
    twin_replicas t(17);
    gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, {}, {}, {.bytes = 1});
    t.zero_grad(true);
    const std::exception_ptr failed =
        t.backward(t.overlapped, 0, ~std::size_t{0}, failing_rank ? 1 : ~std::size_t{0});
    CHECK(static_cast<bool>(failed) == failing_rank);
    if (abandon) {
      dp.abandon();
    } else {
      const std::string e = gradavg_test::message_of<gradavg::missing_gradient_error>([&] { dp.finish(); });
      CHECK(gradavg_test::contains(e, "'conv.weight'"));  // the first parameter replica 1 lacks
    }
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 1));
    REQUIRE(!t.backward(t.one_shot, 1));
    const auto finished = dp.finish();  // before the one-shot call: one call at a time on the communicator
    check_same_reports(finished, gradavg::libtorch::average_module_gradients(gradavg_test::world(), t.one_shot));
    t.check_same_gradients();
  }
}

TEST_CASE("mpi_data_parallel: frozen parameters skipped and listed on every rank") {
  at::set_num_threads(1);
  torch::manual_seed(29);
  Net model;
  std::vector<Net> a, b;
  for (std::size_t i = 0; i <= world_rank(); ++i)
    for (auto* set : {&a, &b}) {
      set->push_back(std::dynamic_pointer_cast<NetImpl>(model->clone()));
      for (auto& p : set->back()->frozen->parameters()) p.set_requires_grad(false);
    }
  gradavg_test::world_data_parallel dp(gradavg_test::world(), a, {}, {}, {.bytes = 1});
  for (auto* set : {&a, &b})
    for (std::size_t k = 0; k < set->size(); ++k) {
      torch::manual_seed(10 * world_rank() + k);
      (*set)[k]->forward(torch::randn({4, 6})).square().sum().backward();
    }
  const auto got = dp.finish();
  const auto want = gradavg::libtorch::average_module_gradients(gradavg_test::world(), b);
  CHECK(got.report.averaged == want.report.averaged);
  CHECK(got.report.skipped == want.report.skipped);
  CHECK(got.skipped == std::vector<std::string>{"frozen.weight", "frozen.bias"});
  for (std::size_t k = 0; k < a.size(); ++k)
    for (std::size_t i = 0; i < 6; ++i) CHECK(bitwise_equal(a[k]->parameters()[i].grad(), b[k]->parameters()[i].grad()));
}

TEST_CASE("mpi_data_parallel: a rank that cannot set up, or buckets that differ, throw on every rank") {
  twin_replicas t(31);
  SECTION("a null replica on rank 1: tower_error there, remote_error elsewhere") {
    std::vector<torch::nn::Module*> modules;
    for (auto& m : t.overlapped) modules.push_back(m.get());
    if (world_rank() == 1) modules[0] = nullptr;
    const auto make = [&] {
      gradavg_test::world_data_parallel dp(gradavg_test::world(), std::span<torch::nn::Module* const>(modules));
    };
    if (world_rank() == 1)
      CHECK(gradavg_test::message_of<gradavg::tower_error>(make) == "gradavg: replica 0 is null");
    else
      CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::remote_error>(make), "another rank"));
  }
  SECTION("a sparse embedding: unsupported_tensor_error on every rank, naming it") {
    torch::nn::Sequential model(torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true)),
                                torch::nn::Linear(3, 2));
    const std::vector<torch::nn::Sequential> replicas{model};
    const std::string m = gradavg_test::message_of<gradavg::unsupported_tensor_error>(
        [&] { gradavg_test::world_data_parallel dp(gradavg_test::world(), replicas); });
    CHECK(gradavg_test::contains(m, "parameter #0 '0.weight'"));
    CHECK(gradavg_test::contains(m, "sparse(true)"));
  }
  SECTION("another bucket size on rank 0: variable_mismatch_error on every rank") {
    const std::size_t bytes = world_rank() == 0 ? 1 : std::size_t{1} << 20;
    CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::variable_mismatch_error>([&] {
                                   gradavg_test::world_data_parallel dp(gradavg_test::world(), t.overlapped, {}, {},
                                                                           {.bytes = bytes});
                                 }),
                                 "buckets differ"));
  }
}
