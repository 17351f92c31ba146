// gradavg: an executor on OpenMP, for translation units compiled with OpenMP (-fopenmp;
// CMake: link OpenMP::OpenMP_CXX). Pass it as options.run.pool:
//
//   gradavg::openmp_executor omp;
//   gradavg::average_gradients_into(tower_grads, means, {.run = {.threads = 0, .pool = &omp}});
//
// It is opt-in rather than picked by the compile flag: a header-only library whose functions
// changed with -fopenmp would give one function two definitions in a program that mixes
// translation units built with and without it.
#pragma once

#if !defined(_OPENMP)
#error "gradavg/openmp.hpp needs OpenMP: compile with -fopenmp (CMake: link OpenMP::OpenMP_CXX)"
#endif

#include <omp.h>

#include <algorithm>
#include <cstddef>

#include "executor.hpp"

namespace gradavg {

/// Runs tasks in an OpenMP parallel loop (static schedule) on OpenMP's thread pool. An exception
/// from a task cannot leave an OpenMP region: the first one is kept, the tasks not yet started
/// are skipped, and it is rethrown after the region. Nested use (a task calling parallel_for)
/// opens a nested region, which OpenMP runs on one thread unless nesting is enabled.
class openmp_executor final : public executor {
 public:
  [[nodiscard]] std::size_t concurrency() const noexcept override {
    return static_cast<std::size_t>(std::max(1, omp_get_max_threads()));
  }
  void parallel_for(std::size_t n, task_ref task) override {
    const auto count = static_cast<long long>(n);
    const int threads = static_cast<int>(std::min<std::size_t>(n, concurrency()));
    shared_detail::first_exception error;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long long i = 0; i < count; ++i) {
      if (error.failed()) continue;
      try {
        task(static_cast<std::size_t>(i));
      } catch (...) {
        error.capture();
      }
    }
    error.rethrow_if_any();
  }
};

}  // namespace gradavg
