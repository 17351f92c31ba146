// gradavg::libtorch::data_parallel (gradavg/torch_data_parallel.hpp): buckets averaged while the
// replicas' backward passes run on their own threads, against the one-shot call
// average_module_gradients on a second set of the same replicas fed the same batches (bit for bit:
// every gradient, every report), and what happens around it: unused and frozen parameters,
// micro-batches under no_sync, a second backward, a backward that throws, hooks removed.
#include <gradavg/torch_data_parallel.hpp>

#include <torch/torch.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"
#include "torch_models.hpp"

using namespace gradavg_test::models;  // Net, Mixed, Deep

namespace {

using gradavg_test::bitwise_equal;

/// Two sets of K replicas of one Deep model (channels_last), `overlapped` for data_parallel and
/// `one_shot` for average_module_gradients, and batches of 4 rows per replica.
struct twin_replicas {
  std::vector<Deep> overlapped, one_shot;
  std::size_t k_count;

  twin_replicas(std::size_t k, std::uint64_t seed) : k_count(k) {
    torch::manual_seed(seed);
    Deep model;
    to_channels_last(*model);
    for (std::size_t i = 0; i < 2 * k; ++i) {
      Deep r = std::dynamic_pointer_cast<DeepImpl>(model->clone());
      to_channels_last(*r);
      (i < k ? overlapped : one_shot).push_back(r);
    }
  }

  /// Replica k's rows of batch `batch` (drawn from the global generator: call it on one thread).
  static std::pair<at::Tensor, at::Tensor> rows(std::size_t k, std::uint64_t batch) {
    torch::manual_seed(1000 * batch + k);
    const at::Tensor x = torch::randn({4, 2, 6, 6}).contiguous(at::MemoryFormat::ChannelsLast);
    return {x, torch::randint(0, 3, {4})};
  }

  /// Replica k's loss on its rows of batch `batch`; aux in the loss where use_aux says.
  static at::Tensor loss(Deep& m, std::size_t k, std::uint64_t batch, bool use_aux, bool fail) {
    const auto [x, y] = rows(k, batch);
    return torch::nn::functional::cross_entropy(m->forward(x, use_aux, fail), y);
  }

  /// Every replica of `set` runs forward and backward of its rows on a thread of its own; the
  /// first exception (a replica's backward that throws) is returned, not thrown.
  std::exception_ptr backward(std::vector<Deep>& set, std::uint64_t batch, const std::vector<bool>& use_aux = {},
                              std::size_t failing = ~std::size_t{0}) {
    std::vector<std::pair<at::Tensor, at::Tensor>> data;
    for (std::size_t k = 0; k < set.size(); ++k) data.push_back(rows(k, batch));
    return gradavg_test::first_failure_on_threads(set.size(), [&](std::size_t k) {
      const at::Tensor out = set[k]->forward(data[k].first, use_aux.empty() || use_aux[k], k == failing);
      torch::nn::functional::cross_entropy(out, data[k].second).backward();
    });
  }

  void zero_grad(bool set_to_none) {
    for (auto* set : {&overlapped, &one_shot})
      for (auto& m : *set) m->zero_grad(set_to_none);
  }

  /// Every parameter's gradient in every replica of the two sets the same bits.
  void check_same_gradients() const {
    for (std::size_t k = 0; k < k_count; ++k) {
      const auto a = overlapped[k]->named_parameters(), b = one_shot[k]->named_parameters();
      for (std::size_t i = 0; i < a.size(); ++i) {
        INFO("replica " << k << ", parameter " << a[i].key());
        CHECK(bitwise_equal(a[i].value().grad(), b[i].value().grad()));
      }
    }
  }

  /// One SGD step on every replica of both sets (the same update from the same gradients).
  void sgd_step() {
    torch::NoGradGuard no_grad;
    for (auto* set : {&overlapped, &one_shot})
      for (auto& m : *set)
        for (auto& p : m->parameters())
          if (p.grad().defined()) p.sub_(p.grad() * 0.1);
  }
};

void check_same_reports(const gradavg::libtorch::module_report& a, const gradavg::libtorch::module_report& b) {
  CHECK(a.report.averaged == b.report.averaged);
  CHECK(a.report.skipped == b.report.skipped);
  CHECK(a.report.nonfinite_variables == b.report.nonfinite_variables);
  CHECK(a.report.towers == b.report.towers);
  CHECK(a.report.shard.begin == b.report.shard.begin);  // the averaged elements, end to end
  CHECK(a.report.shard.end == b.report.shard.end);
  CHECK(a.skipped == b.skipped);
  CHECK(a.zero_filled == b.zero_filled);
}

}  // namespace

TEST_CASE("data_parallel: the one-shot call's gradients bit for bit, every bucket started while backward ran") {
  at::set_num_threads(1);
  for (std::size_t k_count : {2u, 3u}) {
    for (std::size_t bucket_bytes : {std::size_t{1}, std::size_t{700}, std::size_t{1} << 20}) {
      for (std::size_t threads : {1u, 2u}) {
        INFO(k_count << " replicas, buckets of " << bucket_bytes << " bytes, threads " << threads);
        twin_replicas t(k_count, 7);
        const gradavg::options opts{.run = {.threads = threads}};
        gradavg::libtorch::data_parallel dp(t.overlapped, opts, {}, {.bytes = bucket_bytes});
        for (std::uint64_t step = 0; step < 3; ++step) {
          t.zero_grad(/*set_to_none=*/step % 2 == 0);
          REQUIRE(!t.backward(t.overlapped, step));
          const auto got = dp.finish();
          REQUIRE(!t.backward(t.one_shot, step));
          const auto want = gradavg::libtorch::average_module_gradients(t.one_shot, opts);
          check_same_reports(got, want);
          CHECK(got.report.averaged == 12);
          CHECK(dp.overlapped_buckets() == dp.buckets().size());
          t.check_same_gradients();
          t.sgd_step();
        }
      }
    }
  }
}

TEST_CASE("one optimizer on replica 0, means_to first_replica and broadcast_parameters: K optimizers' bits") {
  at::set_num_threads(1);
  using gradavg::libtorch::mean_target;
  const auto adam = [](Deep& m) {
    return torch::optim::Adam(m->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
  };
  for (const bool overlapped : {false, true}) {
    INFO((overlapped ? "data_parallel" : "average_module_gradients"));
    twin_replicas t(3, 13);
    const gradavg::options opts{.run = {.threads = 2}};
    const gradavg::libtorch::module_options first{.absent_as_zeros = true, .means_to = mean_target::first_replica};
    const gradavg::libtorch::module_options every{.absent_as_zeros = true};
    std::optional<gradavg::libtorch::data_parallel> dp;
    if (overlapped) dp.emplace(t.overlapped, opts, first, gradavg::libtorch::bucket_options{.bytes = 700});
    torch::optim::Adam one = adam(t.overlapped[0]);
    std::vector<torch::optim::Adam> each;
    for (auto& m : t.one_shot) each.push_back(adam(m));
    for (std::uint64_t step = 0; step < 4; ++step) {
      INFO("step " << step);
      // Step 2: aux unused on replica 1 after zero_grad(true): zero-filled, on replica 0 only.
      const std::vector<bool> use_aux = step == 2 ? std::vector<bool>{true, false, true} : std::vector<bool>{};
      t.zero_grad(/*set_to_none=*/step % 2 == 0);
      REQUIRE(!t.backward(t.overlapped, step, use_aux));
      std::vector<std::vector<at::Tensor>> own(3);
      for (std::size_t k = 1; k < 3; ++k)
        for (const auto& p : t.overlapped[k]->parameters())
          own[k].push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
      const auto got =
          overlapped ? dp->finish() : gradavg::libtorch::average_module_gradients(t.overlapped, opts, first);
      REQUIRE(!t.backward(t.one_shot, step, use_aux));
      const auto want = gradavg::libtorch::average_module_gradients(t.one_shot, opts, every);
      check_same_reports(got, want);
      CHECK(got.zero_filled.size() == (step == 2 ? 2u : 0u));
      for (std::size_t i = 0; i < own[1].size(); ++i) {
        INFO("parameter " << i);
        CHECK(bitwise_equal(t.overlapped[0]->parameters()[i].grad(), t.one_shot[0]->parameters()[i].grad()));
        for (std::size_t k = 1; k < 3; ++k) CHECK(bitwise_equal(t.overlapped[k]->parameters()[i].grad(), own[k][i]));
      }
      one.step();
      for (auto& o : each) o.step();
      gradavg::libtorch::broadcast_parameters(t.overlapped, opts);
      for (std::size_t k = 0; k < 3; ++k)
        for (std::size_t i = 0; i < own[1].size(); ++i) {
          INFO("replica " << k << ", parameter " << i);
          CHECK(bitwise_equal(t.overlapped[k]->parameters()[i], t.one_shot[k]->parameters()[i]));
        }
    }
  }
}

TEST_CASE("data_parallel: statistics summed bucket by bucket, the same bits for any thread count") {
  at::set_num_threads(1);
  twin_replicas one_thread(3, 19), two_threads(3, 19);
  const gradavg::libtorch::module_options zeros{.absent_as_zeros = true};
  gradavg::libtorch::data_parallel dp1(one_thread.overlapped, {.compute = {.statistics = true}, .run = {.threads = 1}}, zeros, {.bytes = 700});
  gradavg::libtorch::data_parallel dp2(two_threads.overlapped, {.compute = {.statistics = true}, .run = {.threads = 2}}, zeros,
                                       {.bytes = 700});
  for (std::uint64_t step = 0; step < 3; ++step) {
    INFO("step " << step);
    // Step 1: aux unused on replica 2 after zero_grad(true): those parameters go to finish()'s rest.
    const std::vector<bool> use_aux = step == 1 ? std::vector<bool>{true, true, false} : std::vector<bool>{};
    const bool set_to_none = step == 1;
    one_thread.zero_grad(set_to_none);
    two_threads.zero_grad(set_to_none);
    REQUIRE(!one_thread.backward(one_thread.overlapped, step, use_aux));
    // The reference, from the one-shot set's gradients before averaging: per parameter, in double,
    // the mean over the replicas (absent = zeros) and the mean of the squares.
    REQUIRE(!one_thread.backward(one_thread.one_shot, step, use_aux));
    double want_mean_squared = 0, want_mean_of_squares = 0;
    const auto params0 = one_thread.one_shot[0]->parameters();
    for (std::size_t i = 0; i < params0.size(); ++i) {
      at::Tensor sum = torch::zeros_like(params0[i], torch::kDouble), squares = sum.clone();
      for (auto& m : one_thread.one_shot) {
        const at::Tensor g = m->parameters()[i].grad();
        if (!g.defined()) continue;
        sum += g.to(torch::kDouble);
        squares += g.to(torch::kDouble).square();
      }
      want_mean_squared += (sum / 3).square().sum().item<double>();
      want_mean_of_squares += (squares / 3).sum().item<double>();
    }
    REQUIRE(!two_threads.backward(two_threads.overlapped, step, use_aux));
    const auto got1 = dp1.finish(), got2 = dp2.finish();
    const auto want = gradavg::libtorch::average_module_gradients(one_thread.one_shot, {.compute = {.statistics = true}}, zeros);
    REQUIRE(got1.report.statistics);
    CHECK(std::bit_cast<std::uint64_t>(got1.report.sum_mean_squared) ==
          std::bit_cast<std::uint64_t>(got2.report.sum_mean_squared));
    CHECK(std::bit_cast<std::uint64_t>(got1.report.sum_mean_of_squares) ==
          std::bit_cast<std::uint64_t>(got2.report.sum_mean_of_squares));
    CHECK(got1.report.sum_mean_squared == Approx(want.report.sum_mean_squared).epsilon(1e-12));
    CHECK(got1.report.sum_mean_of_squares == Approx(want.report.sum_mean_of_squares).epsilon(1e-12));
    CHECK(got1.report.sum_mean_squared == Approx(want_mean_squared).epsilon(1e-6));
    CHECK(got1.report.sum_mean_of_squares == Approx(want_mean_of_squares).epsilon(1e-6));
    CHECK(got1.report.global_norm() == Approx(std::sqrt(want_mean_squared)).epsilon(1e-6));
    CHECK(dp1.overlapped_buckets() == (step == 1 ? dp1.buckets().size() - 1 : dp1.buckets().size()));
    one_thread.check_same_gradients();
    one_thread.sgd_step();
    two_threads.sgd_step();
  }
}

TEST_CASE("data_parallel: buckets in reverse parameter order, one dtype each, split at the byte size") {
  twin_replicas t(2, 11);
  using buckets_t = std::vector<std::vector<std::size_t>>;
  CHECK(gradavg::libtorch::data_parallel(t.overlapped, {}, {}, {.bytes = 1}).buckets() ==
        buckets_t{{11}, {10}, {9}, {8}, {7}, {6}, {5}, {4}, {3}, {2}, {1}, {0}});
  CHECK(gradavg::libtorch::data_parallel(t.overlapped).buckets() ==
        buckets_t{{11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0}});
  // Bytes from the last parameter back: aux.bias 12, aux.weight 192, head 12 and 192, fc2.bias 64
  // (472 so far), fc2.weight 2048, fc1.bias 128, fc1.weight 8192, bn 16 and 16, conv 16 and 288.
  // Buckets of at most 2200 bytes, a larger parameter alone.
  CHECK(gradavg::libtorch::data_parallel(t.overlapped, {}, {}, {.bytes = 2200}).buckets() ==
        buckets_t{{11, 10, 9, 8, 7}, {6, 5}, {4}, {3, 2, 1, 0}});
  // A bfloat16 body and a float head: never one bucket.
  torch::manual_seed(3);
  std::vector<Mixed> mixed{Mixed(), Mixed()};
  CHECK(gradavg::libtorch::data_parallel(mixed).buckets() == buckets_t{{3, 2}, {1, 0}});
}

TEST_CASE("data_parallel: a bfloat16 body and a float head, the one-shot call's bits") {
  at::set_num_threads(1);
  torch::manual_seed(5);
  Mixed model;
  std::vector<Mixed> a, b;
  for (int i = 0; i < 3; ++i) {
    a.push_back(std::dynamic_pointer_cast<MixedImpl>(model->clone()));
    b.push_back(std::dynamic_pointer_cast<MixedImpl>(model->clone()));
  }
  gradavg::libtorch::data_parallel dp(a, {}, {}, {.bytes = 1});
  for (auto* set : {&a, &b})
    for (std::size_t k = 0; k < 3; ++k) {
      torch::manual_seed(k);
      (*set)[k]->forward(torch::randn({4, 6})).square().sum().backward();
    }
  const auto got = dp.finish();
  const auto want = gradavg::libtorch::average_module_gradients(b);
  check_same_reports(got, want);
  CHECK(dp.overlapped_buckets() == 4);
  for (std::size_t k = 0; k < 3; ++k)
    for (std::size_t i = 0; i < 4; ++i) CHECK(bitwise_equal(a[k]->parameters()[i].grad(), b[k]->parameters()[i].grad()));
}

TEST_CASE("data_parallel: a parameter unused on some replicas is finished by finish(), as the one-shot call would") {
  at::set_num_threads(1);
  const std::vector<bool> no_aux_on_1{true, false, true};
  SECTION("set to none: the one-shot call's missing_gradient_error, the other buckets averaged") {
    twin_replicas t(3, 13);
    gradavg::libtorch::data_parallel dp(t.overlapped, {}, {}, {.bytes = 1});
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 0, no_aux_on_1));
    REQUIRE(!t.backward(t.one_shot, 0, no_aux_on_1));
    const std::string got = gradavg_test::message_of<gradavg::missing_gradient_error>([&] { dp.finish(); });
    const std::string want = gradavg_test::message_of<gradavg::missing_gradient_error>(
        [&] { gradavg::libtorch::average_module_gradients(t.one_shot); });
    CHECK(got == want);
    CHECK(gradavg_test::contains(got, "'aux.weight'"));
    CHECK(dp.overlapped_buckets() == 10);
    CHECK(!t.overlapped[1]->aux->weight.grad().defined());
    // The object is usable again: a full step gives the one-shot bits.
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 1));
    REQUIRE(!t.backward(t.one_shot, 1));
    const auto finished = dp.finish();
    check_same_reports(finished, gradavg::libtorch::average_module_gradients(t.one_shot));
    t.check_same_gradients();
  }
  SECTION("absent_as_zeros: zeros in their place, listed, the one-shot bits") {
    twin_replicas t(3, 17);
    gradavg::libtorch::data_parallel dp(t.overlapped, {.run = {.threads = 2}}, {.absent_as_zeros = true}, {.bytes = 1});
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 0, no_aux_on_1));
    REQUIRE(!t.backward(t.one_shot, 0, no_aux_on_1));
    const auto got = dp.finish();
    const auto want = gradavg::libtorch::average_module_gradients(t.one_shot, {.run = {.threads = 2}}, {.absent_as_zeros = true});
    check_same_reports(got, want);
    CHECK(got.zero_filled == std::vector<std::string>{"aux.weight", "aux.bias"});
    CHECK(got.report.averaged == 12);
    t.check_same_gradients();
  }
  SECTION("zero_grad() keeps zero gradients: averaged with them by finish()") {
    twin_replicas t(3, 19);
    gradavg::libtorch::data_parallel dp(t.overlapped, {}, {}, {.bytes = 1});
    REQUIRE(!t.backward(t.overlapped, 0));
    REQUIRE(!t.backward(t.one_shot, 0));
    dp.finish();
    gradavg::libtorch::average_module_gradients(t.one_shot);
    t.zero_grad(false);
    REQUIRE(!t.backward(t.overlapped, 1, no_aux_on_1));
    REQUIRE(!t.backward(t.one_shot, 1, no_aux_on_1));
    const auto finished = dp.finish();
    check_same_reports(finished, gradavg::libtorch::average_module_gradients(t.one_shot));
    t.check_same_gradients();
  }
}

TEST_CASE("data_parallel: frozen parameters are skipped and listed, as by the one-shot call") {
  at::set_num_threads(1);
  torch::manual_seed(29);
  Net model;
  std::vector<Net> a, b;
  for (int i = 0; i < 2; ++i)
    for (auto* set : {&a, &b}) {
      set->push_back(std::dynamic_pointer_cast<NetImpl>(model->clone()));
      for (auto& p : set->back()->frozen->parameters()) p.set_requires_grad(false);
    }
  gradavg::libtorch::data_parallel dp(a, {}, {}, {.bytes = 1});
  CHECK(dp.buckets().size() == 4);
  for (auto* set : {&a, &b})
    for (std::size_t k = 0; k < 2; ++k) {
      torch::manual_seed(k);
      (*set)[k]->forward(torch::randn({4, 6})).square().sum().backward();
    }
  const auto got = dp.finish();
  const auto want = gradavg::libtorch::average_module_gradients(b);
  check_same_reports(got, want);
  CHECK(got.skipped == std::vector<std::string>{"frozen.weight", "frozen.bias"});
  for (std::size_t k = 0; k < 2; ++k)
    for (std::size_t i = 0; i < 6; ++i) CHECK(bitwise_equal(a[k]->parameters()[i].grad(), b[k]->parameters()[i].grad()));
}

TEST_CASE("data_parallel: micro-batches accumulate under no_sync, the last backward averages their sums") {
  at::set_num_threads(1);
  twin_replicas t(2, 23);
  gradavg::libtorch::data_parallel dp(t.overlapped, {}, {}, {.bytes = 700});
  t.zero_grad(true);
  {
    const auto scope = dp.no_sync();
    REQUIRE(!t.backward(t.overlapped, 0));
    REQUIRE(!t.backward(t.overlapped, 1));
  }
  REQUIRE(!t.backward(t.overlapped, 2));
  const auto got = dp.finish();
  for (std::uint64_t batch = 0; batch < 3; ++batch) REQUIRE(!t.backward(t.one_shot, batch));
  check_same_reports(got, gradavg::libtorch::average_module_gradients(t.one_shot));
  CHECK(dp.overlapped_buckets() == dp.buckets().size());
  t.check_same_gradients();
}

TEST_CASE("data_parallel: a second backward before finish() is an error naming the replica and the parameter") {
  at::set_num_threads(1);
  twin_replicas t(2, 31);
  gradavg::libtorch::data_parallel dp(t.overlapped, {}, {}, {.bytes = 1});
  // Replica 1 runs two backward passes (its gradients then hold two batches' sums), then replica 0
  // one, which completes every bucket.
  twin_replicas::loss(t.overlapped[1], 1, 0, true, false).backward();
  twin_replicas::loss(t.overlapped[1], 1, 1, true, false).backward();
  twin_replicas::loss(t.overlapped[0], 0, 0, true, false).backward();
  const std::string e = gradavg_test::message_of<gradavg::error>([&] { dp.finish(); });
  CHECK(gradavg_test::contains(e, "replica 1 produced the gradient of parameter #0 'conv.weight' more than once"));
  CHECK(gradavg_test::contains(e, "no_sync()"));
  // Reset: the next step is averaged as usual.
  t.zero_grad(true);
  REQUIRE(!t.backward(t.overlapped, 2));
  REQUIRE(!t.backward(t.one_shot, 2));
  const auto finished = dp.finish();
  check_same_reports(finished, gradavg::libtorch::average_module_gradients(t.one_shot));
  t.check_same_gradients();
}

TEST_CASE("data_parallel: a backward that throws on one replica never hangs, and finish() names its missing gradients") {
  at::set_num_threads(1);
  for (const bool abandon : {false, true}) {
    INFO((abandon ? "abandon()" : "finish()"));
    twin_replicas t(3, 37);
    gradavg::libtorch::data_parallel dp(t.overlapped, {}, {}, {.bytes = 1});
    t.zero_grad(true);
    const std::exception_ptr failed = t.backward(t.overlapped, 0, {}, /*failing=*/2);
    REQUIRE(failed);
    std::string why;
    try {
      std::rethrow_exception(failed);
    } catch (const std::exception& e) {
      why = e.what();
    }
    CHECK(gradavg_test::contains(why, "backward failed on purpose"));
    // Replica 2 produced the heads' and fc2's gradients before failing, not fc1's nor the conv's.
    CHECK(t.overlapped[2]->head->weight.grad().defined());
    CHECK(!t.overlapped[2]->fc1->weight.grad().defined());
    if (abandon) {
      dp.abandon();
    } else {
      const std::string e = gradavg_test::message_of<gradavg::missing_gradient_error>([&] { dp.finish(); });
      CHECK(gradavg_test::contains(e, "gradient missing on tower 2"));
      CHECK(dp.overlapped_buckets() == 6);  // aux, head and fc2: produced by every replica
    }
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, 1));
    REQUIRE(!t.backward(t.one_shot, 1));
    const auto finished = dp.finish();
    check_same_reports(finished, gradavg::libtorch::average_module_gradients(t.one_shot));
    CHECK(dp.overlapped_buckets() == 12);
    t.check_same_gradients();
  }
}

TEST_CASE("data_parallel: the destructor removes every hook, and the replicas then keep their own gradients") {
  at::set_num_threads(1);
  twin_replicas t(2, 41);
  const auto hooks = [&] {
    std::size_t n = 0;
    for (auto& m : t.overlapped)
      for (auto& p : m->parameters()) n += torch::autograd::impl::grad_accumulator(p)->post_hooks().size();
    return n;
  };
  const std::size_t before = hooks();
  {
    gradavg::libtorch::data_parallel dp(t.overlapped);
    CHECK(hooks() == before + 2 * 12);
  }
  CHECK(hooks() == before);
  t.zero_grad(true);
  REQUIRE(!t.backward(t.overlapped, 0));
  REQUIRE(!t.backward(t.one_shot, 0));
  t.check_same_gradients();  // both sets unaveraged: each replica its own batch's gradient
  CHECK(!bitwise_equal(t.overlapped[0]->fc1->weight.grad(), t.overlapped[1]->fc1->weight.grad()));
}

TEST_CASE("data_parallel: options that span every parameter, null replicas and unlike replicas are errors") {
  twin_replicas t(2, 43);
  std::vector<gradavg::variable_statistics> per_variable(12);
  for (const gradavg::options& o : {gradavg::options{.compute = {.per_variable = per_variable}},
                                    gradavg::options{.compute = {.range = {0, 10}}}}) {
    CHECK(gradavg_test::contains(
        gradavg_test::message_of<gradavg::option_error>([&] { gradavg::libtorch::data_parallel dp(t.overlapped, o); }),
        "use average_module_gradients"));
  }
  CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::option_error>([&] {
                                 gradavg::libtorch::data_parallel dp(t.overlapped, {}, {.include_square = true});
                               }),
                               "module_options::include_square"));
  CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::option_error>([&] {
                                 gradavg::libtorch::module_options odd;
                                 odd.means_to = static_cast<gradavg::libtorch::mean_target>(5);
                                 gradavg::libtorch::data_parallel dp(t.overlapped, {}, odd);
                               }),
                               "module_options::means_to holds 5"));
  std::vector<torch::nn::Module*> with_null{t.overlapped[0].get(), nullptr};
  CHECK(gradavg_test::message_of<gradavg::tower_error>([&] {
          gradavg::libtorch::data_parallel dp{std::span<torch::nn::Module* const>(with_null)};
        }) == "gradavg: replica 1 is null");
  torch::manual_seed(1);
  Net other;
  std::vector<torch::nn::Module*> unlike{t.overlapped[0].get(), other.get()};
  CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::error>([&] {
                                 gradavg::libtorch::data_parallel dp{std::span<torch::nn::Module* const>(unlike)};
                               }),
                               "replica 1"));
}

TEST_CASE("data_parallel: a timeline holds each bucket's ready moment, its average and its copies") {
  at::set_num_threads(1);
  const std::string path = (std::filesystem::temp_directory_path() / "gradavg_data_parallel_timeline.json").string();
  twin_replicas t(2, 11);
  gradavg::timeline line(path);
  const gradavg::options opts{.run = {.timeline = &line}};
  gradavg::libtorch::data_parallel dp(t.overlapped, opts, {}, {.bytes = 700});
  const std::size_t buckets = dp.buckets().size();
  REQUIRE(buckets > 1);
  const std::size_t steps = 2;
  for (std::size_t step = 0; step < steps; ++step) {
    t.zero_grad(true);
    REQUIRE(!t.backward(t.overlapped, step));
    (void)dp.finish();
    REQUIRE(!t.backward(t.one_shot, step));
    (void)gradavg::libtorch::average_module_gradients(t.one_shot, gradavg::options{});
    t.check_same_gradients();  // the same bits as without a timeline
  }
  line.write();
  std::ifstream in(path);
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  auto count = [&](const std::string& name) {
    std::size_t n = 0;
    for (std::size_t at = 0; (at = text.find("\"name\":\"" + name + "\",\"cat\"", at)) != std::string::npos; ++at) ++n;
    return n;
  };
  CHECK(count("bucket ready") == steps * buckets);  // a hook completed each bucket
  CHECK(count("average bucket") == steps * buckets);
  CHECK(count("copies") == steps * buckets);  // the means into replica 1
  CHECK(count("pass") >= steps * buckets);    // each bucket's call, and any parameter no bucket holds
  CHECK(line.dropped() == 0);
  std::filesystem::remove(path);
}
