// gradavg internals: running chunks of work on the executor that options choose.
#pragma once

#include <atomic>
#include <cstddef>
#include <new>
#include <stdexcept>
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

/// The thread count that options ask for (see options::threads).
inline std::size_t requested_threads(const options& opts) noexcept {
  if (opts.threads != default_threads && opts.threads != 0) return opts.threads;
  if (opts.pool != nullptr) return std::max<std::size_t>(1, opts.pool->concurrency());
  return opts.threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : 1;
}

/// How many chunks a call over total elements, each moving bytes_per_element, splits into: at
/// most the thread count that options ask for, and no chunk under min_chunk_bytes.
inline std::size_t chunk_count(std::size_t total, std::size_t bytes_per_element, const options& opts) noexcept {
  const std::size_t elements_per_chunk =
      std::max<std::size_t>(1, min_chunk_bytes / std::max<std::size_t>(1, bytes_per_element));
  const std::size_t worth = std::max<std::size_t>(1, total / elements_per_chunk);
  return std::max<std::size_t>(1, std::min(requested_threads(opts), worth));
}

/// Calls chunk(c) once for each c in [0, chunks), concurrently where options allow, and returns
/// when all have returned. Every chunk runs in the caller's floating-point environment, whichever
/// thread runs it. If chunks throw (user code: a tensor adapter, an executor), the
/// chunks not yet started are skipped and the first exception is rethrown here once every
/// started chunk has returned. If threads cannot be started, the caller runs their chunks itself.
/// Allocates only when it starts threads (no pool).
template <class Chunk>
void run_chunks(std::size_t chunks, Chunk& chunk, const options& opts) {
  if (chunks <= 1) {
    if (chunks == 1) chunk(0);
    return;
  }
  const executor_detail::fp_environment caller_env;
  executor_detail::first_exception failure;
  std::atomic<std::size_t> finished{0};
  auto guarded = [&](std::size_t c) noexcept {
    if (failure.failed()) return;
    try {
      // On every thread, the caller's too: an executor may change its environment (TBB's arenas
      // apply the settings captured when the arena was made).
      const auto env = caller_env.apply();
      chunk(c);
      finished.fetch_add(1, std::memory_order_relaxed);
    } catch (...) {
      failure.capture();
    }
  };

  if (opts.pool != nullptr) {
    opts.pool->parallel_for(chunks, task_ref(guarded));  // its own exceptions propagate
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
  if (finished.load(std::memory_order_relaxed) != chunks)
    throw std::logic_error("gradavg: executor::parallel_for returned without running every task");
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
