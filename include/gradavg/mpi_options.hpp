// gradavg::mpi's vocabulary (included by <gradavg/mpi.hpp>): its exceptions, options, exchange
// methods and workspace, shared by every instruction-set level.
#pragma once

// The MPI C API only: without these, Open MPI's and MPICH's <mpi.h> pull in the deprecated C++
// bindings when compiled as C++, which need a library of their own (target gradavg::mpi defines
// them too, for units that include <mpi.h> first).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "detail/processes/workspace.hpp"
#include "errors.hpp"
#include "options.hpp"

namespace gradavg {

/// MPI cannot take the call (not initialised, finalised, a null or an inter-communicator), or an
/// MPI call returned an error code (a communicator whose error handler returns them).
class mpi_error : public error {
  using error::error;
};

namespace mpi {

// The vocabulary (options, workspace) is shared by every instruction-set level; the functions
// live in the level's inline namespace (detail/isa.hpp).

/// Bytes of one bucket's fusion buffer (the means' sums and the squares' sums) when
/// options.exchange.fusion_bytes is 0 (the default), on a communicator of `ranks` processes: 1 MiB,
/// or 256 KiB per rank where that is more (every rank owns a slice of each bucket: slices of at
/// least 256 KiB keep a message's latency small against its transfer), at most 16 MiB (Open MPI 4.1
/// maps and unmaps temporaries for larger messages). Small buckets stay in cache between the
/// kernel, the exchange and the unpack (gradavg_bench_mpi measures the choice).
constexpr std::size_t automatic_fusion_bytes(int ranks) noexcept {
  const std::size_t per_rank = (std::size_t{256} << 10) * static_cast<std::size_t>(ranks > 0 ? ranks : 1);
  return std::min(std::max(std::size_t{1} << 20, per_rank), std::size_t{16} << 20);
}

/// How the slices of a bucket move between ranks: raw bytes either way (no MPI reduction), so
/// both give the same bits (docs/mpi.md, "Cost on a link").
enum class exchange_method : unsigned char {
  /// MPI_Ialltoallv to the slices' owners, then MPI_Iallgatherv of the summed slices: the MPI
  /// library schedules the messages.
  collectives,
  /// MPI_Isend / MPI_Irecv with every other rank, tags 0x4741 and 0x4742 on comm (code that posts
  /// MPI_ANY_TAG receives on comm while the call runs must give gradavg a communicator of its own).
  point_to_point,
};

/// gradavg::error_feedback (options.hpp), by its former name.
using gradavg::error_feedback;

class workspace;

namespace shared_detail {

/// What a workspace keeps: the calls' tables and fusion buffers, and MPI's state of the buckets
/// in flight (detail/mpi/transport.hpp).
struct buffers : gradavg::shared_detail::process_buffers {
  std::vector<MPI_Request> requests;
  std::vector<int> counts;   // exchange_method::collectives: counts and displacements
  std::vector<int> pending;  // per bucket in flight: its requests in use
};

/// The calls' way in (every level's).
struct access {
  static buffers& of(workspace& w) noexcept;
};

}  // namespace shared_detail

/// Buffers reused from call to call (no allocation once they have grown to a layout's size).
class workspace {
 public:
  workspace() = default;

 private:
  friend struct shared_detail::access;
  shared_detail::buffers held;
};

inline shared_detail::buffers& shared_detail::access::of(workspace& w) noexcept { return w.held; }

/// How the buckets move between the ranks. Every rank passes the same fusion_bytes and method.
struct exchange_options {
  /// Bytes of one bucket's fusion buffer: at least two elements, at most 1 GiB; 0 (the default):
  /// automatic_fusion_bytes(the communicator's size), and with compression that size of encoded
  /// bytes (a buffer larger by the format's ratio: 2 for the 16-bit formats, 3.9 for int8).
  std::size_t fusion_bytes = 0;
  /// How a bucket's slices move between ranks.
  exchange_method method = exchange_method::collectives;
  /// How the sums are encoded on the wire (gradavg::compression): none, or a lossy 16-bit format
  /// that halves the bytes every rank sends and receives.
  gradavg::compression compression = gradavg::compression::none;
  /// Which means each rank receives (gradavg::output_mode): every one, or with sharded its shard
  /// only (summary::shard), for half the bytes on the wire.
  gradavg::output_mode output = gradavg::output_mode::replicated;
  /// How row-sparse gradients travel (gradavg::sparse_wire): rows or dense, by their bytes.
  gradavg::sparse_wire sparse = gradavg::sparse_wire::automatic;
  /// Error feedback for a lossy compression: empty (the default), or this rank's residual, one
  /// float per element of the averaged variables (their sizes' sum, in the flat order of
  /// compute.range; option_error otherwise), zero at the start and kept by the caller between
  /// calls (4 bytes per parameter). Each call adds it into this rank's contribution before the
  /// encoding and stores back what the encoding dropped, and, for the slices this rank owns, what
  /// the sum's encoding dropped, so that every dropped part reaches a later step's sum (EF-SGD).
  /// Reset it (fill with zeros) when the gradients' scale changes (a new loss scale) or on
  /// restart; after a call that throws it is unspecified. Must overlap no gradient or output.
  std::span<float> residual = {};
  /// The stochastic rounding's seed (compression::int8): the same seed, ranks and buffers give
  /// the same bits; pass the step number for a new rounding each step.
  std::uint64_t seed = 0;
  /// Error feedback kept by libtorch::mpi_data_parallel (error_feedback); off for a direct call.
  error_feedback feedback = error_feedback::off;
  /// Buffers kept between calls; not owned. Null: the call allocates its own.
  workspace* work = nullptr;
};

/// gradavg::options' groups and exchange_options (gradavg::process_options).
using options = gradavg::process_options<exchange_options>;

}  // namespace mpi
}  // namespace gradavg
