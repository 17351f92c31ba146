// gradavg: an executor over an Eigen thread pool (unsupported/Eigen/CXX11/ThreadPool: Eigen's
// non-blocking work-stealing pool, the one TensorFlow's intra-op work runs on). Pass the pool
// your program already runs, so averaging adds no threads of its own:
//
//   Eigen::ThreadPool eigen_pool(8);
//   gradavg::eigen_thread_pool_executor pool(eigen_pool);
//   gradavg::average_gradients_into(tower_grads, means, {.run = {.pool = &pool}});
//
// Not included by gradavg.hpp: it pulls in Eigen's ThreadPool module (threads, <functional>).
#pragma once

#include <unsupported/Eigen/CXX11/ThreadPool>

#include <algorithm>
#include <atomic>
#include <cstddef>

#include "executor.hpp"

namespace gradavg {

/// Runs tasks on an Eigen::ThreadPoolInterface (Eigen::ThreadPool, or TensorFlow's pool) and on
/// the calling thread, which takes part: up to NumThreads() tasks at once, so one pool thread
/// stays free for other work when the caller is not one of them. Called from one of the pool's
/// own threads (nested use), it runs the tasks inline there. Allocates nothing per call. The
/// pool is not owned and must outlive the executor.
class eigen_thread_pool_executor final : public executor {
 public:
  explicit eigen_thread_pool_executor(Eigen::ThreadPoolInterface& pool) noexcept : pool_(&pool) {}

  [[nodiscard]] std::size_t concurrency() const noexcept override {
    return static_cast<std::size_t>(std::max(1, pool_->NumThreads()));
  }

  /// If tasks throw, the tasks not yet started are skipped and the first exception is rethrown
  /// once every started task has returned.
  void parallel_for(std::size_t n, task_ref task) override {
    if (n == 0) return;
    const std::size_t helpers = std::min(n, concurrency()) - 1;
    if (helpers == 0 || pool_->CurrentThreadId() != -1) {
      shared_detail::run_inline(n, task);
      return;
    }
    job work(task, n);
    Eigen::Barrier finished(static_cast<unsigned>(helpers));
    std::size_t scheduled = 0;
    try {
      for (; scheduled < helpers; ++scheduled) {
        pool_->Schedule([&work, &finished] {  // two references: std::function stores them inline
          work.drain();
          finished.Notify();
        });
      }
    } catch (...) {  // the caller runs the tasks that no helper takes
      for (; scheduled < helpers; ++scheduled) finished.Notify();
    }
    work.drain();
    finished.Wait();
    work.error.rethrow_if_any();
  }

 private:
  struct job {
    job(task_ref t, std::size_t count) noexcept : task(t), n(count) {}
    task_ref task;
    std::size_t n;
    std::atomic<std::size_t> next{0};
    shared_detail::first_exception error;

    void drain() noexcept {
      for (std::size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
        try {
          task(i);
        } catch (...) {
          error.capture();
          next.store(n);
        }
      }
    }
  };

  Eigen::ThreadPoolInterface* pool_;
};

}  // namespace gradavg
