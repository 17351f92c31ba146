// gradavg: running the averaging on several threads.
//
// options.threads says how many threads a call may use (1 by default, 0 for all the executor's
// or the machine's). The work — all variables' elements as one flat range — is split into that
// many contiguous chunks, so hundreds of small variables cost one fork/join per call, not one
// each. Results are bitwise identical for any thread count. Where the chunks run:
//   options.pool set   on that executor — gradavg::thread_pool, gradavg::openmp_executor
//                      (gradavg/openmp.hpp, with -fopenmp), or your own pool behind the
//                      executor interface: no thread is created per call;
//   else               threads started for the call and joined before it returns (tens of
//                      microseconds: pass a pool when calling every step).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace gradavg {

/// A non-owning reference to a callable taking a task index. Cheap to copy; the callable must
/// outlive every call.
class task_ref {
 public:
  template <class F>
  explicit task_ref(F& f) noexcept
      : object_(static_cast<void*>(&f)), call_([](void* o, std::size_t i) { (*static_cast<F*>(o))(i); }) {}
  void operator()(std::size_t i) const { call_(object_, i); }

 private:
  void* object_;
  void (*call_)(void*, std::size_t);
};

/// Where parallel work runs. parallel_for(n, task) calls task(i) exactly once for each i in
/// [0, n), possibly concurrently, and returns after every call has returned. gradavg's tasks do
/// not throw. concurrency() is how many tasks can run at once.
class executor {
 public:
  virtual ~executor() = default;
  [[nodiscard]] virtual std::size_t concurrency() const noexcept = 0;
  virtual void parallel_for(std::size_t n, task_ref task) = 0;
};

/// A fixed set of threads that lives as long as the pool: workers - 1 threads plus the caller
/// of parallel_for, which takes part. parallel_for calls from several threads are serialised.
class thread_pool final : public executor {
 public:
  /// threads: total concurrency, the caller included; 0 means std::thread::hardware_concurrency().
  explicit thread_pool(std::size_t threads = 0) {
    if (threads == 0) threads = std::max<std::size_t>(1, std::thread::hardware_concurrency());
    workers_.reserve(threads - 1);
    for (std::size_t t = 0; t + 1 < threads; ++t) workers_.emplace_back([this] { work(); });
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool() override {
    {
      std::lock_guard lock(state_mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  [[nodiscard]] std::size_t concurrency() const noexcept override { return workers_.size() + 1; }

  void parallel_for(std::size_t n, task_ref task) override {
    if (n == 0) return;
    std::lock_guard call(call_mutex_);
    {
      std::lock_guard lock(state_mutex_);
      task_ = &task;
      tasks_ = n;
      next_.store(0, std::memory_order_relaxed);
      busy_ = workers_.size();
      ++generation_;
    }
    wake_.notify_all();
    run_tasks(task, n);
    std::unique_lock lock(state_mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
    task_ = nullptr;
  }

 private:
  void run_tasks(const task_ref& task, std::size_t n) {
    for (std::size_t i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) task(i);
  }

  void work() {
    std::size_t seen = 0;
    for (;;) {
      const task_ref* task;
      std::size_t n;
      {
        std::unique_lock lock(state_mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        task = task_;
        n = tasks_;
      }
      run_tasks(*task, n);
      {
        std::lock_guard lock(state_mutex_);
        if (--busy_ == 0) done_.notify_one();
      }
    }
  }

  std::mutex call_mutex_;   // one parallel_for at a time
  std::mutex state_mutex_;  // guards everything below but next_
  std::condition_variable wake_, done_;
  const task_ref* task_ = nullptr;
  std::size_t tasks_ = 0;
  std::size_t busy_ = 0;
  std::size_t generation_ = 0;
  bool stopping_ = false;
  std::atomic<std::size_t> next_{0};
  std::vector<std::thread> workers_;
};

}  // namespace gradavg
