// Threads: results are bitwise identical for any thread count and executor; many small
// variables share one fork/join; user exceptions from any thread reach the caller after every
// task has finished; chunks run in the caller's floating-point environment. Built without
// OpenMP and, when found, with OpenMP (gradavg::openmp_executor tested too) and with oneTBB
// (GRADAVG_TEST_TBB: gradavg::tbb_executor tested too). Every executor goes through the same
// cases; nested use and thread start failures are in test_thread_failures.cpp.
#include <gradavg/eigen_thread_pool.hpp>
#include <gradavg/gradavg.hpp>
#if defined(_OPENMP)
#include <gradavg/openmp.hpp>
#endif
#if defined(GRADAVG_TEST_TBB)
#include <gradavg/tbb.hpp>
#include <oneapi/tbb/info.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfenv>
#include <chrono>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "fp_modes.hpp"
#include "reference.hpp"
#include "support.hpp"
#include "workload.hpp"

namespace {

using gradavg_test::bitwise_equal;
using gradavg_test::grads;
using gradavg_test::workload;

/// An executor that records how it is used, running tasks on the calling thread.
struct counting_executor final : gradavg::executor {
  std::size_t calls = 0, tasks = 0;
  std::size_t concurrency() const noexcept override { return 4; }
  void parallel_for(std::size_t n, gradavg::task_ref task) override {
    ++calls;
    tasks += n;
    for (std::size_t i = n; i-- > 0;) task(i);  // out of order on purpose
  }
};

/// An executor of this build, with what it runs on.
struct executor_under_test {
  std::string name;
  std::shared_ptr<void> owned;
  gradavg::executor* exec;
};

/// Every executor this build has; those that take a size get `threads`. Each has run once, so
/// pools that start their threads lazily have started them.
std::vector<executor_under_test> executors_under_test(std::size_t threads) {
  std::vector<executor_under_test> all;
  auto pool = std::make_shared<gradavg::thread_pool>(threads);
  all.push_back({"thread_pool", pool, pool.get()});
  struct eigen_backed {
    Eigen::ThreadPool pool;
    gradavg::eigen_thread_pool_executor exec{pool};
    explicit eigen_backed(int n) : pool(n) {}
  };
  auto eigen = std::make_shared<eigen_backed>(static_cast<int>(threads));
  all.push_back({"eigen_thread_pool_executor", eigen, &eigen->exec});
#if defined(_OPENMP)
  auto omp = std::make_shared<gradavg::openmp_executor>();
  all.push_back({"openmp_executor", omp, omp.get()});
#endif
#if defined(GRADAVG_TEST_TBB)
  struct tbb_backed {
    tbb::task_arena arena;
    gradavg::tbb_executor exec{arena};
    explicit tbb_backed(int n) : arena(n) {}
  };
  // No more than TBB's workers can fill: tasks that wait for each other need them all at once.
  const int tbb_threads = std::min(static_cast<int>(threads), tbb::info::default_concurrency());
  auto tbb = std::make_shared<tbb_backed>(tbb_threads);
  all.push_back({"tbb_executor", tbb, &tbb->exec});
#endif
  for (auto& e : all) {
    std::atomic<std::size_t> ran{0};
    auto count = [&ran](std::size_t) { ran.fetch_add(1); };
    e.exec->parallel_for(e.exec->concurrency(), gradavg::task_ref(count));
    REQUIRE(ran.load() == e.exec->concurrency());
  }
  return all;
}

/// Requires w's results with `threads` threads, started for the call and on every executor, to be
/// bitwise those of the serial run.
void check_like_serial(const workload& w, const std::pair<std::vector<grads>, std::vector<grads>>& serial,
                       std::size_t threads, const std::vector<executor_under_test>& executors) {
  INFO("threads = " << threads);
  const auto started = w.run({.run = {.threads = threads}});  // threads started for the call
  CHECK(bitwise_equal(started.first, serial.first));
  CHECK(bitwise_equal(started.second, serial.second));
  for (const auto& e : executors) {
    INFO(e.name);
    const auto pooled = w.run({.run = {.threads = threads, .pool = e.exec}});
    CHECK(bitwise_equal(pooled.first, serial.first));
    CHECK(bitwise_equal(pooled.second, serial.second));
  }
}

/// Forwards to another executor, first arming a switch (validation has passed by then).
struct arming_executor final : gradavg::executor {
  gradavg::executor* inner;
  std::atomic<bool>* armed;
  arming_executor(gradavg::executor& e, std::atomic<bool>& a) : inner(&e), armed(&a) {}
  std::size_t concurrency() const noexcept override { return inner->concurrency(); }
  void parallel_for(std::size_t n, gradavg::task_ref task) override {
    armed->store(true);
    inner->parallel_for(n, task);
  }
};

}  // namespace

namespace user {

/// A view of a framework's tensor whose storage can fail to map: data() then throws.
struct fragile_tensor {
  const std::vector<float>* values;
  const std::atomic<bool>* armed;       // throw on every thread
  std::thread::id only_thread_allowed;  // if set, throw on every other thread
};

}  // namespace user

template <>
struct gradavg::tensor_traits<user::fragile_tensor> {
  using value_type = float;
  static const float* data(const user::fragile_tensor& t) {
    if (t.armed->load() ||
        (t.only_thread_allowed != std::thread::id() && std::this_thread::get_id() != t.only_thread_allowed))
      throw std::runtime_error("tensor storage unavailable");
    return t.values->data();
  }
  static gradavg::shape shape(const user::fragile_tensor& t) noexcept {
    gradavg::shape s;
    s.rank = 1;
    s.dims[0] = static_cast<std::int64_t>(t.values->size());
    return s;
  }
};

TEST_CASE("bitwise identical results for 1, 2, 3 and 8 threads, on every executor") {
  const workload w(5, {3, 100003, 17, 250001, 1, 65536, 0, 40000});
  const auto serial = w.run({});

  // The serial result itself against the double reference.
  for (std::size_t i = 0; i < w.data[0].size(); ++i) {
    std::vector<const float*> ptrs;
    for (const auto& tower : w.data) ptrs.push_back(tower[i].data());
    const std::size_t n = w.data[0][i].size();
    const gradavg_test::reference<float> want(ptrs, n);
    CHECK(gradavg_test::first_mismatch(serial.first[i].data(), want.mean,
                                       gradavg_test::magnitude<float>(ptrs, n, false), 5) == n);
    CHECK(gradavg_test::first_mismatch(serial.second[i].data(), want.square,
                                       gradavg_test::magnitude<float>(ptrs, n, true), 5) == n);
  }

  const auto executors = executors_under_test(3);
  for (std::size_t threads : {1, 2, 3, 8}) {
    check_like_serial(w, serial, threads, executors);
    INFO("threads = " << threads);
    counting_executor counting;
    const auto counted = w.run({.run = {.threads = threads, .pool = &counting}});
    CHECK(bitwise_equal(counted.first, serial.first));
    CHECK(counting.tasks == (threads == 1 ? 0u : threads));
  }
  for (const auto& e : executors) {
    INFO(e.name);
    CHECK(bitwise_equal(w.run({.run = {.threads = 0, .pool = e.exec}}).first, serial.first));
    CHECK(bitwise_equal(w.run({.run = {.pool = e.exec}}).first, serial.first));
  }
}

TEST_CASE("a pool given with threads left unset runs on all of the pool, and threads = 1 stays serial") {
  // 4 towers of 300,000 floats, means and squares: 7.2 MB, worth 6 chunks of 1 MiB.
  const workload w(4, {300000});
  const auto serial = w.run({.run = {.threads = 1}});
  counting_executor counting;  // concurrency 4
  const auto counted = w.run({.run = {.pool = &counting}});
  CHECK(counting.calls == 1);
  CHECK(counting.tasks == 4);
  CHECK(bitwise_equal(counted.first, serial.first));
  CHECK(bitwise_equal(counted.second, serial.second));
  counting_executor told_serial;
  w.run({.run = {.threads = 1, .pool = &told_serial}});
  CHECK(told_serial.calls == 0);
  // The allocating API reads the same options.
  counting_executor allocating;
  const auto result = gradavg::average_gradients(w.tg, {.run = {.pool = &allocating}});
  CHECK(allocating.calls == 1);
  CHECK(result.gradients[0].first == serial.first[0]);
}

TEST_CASE("many small variables share one fork/join") {
  std::vector<std::size_t> sizes(300, 1000);
  const workload w(4, sizes);
  counting_executor counting;
  const auto counted = w.run({.run = {.threads = 4, .pool = &counting}});
  CHECK(counting.calls == 1);
  CHECK(counting.tasks == 4);
  CHECK(bitwise_equal(counted.first, w.run({}).first));
}

TEST_CASE("small calls stay on the calling thread") {
  const workload w(2, {100, 200});
  counting_executor counting;
  w.run({.run = {.threads = 8, .pool = &counting}});
  CHECK(counting.calls == 0);
}

TEST_CASE("chunks are sized by the bytes they move, not by elements") {
  // 40000 floats per tower, mean and squares: (T + 2) * 4 bytes per element.
  // T = 2: 640 KB in all, under one 1 MiB chunk: the caller's thread does it all.
  counting_executor two_towers;
  workload(2, {40000}).run({.run = {.threads = 8, .pool = &two_towers}});
  CHECK(two_towers.calls == 0);
  // T = 16: 2.88 MB, two whole chunks of at least 1 MiB.
  counting_executor sixteen_towers;
  const workload w(16, {40000});
  const auto counted = w.run({.run = {.threads = 8, .pool = &sixteen_towers}});
  CHECK(sixteen_towers.calls == 1);
  CHECK(sixteen_towers.tasks == 2);
  CHECK(bitwise_equal(counted.first, w.run({}).first));
}

TEST_CASE("the allocating API is threaded too, with identical results") {
  const workload w(3, {70001, 5, 90000});
  gradavg::thread_pool pool(2);
  const auto serial = gradavg::average_gradients(w.tg, gradavg::include_square);
  const auto pooled = gradavg::average_gradients(w.tg, gradavg::include_square, {.run = {.threads = 2, .pool = &pool}});
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(serial.gradients[i].first == pooled.gradients[i].first);
    CHECK(serial.squares[i].first == pooled.squares[i].first);
  }
}

TEST_CASE("thread_pool runs each task exactly once, call after call") {
  gradavg::thread_pool pool(4);
  CHECK(pool.concurrency() == 4);
  for (std::size_t n : {0, 1, 3, 4, 5, 64, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    auto task = [&hits](std::size_t i) { hits[i].fetch_add(1); };
    for (int round = 0; round < 20; ++round) pool.parallel_for(n, gradavg::task_ref(task));
    for (std::size_t i = 0; i < n; ++i) CHECK(hits[i].load() == 20);
  }
}

TEST_CASE("thread_pool of one runs on the caller") {
  gradavg::thread_pool pool(1);
  CHECK(pool.concurrency() == 1);
  std::vector<int> hits(10, 0);
  auto task = [&hits](std::size_t i) { ++hits[i]; };
  pool.parallel_for(10, gradavg::task_ref(task));
  CHECK(hits == std::vector<int>(10, 1));
}

TEST_CASE("a task that throws reaches the caller after every started task has returned, on every executor") {
  for (const auto& e : executors_under_test(3)) {
    const std::size_t n = e.exec->concurrency();
    if (n < 2) continue;  // OpenMP on one core: nothing runs concurrently
    for (const bool on_caller : {true, false}) {
      INFO(e.name << (on_caller ? ": thrown on the calling thread" : ": thrown on the other threads"));
      // n tasks that wait for each other, so every thread runs one; then some throw while the
      // others are still running.
      const auto caller = std::this_thread::get_id();
      std::atomic<std::size_t> arrived{0}, returned{0}, threw{0};
      auto task = [&](std::size_t) {
        arrived.fetch_add(1);
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (arrived.load() < n && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
        if ((std::this_thread::get_id() == caller) == on_caller) {
          threw.fetch_add(1);
          throw std::runtime_error("task failed");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        returned.fetch_add(1);
      };
      std::string message;
      try {
        e.exec->parallel_for(n, gradavg::task_ref(task));
      } catch (const std::runtime_error& error) {
        message = error.what();
      }
      CHECK(message == "task failed");
      CHECK(threw.load() >= 1);
      CHECK(returned.load() + threw.load() == arrived.load());

      // The executor serves the next call as before.
      std::vector<std::atomic<int>> hits(64);
      auto count = [&hits](std::size_t i) { hits[i].fetch_add(1); };
      e.exec->parallel_for(hits.size(), gradavg::task_ref(count));
      for (const auto& h : hits) CHECK(h.load() == 1);
    }
  }
}

TEST_CASE("the chunks never call a tensor adapter: data() runs on the calling thread alone, whatever the checks") {
  // 100 variables on 4 towers: 500 buffers, more than the checks keep on the stack. data() throws
  // once the executor has started (armed) or on any thread but the allowed one: a chunk that read
  // a gradient through its adapter would throw.
  const std::size_t towers = 4, variables = 100;
  const std::size_t n = 4000;  // means only: 20 bytes per element, 8 MB in all, worth 7 chunks
  std::vector<std::vector<std::vector<float>>> data(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i)
      data[k].push_back(gradavg_test::random_values<float>(n, static_cast<std::uint32_t>(k * variables + i + 7)));
  std::atomic<bool> armed{false};
  auto towers_of = [&](std::thread::id only) {
    std::vector<std::vector<std::pair<user::fragile_tensor, int>>> tg(towers);
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < variables; ++i)
        tg[k].push_back({user::fragile_tensor{&data[k][i], &armed, only}, static_cast<int>(i)});
    return tg;
  };
  const auto tg = towers_of({});
  std::vector<std::vector<float>> serial(variables, std::vector<float>(n));
  gradavg::average_gradients_into(tg, serial, {.run = {.threads = 1}});
  // The serial result against the double reference.
  for (std::size_t i = 0; i < variables; ++i) {
    std::vector<const float*> ptrs;
    for (std::size_t k = 0; k < towers; ++k) ptrs.push_back(data[k][i].data());
    const gradavg_test::reference<float> want(ptrs, n);
    CHECK(gradavg_test::first_mismatch(serial[i].data(), want.mean, gradavg_test::magnitude<float>(ptrs, n, false), 5) == n);
  }

  const auto caller_only = towers_of(std::this_thread::get_id());
  for (const auto check : {gradavg::alias_check::none, gradavg::alias_check::same_variable, gradavg::alias_check::all}) {
    INFO("alias check " << static_cast<int>(check));
    for (const auto& e : executors_under_test(4)) {
      INFO(e.name);
      armed = false;
      arming_executor arming(*e.exec, armed);
      std::vector<std::vector<float>> means(variables, std::vector<float>(n));
      gradavg::average_gradients_into(tg, means, {.run = {.threads = 4, .pool = &arming}, .check = {.aliasing = check}});
      CHECK(armed);  // the executor ran: data() would have thrown from then on
      CHECK(bitwise_equal(means, serial));
      armed = false;
    }
    // Threads started for the call: data() throws on every thread but the caller's.
    std::vector<std::vector<float>> means(variables, std::vector<float>(n));
    gradavg::average_gradients_into(caller_only, means, {.run = {.threads = 4}, .check = {.aliasing = check}});
    CHECK(bitwise_equal(means, serial));
  }

  // With a plan the chunks use the pointers the checks read, as without one.
  gradavg::plan plan;
  std::vector<std::vector<float>> planned(variables, std::vector<float>(n));
  gradavg::average_gradients_into(plan, caller_only, planned, {.run = {.threads = 4}});
  gradavg::average_gradients_into(plan, caller_only, planned, {.run = {.threads = 4}});
  CHECK(plan.proofs() == 1);
  CHECK(bitwise_equal(planned, serial));
}

TEST_CASE("an executor that fails, or returns before running every task, is reported") {
  const workload w(4, {300000});
  struct failing_executor final : gradavg::executor {
    std::size_t concurrency() const noexcept override { return 4; }
    void parallel_for(std::size_t, gradavg::task_ref) override { throw std::runtime_error("executor shut down"); }
  } failing;
  CHECK(gradavg_test::message_of<std::runtime_error>([&] { w.run({.run = {.pool = &failing}}); }) == "executor shut down");
  struct lazy_executor final : gradavg::executor {
    std::size_t concurrency() const noexcept override { return 4; }
    void parallel_for(std::size_t n, gradavg::task_ref task) override {
      for (std::size_t i = 0; i + 1 < n; ++i) task(i);  // drops the last task
    }
  } lazy;
  CHECK(gradavg_test::contains(gradavg_test::message_of<std::logic_error>([&] { w.run({.run = {.pool = &lazy}}); }),
                               "without running every task"));

  // The same number of calls as a correct executor makes: task 0 twice, the last one never.
  struct repeating_executor final : gradavg::executor {
    std::size_t concurrency() const noexcept override { return 4; }
    void parallel_for(std::size_t n, gradavg::task_ref task) override {
      task(0);
      for (std::size_t i = 0; i + 1 < n; ++i) task(i);
    }
  } repeating;
  CHECK(gradavg_test::contains(gradavg_test::message_of<std::logic_error>([&] { w.run({.run = {.pool = &repeating}}); }),
                               "more than once"));
  struct straying_executor final : gradavg::executor {
    std::size_t concurrency() const noexcept override { return 4; }
    void parallel_for(std::size_t n, gradavg::task_ref task) override {
      for (std::size_t i = 1; i <= n; ++i) task(i);  // one past the end, never task 0
    }
  } straying;
  CHECK(gradavg_test::contains(gradavg_test::message_of<std::logic_error>([&] { w.run({.run = {.pool = &straying}}); }),
                               "out of range"));
}

TEST_CASE("chunks run in the caller's floating-point environment, whichever thread runs them") {
  // The pools start their threads before the caller changes its modes.
  const auto executors = executors_under_test(4);
  const std::size_t towers = 3;
  const std::size_t n = 700001;  // means and squares: 20 bytes per element, 14 MB

  auto check_every_executor = [&](const workload& w, const std::pair<std::vector<grads>, std::vector<grads>>& serial) {
    for (std::size_t threads : {2, 3, 4}) check_like_serial(w, serial, threads, executors);
  };

  SECTION("flush to zero, denormals as zero") {
    if (!gradavg_test::flush_denormals::supported) return;
    workload w(towers, {n});
    for (auto& tower : w.data)
      for (std::size_t j = 0; j < n; ++j) tower[0][j] = std::ldexp(1.0f + static_cast<float>(j % 7), -135);  // denormal
    const gradavg_test::flush_denormals ftz;
    const auto serial = w.run({.run = {.threads = 1}});
    // Denormal inputs read as zero: every mean and square is +0.
    const std::vector<grads> zeros{grads(n, 0.0f)};
    CHECK(bitwise_equal(serial.first, zeros));
    CHECK(bitwise_equal(serial.second, zeros));
    check_every_executor(w, serial);
  }

  SECTION("rounding upward") {
    const workload w(towers, {n});
    const gradavg_test::round_upward upward;
    const auto serial = w.run({.run = {.threads = 1}});
    // The mean by its definition, in the same rounding mode: summed in tower order, divided by T.
    std::size_t mismatches = 0;
    for (std::size_t j = 0; j < n; ++j) {
      volatile float sum = w.data[0][0][j];
      for (std::size_t k = 1; k < towers; ++k) sum = sum + w.data[k][0][j];
      const float mean = sum / static_cast<float>(towers);
      if (!gradavg_test::same_bits(&mean, &serial.first[0][j], 1)) ++mismatches;
    }
    CHECK(mismatches == 0);
    check_every_executor(w, serial);
  }
}

TEST_CASE("a task that calls gradavg on the same executor gets the serial result, on every executor") {
  // A hang here fails through ctest's TIMEOUT; test_thread_failures.cpp runs the thread_pool and
  // Eigen cases in a child process with a time limit as well.
  const workload w(4, {300000});  // means and squares: 7.2 MB, worth 6 chunks
  const auto serial = w.run({.run = {.threads = 1}});
  for (const auto& e : executors_under_test(3)) {
    INFO(e.name);
    std::vector<std::pair<std::vector<grads>, std::vector<grads>>> results(6);
    auto task = [&](std::size_t i) { results[i] = w.run({.run = {.threads = 3, .pool = e.exec}}); };
    e.exec->parallel_for(results.size(), gradavg::task_ref(task));
    for (const auto& r : results) {
      CHECK(bitwise_equal(r.first, serial.first));
      CHECK(bitwise_equal(r.second, serial.second));
    }
  }
}
