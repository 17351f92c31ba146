// gradavg: running the averaging on several threads.
//
// options.run.threads says how many threads a call may use; options.run.pool where they run. The
// work — all variables' elements as one flat range — is split into up to that many contiguous
// chunks, so hundreds of small variables cost one fork/join per call, not one each. Results are
// bitwise identical for any thread count and executor. Where the chunks run:
//   options.run.pool set   on that executor — gradavg::thread_pool, gradavg::openmp_executor
//                      (gradavg/openmp.hpp), gradavg::eigen_thread_pool_executor
//                      (gradavg/eigen_thread_pool.hpp), gradavg::tbb_executor (gradavg/tbb.hpp),
//                      or your own pool behind the executor interface: no thread is created and
//                      nothing is allocated per call;
//   else               threads started for the call and joined before it returns (tens of
//                      microseconds and an allocation: pass a pool when calling every step).
// Every chunk run on another thread runs in the caller's floating-point environment (rounding
// mode; FTZ/DAZ on x86, FZ on AArch64), so the thread that runs a chunk never changes a result.
// An exception from user code inside a chunk (a tensor adapter's data(), ...) reaches the caller
// after every chunk has finished; outputs may then be partly written.
#pragma once

#include <algorithm>
#include <atomic>
#include <cfenv>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradavg {

/// A non-owning reference to a callable taking a task index. Cheap to copy; the callable must
/// outlive every call.
class task_ref {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cv_t<F>, task_ref>)  // copies stay copies
  explicit task_ref(F& f) noexcept
      : object_(static_cast<void*>(&f)), call_([](void* o, std::size_t i) { (*static_cast<F*>(o))(i); }) {}
  void operator()(std::size_t i) const { call_(object_, i); }

 private:
  void* object_;
  void (*call_)(void*, std::size_t);
};

/// Where parallel work runs. The contract of parallel_for(n, task):
///   - calls task(i) at most once for each i in [0, n), possibly concurrently, and exactly once
///     for each when no task throws;
///   - returns, normally or by an exception, only after every call of task it started has
///     returned — even when one of them throws;
///   - a task may throw: the executor then may skip tasks not yet started and rethrows the first
///     exception on the caller (tasks that gradavg passes never throw: they catch their own);
///   - a task may call parallel_for on the same executor (nested use) without deadlock.
/// concurrency() is how many tasks can run at once (at least 1).
class executor {
 public:
  virtual ~executor() = default;
  [[nodiscard]] virtual std::size_t concurrency() const noexcept = 0;
  virtual void parallel_for(std::size_t n, task_ref task) = 0;
};

namespace shared_detail {

/// Keeps the first exception thrown by any of several threads. capture() from a catch handler;
/// rethrow_if_any() on the caller once every thread that could capture has finished.
class first_exception {
 public:
  void capture() noexcept {
    if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
  }
  [[nodiscard]] bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  void rethrow_if_any() {
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
};

/// Runs task(i) for every i in [0, n) on the calling thread; stops at the first exception.
inline void run_inline(std::size_t n, const task_ref& task) {
  for (std::size_t i = 0; i < n; ++i) task(i);
}

/// The floating-point environment of the thread that made it (std::fenv_t: the rounding mode and,
/// with glibc, x86's MXCSR with FTZ/DAZ and AArch64's FPCR with FZ). apply() makes it current on
/// the calling thread until the returned guard is destroyed.
class fp_environment {
 public:
  fp_environment() noexcept { std::fegetenv(&env_); }

  class scope {
   public:
    explicit scope(const std::fenv_t& env) noexcept {
      std::fegetenv(&saved_);
      std::fesetenv(&env);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() { std::fesetenv(&saved_); }

   private:
    std::fenv_t saved_;
  };
  [[nodiscard]] scope apply() const noexcept { return scope(env_); }

 private:
  std::fenv_t env_;
};

}  // namespace shared_detail

/// A fixed set of threads that lives as long as the pool: threads - 1 workers plus the caller of
/// parallel_for, which takes part. Concurrent parallel_for calls from unrelated threads are
/// served one after the other. A call from inside one of this pool's tasks (nested use, on a
/// worker or on the thread inside parallel_for) runs its tasks inline on that thread. Not
/// detected: a cycle through two pools (a task of pool A waiting on pool B whose task waits on
/// A) — use one pool, or an executor that steals work (gradavg/tbb.hpp).
class thread_pool final : public executor {
 public:
  /// threads: total concurrency, the caller included; 0 means std::thread::hardware_concurrency().
  /// Throws std::system_error (or std::bad_alloc) if a thread cannot start; the threads already
  /// started are stopped and joined first.
  explicit thread_pool(std::size_t threads = 0) {
    if (threads == 0) threads = std::max<std::size_t>(1, std::thread::hardware_concurrency());
    workers_.reserve(threads - 1);
    try {
      for (std::size_t t = 0; t + 1 < threads; ++t) workers_.emplace_back([this] { work(); });
    } catch (...) {
      stop_and_join();
      throw;
    }
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool() override { stop_and_join(); }

  [[nodiscard]] std::size_t concurrency() const noexcept override { return workers_.size() + 1; }

  /// Runs the tasks on the pool and the calling thread. If tasks throw, the tasks not yet started
  /// are skipped and the first exception is rethrown once every started task has returned.
  void parallel_for(std::size_t n, task_ref task) override {
    if (n == 0) return;
    if (n == 1 || workers_.empty() || serving_this_thread()) {
      shared_detail::run_inline(n, task);
      return;
    }
    std::lock_guard call(call_mutex_);
    inside_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    shared_detail::first_exception error;
    {
      std::lock_guard lock(state_mutex_);
      task_ = &task;
      tasks_ = n;
      error_ = &error;
      next_.store(0, std::memory_order_relaxed);
      busy_ = workers_.size();
      ++generation_;
    }
    wake_.notify_all();
    run_tasks(task, n, error);
    {
      std::unique_lock lock(state_mutex_);
      done_.wait(lock, [this] { return busy_ == 0; });
      task_ = nullptr;
      error_ = nullptr;
    }
    inside_.store(std::thread::id(), std::memory_order_relaxed);
    error.rethrow_if_any();
  }

 private:
  /// Whether the calling thread is one of the workers, or the thread now inside parallel_for.
  [[nodiscard]] bool serving_this_thread() const noexcept {
    const std::thread::id self = std::this_thread::get_id();
    if (inside_.load(std::memory_order_relaxed) == self) return true;
    return std::any_of(workers_.begin(), workers_.end(), [self](const std::thread& w) { return w.get_id() == self; });
  }

  void run_tasks(const task_ref& task, std::size_t n, shared_detail::first_exception& error) noexcept {
    for (std::size_t i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) {
      try {
        task(i);
      } catch (...) {
        error.capture();
        next_.store(n);  // the tasks not yet started are skipped
      }
    }
  }

  void work() {
    std::size_t seen = 0;
    for (;;) {
      const task_ref* task;
      std::size_t n;
      shared_detail::first_exception* error;
      {
        std::unique_lock lock(state_mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        task = task_;
        n = tasks_;
        error = error_;
      }
      run_tasks(*task, n, *error);
      {
        std::lock_guard lock(state_mutex_);
        if (--busy_ == 0) done_.notify_one();
      }
    }
  }

  void stop_and_join() noexcept {
    {
      std::lock_guard lock(state_mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  std::mutex call_mutex_;   // one parallel_for at a time
  std::mutex state_mutex_;  // guards everything below but next_ and inside_
  std::condition_variable wake_, done_;
  const task_ref* task_ = nullptr;
  shared_detail::first_exception* error_ = nullptr;
  std::size_t tasks_ = 0;
  std::size_t busy_ = 0;
  std::size_t generation_ = 0;
  bool stopping_ = false;
  std::atomic<std::size_t> next_{0};
  std::atomic<std::thread::id> inside_{};  // the thread inside parallel_for, if any
  std::vector<std::thread> workers_;
};

}  // namespace gradavg
