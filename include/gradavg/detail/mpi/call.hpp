// gradavg internals: the way into a gradavg::mpi call — the communicator's checks, then the call
// across processes (processes/average.hpp) over MPI (transport.hpp).
#pragma once

#include <exception>
#include <utility>

#include "transport.hpp"
#include "../isa.hpp"
#include "../processes/average.hpp"
#include "../processes/gather.hpp"
#include "../../mpi_options.hpp"
#include "../../plan.hpp"
#include "../../statistics.hpp"

namespace gradavg {
namespace mpi {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// f(transport, buffers) after the communicator's checks: the MPI transport over comm, with the
/// workspace opts.exchange.work or one of the call's own.
template <class F>
decltype(auto) over_mpi(MPI_Comm comm, const mpi::options& opts, F&& f) {
  check_communicator(comm);
  workspace own;
  shared_detail::buffers& work = shared_detail::access::of(opts.exchange.work ? *opts.exchange.work : own);
  transport wire(comm, opts, work);
  return std::forward<F>(f)(wire, work);
}

/// gradavg::mpi's calls: the communicator's checks, then the call across processes over MPI.
/// SameElements: see processes::average_into.
template <bool SameElements = false, class TG, class Means, class Squares>
summary average_into(MPI_Comm comm, const TG& tg, Means& means, Squares* squares, const mpi::options& opts,
                     std::exception_ptr prior = nullptr, plan* planned = nullptr) {
  return over_mpi(comm, opts, [&](transport& wire, shared_detail::buffers& work) {
    return processes::average_into<SameElements>(wire, work, tg, means, squares, opts, prior, planned);
  });
}

/// gradavg::mpi::gather_shards: the communicator's checks, then the gather over MPI.
template <class Params>
void gather_shards(MPI_Comm comm, Params& params, const mpi::options& opts) {
  over_mpi(comm, opts, [&](transport& wire, shared_detail::buffers& work) {
    processes::gather_shards(wire, work, params, opts);
  });
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace mpi
}  // namespace gradavg
