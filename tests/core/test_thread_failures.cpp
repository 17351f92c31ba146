// Threads under hostile conditions, each case in a child process with a time limit, so that a
// regression (std::terminate, a deadlock) fails the case instead of killing or hanging the suite:
// threads that cannot start (address space capped with RLIMIT_AS), and nested use of a pool from
// its own tasks. This process itself never starts a thread, so forking it is safe.
#include <gradavg/eigen_thread_pool.hpp>
#include <gradavg/gradavg.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "child_process.hpp"
#include "workload.hpp"

// Sanitizers reserve terabytes of address space: an RLIMIT_AS cap breaks them, not the pool.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GRADAVG_TEST_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define GRADAVG_TEST_UNDER_SANITIZER 1
#endif
#endif

namespace {

using gradavg_test::bitwise_equal;
using gradavg_test::run_in_child;
using gradavg_test::workload;

constexpr unsigned time_limit_seconds = 60;

/// Exit codes of the children.
enum : int { passed = 0, wrong_result = 1, limit_not_set = 2, limit_did_not_bite = 3, thread_left = 4 };

/// How many of n threads, all alive at once, can start (they are joined before it returns).
[[maybe_unused]] std::size_t startable_threads(std::size_t n) {
  std::atomic<bool> release{false};
  std::vector<std::thread> started;
  started.reserve(n);
  try {
    while (started.size() < n)
      started.emplace_back([&release] {
        while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      });
  } catch (const std::system_error&) {
  }
  release = true;
  for (auto& t : started) t.join();
  return started.size();
}

}  // namespace

TEST_CASE("a pool whose threads cannot all start throws std::system_error and leaves no thread behind") {
#if defined(GRADAVG_TEST_UNDER_SANITIZER) || defined(GRADAVG_TEST_UNDER_EMULATOR)
  WARN("not run under a sanitizer or an emulator (qemu-user keeps its own address space): it needs RLIMIT_AS");
#else
  const auto end = run_in_child(time_limit_seconds, [] {
    // 200 threads' stacks (8 MiB each by default) do not fit in 512 MiB.
    if (!gradavg_test::limit_address_space(std::size_t{512} << 20)) return int{limit_not_set};
    try {
      gradavg::thread_pool pool(200);
      return int{limit_did_not_bite};
    } catch (const std::system_error&) {
      return gradavg_test::threads_in_this_process() == 1 ? int{passed} : int{thread_left};
    }
  });
  INFO("child " << end.describe());
  CHECK(end.ok());
#endif
}

TEST_CASE("threads started for the call that cannot start leave their chunks to the caller") {
#if defined(GRADAVG_TEST_UNDER_SANITIZER) || defined(GRADAVG_TEST_UNDER_EMULATOR)
  WARN("not run under a sanitizer or an emulator (qemu-user keeps its own address space): it needs RLIMIT_AS");
#else
  const auto end = run_in_child(time_limit_seconds, [] {
    // 2 towers of 6M floats, means only: 72 MB, worth 64 chunks of 1 MiB.
    const workload w(2, {6000000});
    std::vector<gradavg_test::grads> serial = w.outputs(), threaded = w.outputs();
    gradavg::average_gradients_into(w.tg, serial, {.run = {.threads = 1}});
    // Room for a few more thread stacks, far from 63.
    if (!gradavg_test::limit_address_space(gradavg_test::address_space_in_use() + (std::size_t{64} << 20)))
      return int{limit_not_set};
    gradavg::average_gradients_into(w.tg, threaded, {.run = {.threads = 64}});
    if (startable_threads(63) == 63) return int{limit_did_not_bite};
    return bitwise_equal(threaded, serial) ? int{passed} : int{wrong_result};
  });
  INFO("child " << end.describe());
  CHECK(end.ok());
#endif
}

namespace {

/// In the child: tasks on the pool's workers and on the calling thread each average on the same
/// pool; every result must equal the serial one.
int nested_use_on(gradavg::executor& pool) {
  const workload w(4, {300000});  // means and squares: 7.2 MB, worth 6 chunks
  const auto serial = w.run({.run = {.threads = 1}});
  std::vector<std::pair<std::vector<gradavg_test::grads>, std::vector<gradavg_test::grads>>> results(6);
  auto task = [&](std::size_t i) { results[i] = w.run({.run = {.threads = 3, .pool = &pool}}); };
  pool.parallel_for(results.size(), gradavg::task_ref(task));
  for (const auto& r : results)
    if (!bitwise_equal(r.first, serial.first) || !bitwise_equal(r.second, serial.second)) return int{wrong_result};
  return int{passed};
}

}  // namespace

TEST_CASE("a thread_pool task that calls gradavg on the same pool runs it inline instead of deadlocking") {
  const auto end = run_in_child(time_limit_seconds, [] {
    gradavg::thread_pool pool(3);
    return nested_use_on(pool);
  });
  INFO("child " << end.describe());
  CHECK(end.ok());
}

TEST_CASE("an Eigen pool's task that calls gradavg on the same pool runs it inline instead of deadlocking") {
  const auto end = run_in_child(time_limit_seconds, [] {
    Eigen::ThreadPool eigen_pool(3);
    gradavg::eigen_thread_pool_executor pool(eigen_pool);
    return nested_use_on(pool);
  });
  INFO("child " << end.describe());
  CHECK(end.ok());
}
