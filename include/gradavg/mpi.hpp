// gradavg::mpi: the same averaging across processes, through the MPI C API (target gradavg::mpi).
//
// Every rank passes its local towers (at least one; ranks may hold different numbers) and receives
// the mean over all towers of all ranks, and the mean of squares, weights, scale, non-finite
// detection and statistics with the same meaning as in one process (options.hpp);
// options.compute.weights holds the weights of the rank's own towers (one rank's may sum to 0; the
// sum over every rank must be positive). The call is collective over comm: every rank of comm calls
// it with the same options (a disagreement is an error, see below). comm: an intra-communicator of
// an initialised, not yet finalised MPI (else mpi_error on the rank that passes it). Every MPI call
// is made on the calling thread; worker threads (options.run.threads, options.run.pool) run only
// the kernel, so MPI needs MPI_THREAD_FUNNELED when they are used and the caller is MPI's main
// thread, MPI_THREAD_SERIALIZED when another thread calls. An MPI call that returns an error code
// (a communicator whose handler returns them) is an mpi_error.
//
// The call, in phases, so that no rank waits in a collective another rank has left:
//   - Local: each rank validates its towers and outputs exactly as the one-process call does
//     (recording every buffer's bytes in a table, as there, and each variable's presence and
//     shape for the agreement), then takes every pointer it will use from that table and sizes
//     its buffers. Every tensor_traits call (one read of each gradient; a second only where a
//     gradient is missing on some towers) and every allocation of the call happens here.
//   - Collective 1 (two integers, on the stack): the lowest rank whose local phase threw; that
//     rank rethrows its own exception (a gradavg::error, std::bad_alloc, or user code's own),
//     every other rank throws remote_error naming it. Nothing written anywhere. The second
//     integer says whether every rank's plan holds (calls with a plan, below): then collective 3
//     is not run again, nor collective 2 unless a rank passes weights or changed its scale
//     or range since the agreement.
//   - Collectives 2 and 3 (a fixed header per rank; then O(V) integers reduced with MPI_MAX: per
//     variable its presence state and fingerprints of its shape and, where the variable type is a
//     string or arithmetic type, of its identity; variables of other types are compared by shape
//     and presence only) decide identically on every rank which variables are skipped (absent on
//     every tower of every rank) and which error every rank throws: ranks that disagree on the
//     variable count, the options or the element types: tower_error / option_error naming them;
//     per variable, in order: a different variable at that position (variable_mismatch_error), a
//     gradient absent on some towers of some ranks only (missing_gradient_error naming ranks and
//     towers), a different shape between ranks (shape_error naming ranks and shapes). Nothing
//     written anywhere.
//   - The data path reads the tables only. Its one source of exceptions is user code running the
//     kernel (the executor): that rank sends zeros in its place from then on, every rank completes
//     the exchange, and collective 4 (one integer) tells each one; the rank rethrows its
//     exception, every other rank throws remote_error naming it. Outputs are then partly written
//     on every rank (as in one process after such an exception).
//
// Data path: the flat element range of all averaged variables (options.compute.range, as in one
// process) is cut into buckets of options.exchange.fusion_bytes. Each rank's kernel sums its towers
// straight into a bucket's fusion buffer (weighted sums, the squares' sums side by side,
// per-variable non-finite flags behind them); the buffer is then moved as raw bytes only (no MPI
// reduction): rank r owns a slice of every bucket, receives every rank's contribution to it, sums
// them in rank order, and sends the summed slice back to every rank: MPI_Ialltoallv and
// MPI_Iallgatherv on comm, or with options.exchange.method = point_to_point MPI_Isend and MPI_Irecv
// (tags 0x4741 and 0x4742: code that posts receives on comm with MPI_ANY_TAG while the call runs
// must then give gradavg a communicator of its own, MPI_Comm_dup). Bucket k's communication runs
// while the kernel fills bucket k+1. The division by the global weight sum (and the statistics) is
// applied while unpacking into the outputs. So the results are bitwise the same on every rank and
// from run to run for the same layout, whatever algorithms the MPI library picks. Against the
// one-process call over the same towers: where rank 0 holds any number of towers and every other
// rank one, the same additions run in the same order, so the means, the squares and the statistics
// (each variable's and the summary's: global_norm(), noise()) are that call's bits, with or
// without weights, scale, range and non-finite policy; with more towers on another rank the sums
// are grouped by rank (within about T/2 ulp of the mean, as in one process; the squares within the
// same bound). The statistics are summed in the one-process pass's order (ordered_statistics.hpp:
// segments of the flat range, eight lanes), so they are also the same for every fusion_bytes.
// With accumulation::double_precision, float gradients are summed in float within a rank, and
// across ranks and divided in double.
//
// Memory: a workspace (3 sets of fusion buffers, 2 * fusion_bytes each at most, and O(V + T + P)
// tables) held by options.exchange.work and reused, so that calls with the same layout allocate
// nothing; without one, each call allocates its own.
#pragma once

#include <concepts>

#include "average.hpp"
#include "detail/mpi/call.hpp"
#include "detail/processes/sparse.hpp"
#include "mpi_options.hpp"
#include "sparse.hpp"

namespace gradavg {
namespace mpi {
GRADAVG_BEGIN_ISA_NAMESPACE

/// Averages over the towers of every rank of comm into outputs each rank owns (see the file
/// comment and gradavg::average_gradients_into). Collective: every rank of comm calls it.
template <tower_gradients TG, class Means>
  requires gradavg::detail::output_range<Means&>
summary average_gradients_into(MPI_Comm comm, const TG& tower_grads, Means&& means, const mpi::options& opts = {}) {
  return detail::average_into(comm, tower_grads, means, gradavg::detail::no_squares, opts);
}

/// As above, and squares[i] receives the mean over all towers of all ranks of the squared gradient.
template <tower_gradients TG, class Means, class Squares>
  requires gradavg::detail::output_range<Means&> && gradavg::detail::output_range<Squares&>
summary average_gradients_into(MPI_Comm comm, const TG& tower_grads, Means&& means, Squares&& squares,
                               const mpi::options& opts = {}) {
  return detail::average_into(comm, tower_grads, means, &squares, opts);
}

/// As above, keeping in p this rank's proof (plan.hpp) and what every rank agreed: while every
/// rank's plan holds (its buffers are the proved ones, its options those it agreed with, on the
/// same communicator), a call runs collective 1, the data path and collective 4 only (and
/// collective 2 where a rank passes weights, whose sums change from step to step, or changed
/// its scale or range); the agreement on variables, presence and shapes is
/// not repeated. Every rank passes a plan, or
/// none does; the first call with a plan, and any call where one rank's plan does not hold, runs
/// every collective on every rank. (P is plan: calls without a plan never try this overload.)
template <std::same_as<plan> P, tower_gradients TG, class Means>
  requires gradavg::detail::output_range<Means&>
summary average_gradients_into(P& p, MPI_Comm comm, const TG& tower_grads, Means&& means,
                               const mpi::options& opts = {}) {
  return detail::average_into(comm, tower_grads, means, gradavg::detail::no_squares, opts, nullptr, &p);
}

/// As above, with squares.
template <std::same_as<plan> P, tower_gradients TG, class Means, class Squares>
  requires gradavg::detail::output_range<Means&> && gradavg::detail::output_range<Squares&>
summary average_gradients_into(P& p, MPI_Comm comm, const TG& tower_grads, Means&& means, Squares&& squares,
                               const mpi::options& opts = {}) {
  return detail::average_into(comm, tower_grads, means, &squares, opts, nullptr, &p);
}

/// The allocating form: gradavg::average_gradients over every rank's towers.
template <tower_gradients TG>
auto average_gradients(MPI_Comm comm, const TG& tower_grads, const mpi::options& opts = {}) {
  return gradavg::detail::average_allocating_across(tower_grads, false, opts.local(),
                                                     [&](auto& means, auto* squares, std::exception_ptr prior) {
                                                       return detail::average_into(comm, tower_grads, means, squares,
                                                                                   opts, prior);
                                                     });
}

/// As above, with the means of squares (gradavg::include_square).
template <tower_gradients TG>
auto average_gradients(MPI_Comm comm, const TG& tower_grads, include_square_t, const mpi::options& opts = {}) {
  return gradavg::detail::average_allocating_across(tower_grads, true, opts.local(),
                                                     [&](auto& means, auto* squares, std::exception_ptr prior) {
                                                       return detail::average_into(comm, tower_grads, means, squares,
                                                                                   opts, prior);
                                                     });
}

/// Row-sparse gradients (sparse.hpp) across the ranks of comm: every rank receives the mean over
/// the towers of every rank, dense or coalesced as its outputs say, the same bits on every rank
/// (detail/processes/sparse.hpp: each rank's sums, then every rank's listed rows to every rank or,
/// as options.exchange.sparse says, the sums as a dense tensor; added in rank order). Plain mean
/// and squares only (option_error otherwise). Collective, with this file's error contract.
template <sparse_tower_gradients TG, class Means>
  requires gradavg::detail::sparse_output_range<Means&>
summary average_gradients_into(MPI_Comm comm, const TG& tower_grads, Means&& means, const mpi::options& opts = {}) {
  return detail::over_mpi(comm, opts, [&](detail::transport& wire, shared_detail::buffers&) {
    return gradavg::detail::processes::average_sparse_across(wire, tower_grads, means, gradavg::detail::no_squares,
                                                             opts, nullptr);
  });
}

/// As above, and the means of squares.
template <sparse_tower_gradients TG, class Means, class Squares>
  requires gradavg::detail::sparse_output_range<Means&> && gradavg::detail::sparse_output_range<Squares&>
summary average_gradients_into(MPI_Comm comm, const TG& tower_grads, Means&& means, Squares&& squares,
                               const mpi::options& opts = {}) {
  return detail::over_mpi(comm, opts, [&](detail::transport& wire, shared_detail::buffers&) {
    return gradavg::detail::processes::average_sparse_across(wire, tower_grads, means, &squares, opts, nullptr);
  });
}

/// After sharded averaging (output_mode::sharded) and an update of each rank's shard: every
/// rank's shard of `parameters` (shard_of over options.compute.range, clamped to the parameters'
/// elements; summary::shard of the averaging call) sent to every other rank, so that every
/// rank's parameters hold every shard's values. parameters: one writable float or double tensor
/// (a torch::Tensor's dtype: float32 or float64, every one the same) per variable of the
/// averaging call, in its order, with the element counts of its averaged
/// variables (an absent slot, or 0 elements, for a skipped one); contiguous. Every rank passes
/// the same counts, range, fusion_bytes, method and compression (else shape_error /
/// option_error on every rank, nothing written). options.exchange.compression: the shards travel
/// in that wire format (half or a quarter of the bytes), and every rank, the shard's owner too,
/// writes the decoded values, so the ranks' parameters stay bitwise equal; none: the owner's bits.
/// Wire bytes: (P - 1) / P of the parameters' per rank, half of an allreduce's. Collective over
/// comm, with gradavg::mpi's error contract (mpi.hpp's file comment): a rank whose checks fail
/// throws its error, every other rank remote_error, and no parameter is written anywhere.
template <class Params>
  requires gradavg::detail::output_range<Params&>
void gather_shards(MPI_Comm comm, Params&& parameters, const mpi::options& opts = {}) {
  detail::gather_shards(comm, parameters, opts);
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace mpi
}  // namespace gradavg
