// gradavg: an executor over oneTBB (libtbb-dev; CMake: find_package(TBB) and link TBB::tbb).
// Runs the chunks as TBB tasks in a task arena — the one you give, or the calling thread's —
// so averaging shares TBB's workers with the rest of your program:
//
//   gradavg::tbb_executor pool;  // the calling thread's arena
//   gradavg::average_gradients_into(tower_grads, means, {.run = {.pool = &pool}});
//
// Not included by gradavg.hpp: it needs oneTBB.
#pragma once

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cstddef>

#include "executor.hpp"

namespace gradavg {

/// Runs tasks with tbb::parallel_for, one TBB task per index, in the given arena or the calling
/// thread's. TBB's own rules hold: the calling thread takes part; a task that throws cancels the
/// tasks not yet started and its exception is rethrown once the started ones have returned;
/// nested use works (a waiting thread runs other tasks). The arena is not owned.
class tbb_executor final : public executor {
 public:
  /// Runs in the arena of the thread that calls parallel_for.
  tbb_executor() noexcept = default;
  explicit tbb_executor(tbb::task_arena& arena) noexcept : arena_(&arena) {}

  [[nodiscard]] std::size_t concurrency() const noexcept override {
    const int n = arena_ != nullptr ? arena_->max_concurrency() : tbb::this_task_arena::max_concurrency();
    return static_cast<std::size_t>(std::max(1, n));
  }

  void parallel_for(std::size_t n, task_ref task) override {
    if (n == 0) return;
    auto run = [n, &task] {
      tbb::parallel_for(
          tbb::blocked_range<std::size_t>(0, n, 1),
          [&task](const tbb::blocked_range<std::size_t>& r) {
            for (std::size_t i = r.begin(); i != r.end(); ++i) task(i);
          },
          tbb::simple_partitioner());
    };
    if (arena_ != nullptr) {
      arena_->execute(run);
    } else {
      run();
    }
  }

 private:
  tbb::task_arena* arena_ = nullptr;
};

}  // namespace gradavg
