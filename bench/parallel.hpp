// Threads in the benchmarks: the thread counts the suite runs at, and a persistent pool that
// splits a flat element range into contiguous chunks, one per thread.
//
// The pool is gradavg::thread_pool used as a plain executor (gradavg/executor.hpp needs only the
// standard library), so the peers and the limits pay the same fork/join as gradavg itself.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

#include <gradavg/executor.hpp>

namespace gradavg_bench {

/// Elements per split unit: chunk boundaries are multiples of this (256 bytes of float), so
/// that two threads never write the same cache line and each chunk starts aligned.
inline constexpr std::size_t chunk_granularity = 64;

/// The machine's core count as the standard library reports it (at least 1).
inline int all_cores() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// The thread counts every benchmark runs at: 1 and all cores (just 1 on a one-core machine).
inline std::vector<int> thread_counts() {
  const int n = all_cores();
  return n > 1 ? std::vector<int>{1, n} : std::vector<int>{1};
}

/// Start of chunk c when [0, elements) is split into `chunks` contiguous pieces whose
/// boundaries are multiples of chunk_granularity (the last piece takes the remainder).
inline std::size_t chunk_bound(std::size_t elements, std::size_t chunks, std::size_t c) {
  if (c >= chunks) return elements;
  const std::size_t units = (elements + chunk_granularity - 1) / chunk_granularity;
  return std::min(elements, units * c / chunks * chunk_granularity);
}

/// A fixed set of `threads` threads (the caller included) that lives as long as this object,
/// created once per benchmark setup, outside the timed loop.
class chunk_pool {
 public:
  explicit chunk_pool(int threads)
      : threads_(static_cast<std::size_t>(std::max(1, threads))), pool_(threads_) {}

  [[nodiscard]] std::size_t threads() const noexcept { return threads_; }

  /// Calls f(c, begin, end) for each of threads() contiguous chunks [begin, end) of
  /// [0, elements), concurrently, and returns when all have returned. One thread: f runs on the
  /// caller, with no pool round trip.
  template <class F>
  void for_chunks(std::size_t elements, const F& f) {
    if (threads_ == 1) {
      f(std::size_t{0}, std::size_t{0}, elements);
      return;
    }
    auto task = [&](std::size_t c) {
      f(c, chunk_bound(elements, threads_, c), chunk_bound(elements, threads_, c + 1));
    };
    pool_.parallel_for(threads_, gradavg::task_ref(task));
  }

 private:
  std::size_t threads_;
  gradavg::thread_pool pool_;
};

}  // namespace gradavg_bench
