// gradavg: the options every averaging call takes. A plain aggregate: new members get defaults
// that keep earlier behaviour, so code written against an older version keeps compiling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace gradavg {

class executor;
class layout_cache;

/// options::threads left unset: the pool's concurrency when options::pool is given, else 1.
inline constexpr std::size_t default_threads = std::numeric_limits<std::size_t>::max();

/// How thoroughly average_gradients_into checks outputs for overlap with inputs and each other.
enum class alias_check : std::uint8_t {
  /// Partial: each variable's outputs against that variable's own gradients and other output
  /// only, O(V*T). Misses overlaps between variables (say means[0] written over tower 0's
  /// gradient 1): kept for callers who rule those out another way.
  same_variable,
  /// Every output against every gradient and every other output (the default): the byte ranges
  /// of all N = V*(T+2) buffers sorted by address and swept, O(N log N); O(N) when
  /// options.layout holds the same layout as the previous call.
  all,
  /// No check: the caller guarantees the aliasing rules of average_gradients_into.
  none,
};

struct options {
  /// Allocating API: also return the mean over towers of the squared gradients.
  /// average_gradients_into computes them exactly when a squares range is passed; setting this
  /// without passing one is an error there, so a request is never silently dropped.
  bool include_square = false;

  /// Overlap checks in average_gradients_into (outputs of the allocating API never overlap).
  alias_check aliasing = alias_check::all;

  /// Caller-owned scratch and memory of the last proved layout for average_gradients_into
  /// (layout_cache.hpp); not owned. Null: the check of up to 256 buffers uses the stack, larger
  /// ones allocate their scratch for the call.
  layout_cache* layout = nullptr;

  /// Threads one call may use. Left at default_threads: all of pool's (pool->concurrency()) when
  /// a pool is given, else 1 — the calling thread only: training code often calls this while its
  /// other cores are busy, so starting threads is the caller's decision. 1: the calling thread
  /// only, even with a pool. 0: all of pool's, else std::thread::hardware_concurrency().
  /// See executor.hpp.
  std::size_t threads = default_threads;

  /// Write outputs with non-temporal (streaming) stores where the target has them: they bypass
  /// the caches, which pays when the outputs are larger than the last-level cache and are not
  /// read again at once. Results are identical either way.
  bool streaming_stores = false;

  /// Where threaded work runs; not owned. Null: threads started for the call (see executor.hpp).
  executor* pool = nullptr;
};

}  // namespace gradavg
