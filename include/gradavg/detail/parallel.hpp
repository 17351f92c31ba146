// gradavg internals: running chunks of work on the executor that options choose.
#pragma once

#include <cstddef>
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

/// How many chunks a call over total elements, each moving bytes_per_element, splits into: at
/// most the thread count that options ask for, and no chunk under min_chunk_bytes.
inline std::size_t chunk_count(std::size_t total, std::size_t bytes_per_element, const options& opts) noexcept {
  std::size_t threads = opts.threads;
  if (threads == 0)
    threads = opts.pool != nullptr ? opts.pool->concurrency() : std::max(1u, std::thread::hardware_concurrency());
  const std::size_t elements_per_chunk =
      std::max<std::size_t>(1, min_chunk_bytes / std::max<std::size_t>(1, bytes_per_element));
  const std::size_t worth = std::max<std::size_t>(1, total / elements_per_chunk);
  return std::max<std::size_t>(1, std::min(threads, worth));
}

/// Calls chunk(c) once for each c in [0, chunks), concurrently where options allow, and returns
/// when all have returned. Never throws once a chunk has started: if threads cannot be started,
/// the caller runs their chunks itself.
template <class Chunk>
void run_chunks(std::size_t chunks, Chunk& chunk, const options& opts) {
  if (chunks <= 1) {
    if (chunks == 1) chunk(0);
    return;
  }
  if (opts.pool != nullptr) {
    opts.pool->parallel_for(chunks, task_ref(chunk));
    return;
  }
  std::vector<std::jthread> started;
  std::size_t first_unstarted = chunks;
  try {
    started.reserve(chunks - 1);
    for (std::size_t c = 1; c < chunks; ++c) {
      started.emplace_back([&chunk, c] { chunk(c); });
    }
  } catch (const std::system_error&) {
    first_unstarted = started.size() + 1;
  } catch (const std::bad_alloc&) {
    first_unstarted = started.size() + 1;
  }
  chunk(0);
  for (std::size_t c = first_unstarted; c < chunks; ++c) chunk(c);
  // started threads join here
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
