// gradavg: the options every averaging call takes, in three groups: what is computed, how it
// runs, how it is checked. Plain aggregates: new members get defaults that keep the behaviour
// code written before them relies on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "errors.hpp"
#include "statistics.hpp"

namespace gradavg {

class executor;
class timeline;
class logger;

/// options.run.threads left unset: the pool's concurrency when options.run.pool is given, else 1.
inline constexpr std::size_t default_threads = std::numeric_limits<std::size_t>::max();

/// How a call stores its outputs (means, squares; across processes also the unpacked buckets).
/// The results are identical whichever is chosen.
enum class store_policy : std::uint8_t {
  /// streaming when the call moves at least streaming_threshold_bytes (its outputs then outgrow
  /// the caches before anyone reads them), regular below.
  automatic,
  /// Ordinary stores: the outputs stay in the caches for the code that reads them next.
  regular,
  /// Non-temporal (streaming) stores where the target has them (x86-64; ordinary stores
  /// elsewhere): they bypass the caches and skip reading each output line before writing it.
  streaming,
};

/// The bytes store_policy::automatic switches to streaming stores at: what one call reads and
/// writes (every gradient once, every output once). Larger than the last-level cache of the CPUs
/// measured, so that the outputs of an automatic call that stores normally can still be in cache.
inline constexpr std::size_t streaming_threshold_bytes = std::size_t{128} << 20;

/// How thoroughly average_gradients_into checks outputs for overlap with inputs and each other.
enum class alias_check : std::uint8_t {
  /// Partial: each variable's outputs against that variable's own gradients and other output
  /// only, O(V*T). Misses overlaps between variables (say means[0] written over tower 0's
  /// gradient 1): kept for callers who rule those out another way.
  same_variable,
  /// Every output against every gradient and every other output (the default): the byte ranges
  /// of all N = V*(T+2) buffers sorted by address and swept, O(N log N) (a plan keeps the
  /// proof for the calls over the same buffers).
  all,
  /// No check: the caller guarantees the aliasing rules of average_gradients_into.
  none,
};

/// The type float gradients are summed in (16-bit gradients are always summed in float, double
/// gradients in double).
enum class accumulation : std::uint8_t {
  native,            ///< float in float (sum in tower order)
  /// float in double, rounded once to the output. With u the accumulator's unit roundoff (2^-53;
  /// 2^-24 for native): every mean within half an ulp + (2T + 4) u |scale| sum w_k |g_k| / sum w_k
  /// of the exact scale sum w_k g_k / sum w_k (T u times the mean |g_k| without weights and scale).
  double_precision,
};

/// What happens when an input element is NaN or +-Inf (see average.hpp, "Non-finite inputs").
enum class nonfinite_policy : std::uint8_t {
  ignore,  ///< no detection (the default): results are what IEEE arithmetic gives, nothing reported
  report,  ///< detected and reported per variable and in total; results as with ignore
  zero,    ///< detected and reported; every output element of that variable is written as +0
};

/// How the sums of a call across processes travel between the ranks (options.exchange.compression
/// of gradavg::mpi). Every lossy format keeps the ranks bitwise equal and runs repeatable: each
/// rank's contribution is encoded, every owner decodes the contributions to its slice and sums
/// them in rank order, the sum is encoded once more, and every rank, the owner too, decodes that
/// encoding into its outputs. Non-finite inputs are detected before any encoding
/// (options.compute.on_nonfinite); the statistics describe the means returned.
enum class compression : std::uint8_t {
  /// The accumulator's own bits (the default): the same results as one process where the towers
  /// add in the same order.
  none,
  /// bfloat16, rounded to nearest even (NaN stays NaN, infinities stay infinite; a magnitude above
  /// bfloat16's largest finite value, 3.39e38, becomes infinite): half the bytes of float, 8
  /// significant bits, float's range. Double sums are rounded to float first.
  bfloat16,
  /// IEEE half, rounded to nearest even, in blocks of 256 values with a power-of-two scale each:
  /// the block's largest finite magnitude is brought into [2^14, 2^15), so no finite value
  /// overflows and small gradients keep 11 significant bits down to 2^-24 of that scale below the
  /// block's largest (smaller ones round towards 0). 516 bytes per 256 values: 50.4 % of float's.
  float16,
  /// Blocks of 256 values as 8-bit integers in [-127, 127] times a float scale each (the block's
  /// largest magnitude / 127), rounded stochastically (up with the probability of the fraction:
  /// unbiased) from a hash of options.exchange.seed, the rank and the element, so the same seed
  /// gives the same bits. Each value within 1/127 of its block's largest magnitude; a block
  /// holding an infinity or NaN decodes as NaN (never hidden). 260 bytes per 256 values: 25.4 % of
  /// float's. Meant with error feedback (options.exchange.residual).
  int8,
};

/// Error feedback kept by an object that averages step after step across processes
/// (options.exchange.feedback): the libtorch module helpers (mpi_data_parallel, c10d_data_parallel)
/// keep a residual per bucket (options.exchange.residual's meaning) with kept. The direct calls
/// take options.exchange.residual instead (kept there: option_error).
enum class error_feedback : std::uint8_t {
  off,   ///< none (the default)
  kept,  ///< the residuals held by the averaging object, reset by its reset_feedback()
};

/// Which means each rank receives from a call across processes (options.exchange.output of
/// gradavg::mpi).
enum class output_mode : std::uint8_t {
  /// Every rank receives every mean (the default): the exchange of an allreduce.
  replicated,
  /// Each rank receives the means (and squares) of its own shard of the flat range only
  /// (shard_of: contiguous, in rank order; summary::shard), and leaves its other output elements
  /// untouched: the exchange of a reduce-scatter, half of replicated's bytes on the wire, for an
  /// optimizer that updates its shard (ZeRO-1/2) and then gathers the parameters
  /// (gradavg::mpi::gather_shards). The shard's means are the ones replicated gives with
  /// compression::none; with a lossy format they are the sums of the decoded contributions,
  /// never encoded again (one rounding fewer). Statistics (options.compute.statistics) need every
  /// mean and are refused (option_error); non-finite detection covers every rank's elements (a
  /// variable is flagged on every rank).
  sharded,
};

/// How row-sparse gradients (sparse.hpp) travel between ranks (options.exchange.sparse of
/// gradavg::mpi and gradavg::c10d). Every choice gives the same bits.
enum class sparse_wire : std::uint8_t {
  /// rows where they move fewer bytes: where every rank's listed rows, sent to every other rank,
  /// come to less than sparse_rows_share of the dense exchange's bytes; dense otherwise.
  automatic,
  /// every rank's listed rows (indices and sums) to every rank: (P - 1) times each rank's rows.
  rows,
  /// every rank's listed indices to every rank; the sums as a dense tensor, each slice's
  /// contributions to its owner and the owner's sum back to every rank: 2 (P - 1) / P of it.
  dense,
};

/// sparse_wire::automatic's crossover: rows travel where they are fewer than this share of the
/// dense exchange's bytes. Measured (gradavg_bench_mpi_sparse, 2 ranks on an emulated 1 Gbit link,
/// docs/sparse.md): with 68 % of the rows listed on each rank, rows took 1.05 times the dense
/// call's time over densified gradients and the dense wire 1.18 times (both pay for the local
/// sums and the merge, which the dense call overlaps with the wire).
inline constexpr double sparse_rows_share = 0.9;

/// Rank `rank`'s shard of the flat elements [range.begin, range.end) among `ranks` ranks
/// (output_mode::sharded): [begin + n r / ranks, begin + n (r + 1) / ranks), n = end - begin;
/// contiguous, in rank order, sizes differing by at most one. range: the call's range clamped to
/// the averaged elements (summary::shard reports the result for the calling rank).
constexpr element_range shard_of(element_range range, int ranks, int rank) noexcept {
  const std::size_t n = range.end > range.begin ? range.end - range.begin : 0;
  const auto p = static_cast<std::size_t>(ranks > 0 ? ranks : 1);
  const auto r = static_cast<std::size_t>(rank < 0 ? 0 : rank > ranks ? ranks : rank);
  // n r may not fit 64 bits for a huge n: split it (n = q p + m).
  auto first = [&](std::size_t k) { return range.begin + n / p * k + n % p * k / p; };
  return {first(r), r + 1 <= p ? first(r + 1) : first(p)};
}


/// What a call computes besides the means, and in which arithmetic.
struct compute_options {
  /// Type in which float gradients are summed.
  accumulation accumulate = accumulation::native;

  /// Tower weights: mean = sum_k w_k g_k / sum_k w_k (and the mean of squares likewise). Empty:
  /// every tower weighs 1. Otherwise one per tower, each finite and >= 0, with a positive finite
  /// sum (weight_error). Not owned; read during the call only.
  std::span<const double> weights = {};

  /// Factor that meets every input before any sum, folded into each tower's weight:
  /// mean = sum (w_k scale) g_k / sum w_k, square = sum (w_k scale) g_k (scale g_k) / sum w_k.
  /// Unscales a loss scale: a sum overflows only where the scaled, weighted sum leaves the
  /// accumulator type, never by the loss scale. Finite (option_error).
  double scale = 1.0;

  /// Detection of NaN and +-Inf inputs (summary::nonfinite_variables).
  nonfinite_policy on_nonfinite = nonfinite_policy::ignore;

  /// Fused statistics: summary's sum_mean_squared and sum_mean_of_squares (and so the global
  /// norm and the noise estimate), accumulated in double, bitwise the same for any thread count.
  /// Off: those sums are NaN and summary's derived statistics throw statistics_error.
  bool statistics = false;

  /// Per-variable results: empty, or exactly one per variable (option_error), written for every
  /// averaged variable (statistics when statistics is set, nonfinite when detection is on).
  /// Not owned.
  std::span<variable_statistics> per_variable = {};

  /// Only these elements of the flat range of all variables are averaged and written (partial
  /// call: a bucket); other output elements are left untouched. Validation covers every variable.
  /// For the calls that write into outputs the caller owns; the allocating calls return whole
  /// variables and reject any other range (option_error).
  element_range range = {};
};

/// How a call runs: threads and stores. The results are bitwise the same whatever is chosen.
struct run_options {
  /// Threads one call may use. Left at default_threads: all of pool's (pool->concurrency()) when
  /// a pool is given, else 1 — the calling thread only: training code often calls this while its
  /// other cores are busy, so starting threads is the caller's decision. 1: the calling thread
  /// only, even with a pool. 0: all of pool's, else std::thread::hardware_concurrency().
  /// See executor.hpp.
  std::size_t threads = default_threads;

  /// How outputs are stored (store_policy): by default streaming for calls that move at least
  /// streaming_threshold_bytes, ordinary stores below.
  store_policy stores = store_policy::automatic;

  /// Where threaded work runs; not owned. Null: threads started for the call (see executor.hpp).
  executor* pool = nullptr;

  /// Where the call records its events (timeline.hpp); not owned. Null (the default): nothing
  /// is recorded, and the call pays one test of the pointer.
  gradavg::timeline* timeline = nullptr;

  /// Where the call writes what it chose (log.hpp); not owned. Null (the default): nothing.
  gradavg::logger* log = nullptr;
};

/// How average_gradients_into checks its outputs before writing (the allocating calls' outputs
/// are new and overlap nothing). A plan (plan.hpp) keeps what the checks proved for the next
/// calls over the same buffers.
struct check_options {
  /// Overlap checks (alias_check).
  alias_check aliasing = alias_check::all;
};

/// The options of every averaging call, by concern. Designated initialisers name the groups in
/// this order and each group's members in theirs:
///   gradavg::options{.compute = {.weights = w, .statistics = true}, .run = {.threads = 4}}
struct options {
  compute_options compute = {};
  run_options run = {};
  check_options check = {};
};

/// The options of a call across processes (gradavg::mpi::options, gradavg::c10d::options):
/// gradavg::options' groups, with the same meaning, plus how the buckets move between ranks
/// (Exchange: the transport's exchange_options). Every rank passes the same values, except
/// compute.weights (one per local tower), run and check (each rank's own) and exchange.work.
template <class Exchange>
struct process_options {
  compute_options compute = {};
  run_options run = {};
  check_options check = {};
  Exchange exchange = {};

  /// The groups a one-process call takes.
  [[nodiscard]] options local() const noexcept { return {compute, run, check}; }
};

/// Tag for the allocating calls that also return the means over towers of the squared gradients
/// (the seed's include_square=True): average_gradients(tower_grads, gradavg::include_square).
/// Not constructible from {}, so that average_gradients(tower_grads, {}) means the options.
struct include_square_t {
  struct make_tag {};
  explicit constexpr include_square_t(make_tag) noexcept {}
};
inline constexpr include_square_t include_square{include_square_t::make_tag{}};

namespace shared_detail {

/// Throws option_error unless `value` is one of its enumeration's named values, which run from 0
/// to `last`: an integer cast to an option's enumeration outside them is refused, never read as
/// another value. `what` names the option ("options.compute.on_nonfinite").
template <class E>
void require_named(E value, E last, const char* what) {
  using U = std::underlying_type_t<E>;
  static_assert(std::is_unsigned_v<U>, "gradavg: the options' enumerations count from 0");
  if (static_cast<U>(value) > static_cast<U>(last))
    throw option_error(std::string("gradavg: ") + what + " holds " +
                       std::to_string(static_cast<unsigned long long>(static_cast<U>(value))) +
                       ", which is none of its enumeration's values (0 to " +
                       std::to_string(static_cast<unsigned long long>(static_cast<U>(last))) + ")");
}

/// require_named for every enumeration of the three groups.
inline void require_named_options(const options& opts) {
  require_named(opts.compute.accumulate, accumulation::double_precision, "options.compute.accumulate");
  require_named(opts.compute.on_nonfinite, nonfinite_policy::zero, "options.compute.on_nonfinite");
  require_named(opts.run.stores, store_policy::streaming, "options.run.stores");
  require_named(opts.check.aliasing, alias_check::none, "options.check.aliasing");
}

}  // namespace shared_detail

}  // namespace gradavg
