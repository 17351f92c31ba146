// average_gradients_into allocates nothing on the calling thread nor on a pool's threads, with
// threads = 1 or with a pool (docs/threads.md: "What allocates"). Global operator new is replaced
// (replaced_new.hpp) by one that counts, in every thread, while a window is open.
#include <gradavg/eigen_thread_pool.hpp>
#include <gradavg/gradavg.hpp>
#include <gradavg/sparse.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "replaced_new.hpp"
#include "workload.hpp"

namespace {

std::atomic<bool> counting{false};
std::atomic<std::size_t> allocations{0};

/// How many times operator new ran, on any thread, while f ran.
template <class F>
std::size_t allocations_during(F&& f) {
  allocations = 0;
  counting = true;
  f();
  counting = false;
  return allocations.load();
}

}  // namespace

void gradavg_test::on_allocation() {
  if (counting.load()) allocations.fetch_add(1);
}

TEST_CASE("the counter sees allocations on any thread") {
  CHECK(allocations_during([] {
          void* volatile p = ::operator new(16);  // volatile: neither call is optimised away
          ::operator delete(p);
        }) == 1);
  const gradavg_test::workload w(4, {300000});  // 7.2 MB, worth 6 chunks
  auto means = w.outputs(), squares = w.outputs();
  // Threads started for the call allocate (docs/threads.md: "What allocates").
  CHECK(allocations_during([&] { gradavg::average_gradients_into(w.tg, means, squares, {.run = {.threads = 4}}); }) > 0);
}

TEST_CASE("average_gradients_into allocates nothing with threads = 1") {
  const gradavg_test::workload w(3, {1, 100, 7, 4096, 300000, 0, 33});
  auto means = w.outputs(), squares = w.outputs();
  CHECK(allocations_during([&] { gradavg::average_gradients_into(w.tg, means, squares); }) == 0);
  CHECK(allocations_during([&] { gradavg::average_gradients_into(w.tg, means); }) == 0);
  for (const auto check : {gradavg::alias_check::same_variable, gradavg::alias_check::none}) {
    INFO("alias check " << static_cast<int>(check));
    CHECK(allocations_during([&] { gradavg::average_gradients_into(w.tg, means, squares, {.check = {.aliasing = check}}); }) == 0);
  }
  // In place into tower 0's gradients.
  auto towers = w.data;
  std::vector<std::vector<std::pair<gradavg_test::grads*, int>>> tg(towers.size());
  for (std::size_t k = 0; k < towers.size(); ++k)
    for (std::size_t i = 0; i < towers[k].size(); ++i) tg[k].push_back({&towers[k][i], static_cast<int>(i)});
  std::vector<gradavg_test::grads*> in_place;
  for (auto& g : towers[0]) in_place.push_back(&g);
  CHECK(allocations_during([&] { gradavg::average_gradients_into(tg, in_place); }) == 0);
}

TEST_CASE("a call with a plan that holds its proof allocates nothing") {
  const gradavg_test::workload w(3, {1, 100, 7, 4096, 300000, 0, 33});
  auto means = w.outputs(), squares = w.outputs();
  gradavg::plan step;
  gradavg::average_gradients_into(step, w.tg, means, squares);  // the first call keeps the proof
  CHECK(allocations_during([&] { gradavg::average_gradients_into(step, w.tg, means, squares); }) == 0);
  CHECK(allocations_during([&] { gradavg::average_gradients_into(step, w.tg, means, squares, {.run = {.threads = 1}}); }) == 0);
  CHECK(step.proofs() == 1);
}

TEST_CASE("average_gradients_into allocates nothing on a pool, on any of its threads") {
  const gradavg_test::workload w(4, {300000, 5, 250000});  // worth 10 chunks
  auto means = w.outputs(), squares = w.outputs();
  gradavg::thread_pool pool(3);
  Eigen::ThreadPool eigen_pool(3);
  gradavg::eigen_thread_pool_executor eigen(eigen_pool);
  for (gradavg::executor* exec : std::initializer_list<gradavg::executor*>{&pool, &eigen}) {
    gradavg::average_gradients_into(w.tg, means, squares, {.run = {.pool = exec}});  // the first call may start things
    CHECK(allocations_during([&] { gradavg::average_gradients_into(w.tg, means, squares, {.run = {.pool = exec}}); }) == 0);
    CHECK(allocations_during(
              [&] { gradavg::average_gradients_into(w.tg, means, squares, {.run = {.threads = 2, .pool = exec}}); }) == 0);
  }
}

TEST_CASE("the fused step allocates nothing, on one thread or a pool") {
  const gradavg_test::workload w(4, {300000, 5, 250000, 0, 17});  // worth 10 chunks
  auto means = w.outputs(), squares = w.outputs();
  std::vector<gradavg::variable_statistics> per_variable(w.data[0].size());
  const double weights[] = {1, 2, 0.5, 3};
  gradavg::thread_pool pool(3);
  for (gradavg::executor* exec : std::initializer_list<gradavg::executor*>{nullptr, &pool}) {
    INFO("pool " << (exec != nullptr));
    for (const auto policy : {gradavg::nonfinite_policy::report, gradavg::nonfinite_policy::zero}) {
      const gradavg::options opts{.compute = {.weights = weights, .scale = 0.125, .on_nonfinite = policy, .statistics = true, .per_variable = per_variable}};
      gradavg::options with_pool = opts;
      with_pool.run.pool = exec;
      gradavg::average_gradients_into(w.tg, means, squares, with_pool);  // the first call may start things
      CHECK(allocations_during([&] { gradavg::average_gradients_into(w.tg, means, squares, with_pool); }) == 0);
      with_pool.compute.range = {1000, 400000};
      with_pool.compute.accumulate = gradavg::accumulation::double_precision;
      CHECK(allocations_during([&] { gradavg::average_gradients_into(w.tg, means, with_pool); }) == 0);
    }
  }
}

TEST_CASE("row-sparse: with a workspace, a loop's calls allocate nothing once grown") {
  // Three towers of a [500, 16] table, each listing 40 rows (repeats included), and a second
  // variable; dense and coalesced outputs, on the calling thread and on a pool.
  using G = gradavg::row_sparse<std::int64_t, float>;
  std::vector<std::vector<std::int64_t>> indices(3);
  std::vector<std::vector<float>> values(3);
  std::vector<std::vector<std::pair<G, int>>> tg(3);
  for (std::size_t k = 0; k < 3; ++k) {
    for (std::int64_t n = 0; n < 40; ++n) indices[k].push_back((n * 37 + static_cast<std::int64_t>(k) * 11) % 500);
    indices[k].push_back(indices[k][0]);
    values[k].assign(indices[k].size() * 16, 0.5f + static_cast<float>(k));
    const auto g = gradavg::rows_of<std::int64_t, float>(indices[k], values[k].data(), gradavg::shape::matrix(500, 16));
    tg[k] = {{g, 0}, {g, 1}};
  }
  gradavg::sparse_workspace work;
  std::vector<float> dense0(500 * 16), dense1(500 * 16);
  std::vector<std::vector<float>*> dense{&dense0, &dense1};
  gradavg::sparse_rows<std::int64_t, float> rows0, rows1, sq0, sq1;
  std::vector<gradavg::sparse_rows<std::int64_t, float>*> coalesced{&rows0, &rows1}, squares{&sq0, &sq1};
  gradavg::average_gradients_into(work, tg, dense);  // grows the workspace and the outputs
  gradavg::average_gradients_into(work, tg, coalesced, squares);
  CHECK(allocations_during([&] { gradavg::average_gradients_into(work, tg, dense); }) == 0);
  CHECK(allocations_during([&] { gradavg::average_gradients_into(work, tg, coalesced, squares); }) == 0);
  gradavg::options statistics;
  std::vector<gradavg::variable_statistics> per_variable(2);
  statistics.compute.statistics = true;
  statistics.compute.per_variable = per_variable;
  gradavg::average_gradients_into(work, tg, coalesced, squares, statistics);
  CHECK(allocations_during([&] { gradavg::average_gradients_into(work, tg, coalesced, squares, statistics); }) == 0);
  // Without a workspace the call allocates its scratch.
  CHECK(allocations_during([&] { gradavg::average_gradients_into(tg, dense); }) > 0);
}
