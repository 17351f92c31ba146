// gradavg internals: running chunks of work on the executor that options choose.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "isa.hpp"
#include "../executor.hpp"
#include "../options.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// Fewest bytes (read and written) worth a chunk of their own. Handing a chunk to another
/// thread and joining it costs about 5-25 us (more on virtual machines); a chunk of 1 MiB takes
/// about that long even at cache bandwidth, so smaller work stays on fewer threads.
inline constexpr std::size_t min_chunk_bytes = std::size_t{1} << 20;

/// Most chunks one call splits into, whatever the thread count (run_chunks tracks each).
inline constexpr std::size_t max_chunks = 256;

/// The thread count that options ask for (see options.run.threads).
inline std::size_t requested_threads(const options& opts) noexcept {
  if (opts.run.threads != default_threads && opts.run.threads != 0) return opts.run.threads;
  if (opts.run.pool != nullptr) return std::max<std::size_t>(1, opts.run.pool->concurrency());
  return opts.run.threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : 1;
}

/// Whether a call that reads and writes `bytes` in all stores its outputs non-temporally
/// (options.run.stores).
inline bool streams(const options& opts, std::size_t bytes) noexcept {
  return opts.run.stores == store_policy::streaming ||
         (opts.run.stores == store_policy::automatic && bytes >= streaming_threshold_bytes);
}

/// How many chunks a call over total elements, each moving bytes_per_element, splits into: at
/// most the thread count that options ask for and max_chunks, and no chunk under min_chunk_bytes.
inline std::size_t chunk_count(std::size_t total, std::size_t bytes_per_element, const options& opts) noexcept {
  const std::size_t elements_per_chunk =
      std::max<std::size_t>(1, min_chunk_bytes / std::max<std::size_t>(1, bytes_per_element));
  const std::size_t worth = std::max<std::size_t>(1, total / elements_per_chunk);
  return std::max<std::size_t>(1, std::min({requested_threads(opts), worth, max_chunks}));
}

/// Which of up to max_chunks tasks have started: each task's first start is let through, a
/// second start of the same task or an index out of range is recorded as a misbehaving executor.
class task_ledger {
 public:
  explicit task_ledger(std::size_t tasks) noexcept : tasks_(tasks) {}
  /// Marks task c as started; false (and nothing to run) if it is out of range or started before.
  bool start(std::size_t c) noexcept {
    if (c >= tasks_) {
      out_of_range_.store(true, std::memory_order_relaxed);
      return false;
    }
    const std::uint64_t bit = std::uint64_t{1} << (c % 64);
    if ((words_[c / 64].fetch_or(bit, std::memory_order_relaxed) & bit) != 0) {
      started_twice_.store(true, std::memory_order_relaxed);
      return false;
    }
    return true;
  }
  /// After parallel_for returned: std::logic_error naming the first misbehaviour, if any.
  void check() const {
    if (out_of_range_.load(std::memory_order_relaxed))
      throw std::logic_error("gradavg: executor::parallel_for(" + std::to_string(tasks_) +
                             ", task) called task with an index out of range");
    if (started_twice_.load(std::memory_order_relaxed))
      throw std::logic_error("gradavg: executor::parallel_for(" + std::to_string(tasks_) +
                             ", task) called a task more than once (each must run exactly once)");
    for (std::size_t c = 0; c < tasks_; ++c)
      if ((words_[c / 64].load(std::memory_order_relaxed) & (std::uint64_t{1} << (c % 64))) == 0)
        throw std::logic_error("gradavg: executor::parallel_for(" + std::to_string(tasks_) +
                               ", task) returned without running every task (task " + std::to_string(c) +
                               " never ran)");
  }

 private:
  std::size_t tasks_;
  std::atomic<std::uint64_t> words_[max_chunks / 64] = {};
  std::atomic<bool> out_of_range_{false}, started_twice_{false};
};

/// Calls chunk(c) once for each c in [0, chunks) (chunks <= max_chunks), concurrently where
/// options allow, and returns when all have returned. Every chunk runs in the caller's
/// floating-point environment, whichever thread runs it. If chunks throw (user code: a tensor
/// adapter, an executor), the chunks not yet started are skipped and the first exception is
/// rethrown here once every started chunk has returned. An executor that breaks its contract
/// (a task never run, run twice, or an index out of range) is reported as std::logic_error; a
/// second start of a task does not run the chunk again. If threads cannot be started, the caller
/// runs their chunks itself. Allocates only when it starts threads (no pool).
template <class Chunk>
void run_chunks(std::size_t chunks, Chunk& chunk, const options& opts) {
  if (chunks <= 1) {
    if (chunks == 1) chunk(0);
    return;
  }
  if (chunks > max_chunks) throw std::logic_error("gradavg: run_chunks over more than max_chunks chunks");
  const shared_detail::fp_environment caller_env;
  shared_detail::first_exception failure;
  task_ledger ledger(chunks);
  auto guarded = [&](std::size_t c) noexcept {
    if (!ledger.start(c) || failure.failed()) return;
    try {
      // On every thread, the caller's too: an executor may change its environment (TBB's arenas
      // apply the settings captured when the arena was made).
      const auto env = caller_env.apply();
      chunk(c);
    } catch (...) {
      failure.capture();
    }
  };

  if (opts.run.pool != nullptr) {
    opts.run.pool->parallel_for(chunks, task_ref(guarded));  // its own exceptions propagate
  } else {
    std::vector<std::jthread> started;
    std::size_t first_unstarted = chunks;
    try {
      started.reserve(chunks - 1);
      for (std::size_t c = 1; c < chunks; ++c) started.emplace_back([&guarded, c] { guarded(c); });
    } catch (const std::system_error&) {
      first_unstarted = started.size() + 1;
    } catch (const std::bad_alloc&) {
      first_unstarted = started.size() + 1;
    }
    guarded(0);
    for (std::size_t c = first_unstarted; c < chunks; ++c) guarded(c);
    for (auto& t : started) t.join();
  }
  failure.rethrow_if_any();
  ledger.check();
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
