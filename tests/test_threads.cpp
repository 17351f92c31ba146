// Threads: results are bitwise identical for any thread count and executor; many small
// variables share one fork/join. Built twice: without OpenMP and, when found, with OpenMP,
// where gradavg::openmp_executor is tested too.
#include <gradavg/gradavg.hpp>

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"

namespace {

using grads = std::vector<float>;

/// Towers over variables of awkward sizes, larger in total than several chunks.
struct workload {
  std::vector<std::vector<grads>> data;  // [tower][variable]
  std::vector<std::vector<std::pair<const grads*, int>>> tg;

  workload(std::size_t towers, const std::vector<std::size_t>& sizes) : data(towers), tg(towers) {
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i)
        data[k].push_back(gradavg_test::random_values<float>(sizes[i], static_cast<std::uint32_t>(1000 * k + i)));
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i) tg[k].push_back({&data[k][i], static_cast<int>(i)});
  }

  std::pair<std::vector<grads>, std::vector<grads>> run(const gradavg::options& opts) const {
    std::vector<grads> means, squares;
    for (const auto& g : data[0]) {
      means.push_back(grads(g.size(), -1.0f));
      squares.push_back(grads(g.size(), -1.0f));
    }
    gradavg::average_gradients_into(tg, means, squares, opts);
    return {means, squares};
  }
};

bool bitwise_equal(const std::vector<grads>& a, const std::vector<grads>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || !gradavg_test::same_bits(a[i].data(), b[i].data(), a[i].size())) return false;
  return true;
}

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

}  // namespace

TEST_CASE("bitwise identical results for 1, 2, 3 and 8 threads, on every executor") {
  const workload w(5, {3, 100003, 17, 250001, 1, 65536, 0, 40000});
  const auto serial = w.run({});

  // The serial result itself against the double reference.
  for (std::size_t i = 0; i < w.data[0].size(); ++i) {
    std::vector<const float*> ptrs;
    for (const auto& tower : w.data) ptrs.push_back(tower[i].data());
    const std::size_t n = w.data[0][i].size();
    const gradavg_test::reference<float> want(ptrs, n);
    CHECK(gradavg_test::first_mismatch(serial.first[i].data(), want.mean, gradavg_test::magnitude<float>(ptrs, n, false),
                                       5) == n);
    CHECK(gradavg_test::first_mismatch(serial.second[i].data(), want.square,
                                       gradavg_test::magnitude<float>(ptrs, n, true), 5) == n);
  }

  gradavg::thread_pool pool(3);
  for (std::size_t threads : {1, 2, 3, 8}) {
    INFO("threads = " << threads);
    const auto started = w.run({.threads = threads});  // threads started for the call
    CHECK(bitwise_equal(started.first, serial.first));
    CHECK(bitwise_equal(started.second, serial.second));
    const auto pooled = w.run({.threads = threads, .pool = &pool});
    CHECK(bitwise_equal(pooled.first, serial.first));
    CHECK(bitwise_equal(pooled.second, serial.second));
    counting_executor counting;
    const auto counted = w.run({.threads = threads, .pool = &counting});
    CHECK(bitwise_equal(counted.first, serial.first));
    CHECK(counting.tasks == (threads == 1 ? 0u : threads));
#if defined(_OPENMP)
    gradavg::openmp_executor omp;
    const auto with_omp = w.run({.threads = threads, .pool = &omp});
    CHECK(bitwise_equal(with_omp.first, serial.first));
    CHECK(bitwise_equal(with_omp.second, serial.second));
#endif
  }
  const auto all = w.run({.threads = 0, .pool = &pool});
  CHECK(bitwise_equal(all.first, serial.first));
}

TEST_CASE("many small variables share one fork/join") {
  std::vector<std::size_t> sizes(300, 1000);
  const workload w(4, sizes);
  counting_executor counting;
  const auto counted = w.run({.threads = 4, .pool = &counting});
  CHECK(counting.calls == 1);
  CHECK(counting.tasks == 4);
  CHECK(bitwise_equal(counted.first, w.run({}).first));
}

TEST_CASE("small calls stay on the calling thread") {
  const workload w(2, {100, 200});
  counting_executor counting;
  w.run({.threads = 8, .pool = &counting});
  CHECK(counting.calls == 0);
}

TEST_CASE("chunks are sized by the bytes they move, not by elements") {
  // 40000 floats per tower, mean and squares: (T + 2) * 4 bytes per element.
  // T = 2: 640 KB in all, under one 1 MiB chunk: the caller's thread does it all.
  counting_executor two_towers;
  workload(2, {40000}).run({.threads = 8, .pool = &two_towers});
  CHECK(two_towers.calls == 0);
  // T = 16: 2.88 MB, two whole chunks of at least 1 MiB.
  counting_executor sixteen_towers;
  const workload w(16, {40000});
  const auto counted = w.run({.threads = 8, .pool = &sixteen_towers});
  CHECK(sixteen_towers.calls == 1);
  CHECK(sixteen_towers.tasks == 2);
  CHECK(bitwise_equal(counted.first, w.run({}).first));
}

TEST_CASE("the allocating API is threaded too, with identical results") {
  const workload w(3, {70001, 5, 90000});
  gradavg::thread_pool pool(2);
  const auto serial = gradavg::average_gradients(w.tg, {.include_square = true});
  const auto pooled = gradavg::average_gradients(w.tg, {.include_square = true, .threads = 2, .pool = &pool});
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
