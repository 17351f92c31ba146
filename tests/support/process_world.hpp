// The processes a cross-process libtorch test runs on, whichever transport it is built for:
// MPI_COMM_WORLD under mpiexec (default), or with GRADAVG_TEST_C10D a gloo process group started
// by support/launch_ranks.sh. world(), world_rank(), world_size(), same_on_every_rank(), and the
// transport's names: across (its namespace), world_options, world_data_parallel.
#pragma once

#if defined(GRADAVG_TEST_C10D)
#include <gradavg/torch_c10d.hpp>

#include "c10d_world.hpp"

namespace gradavg_test {
namespace across = gradavg::c10d;
using world_options = gradavg::c10d::options;
using world_data_parallel = gradavg::libtorch::c10d_data_parallel;
}  // namespace gradavg_test
#else
#include <gradavg/torch_mpi.hpp>

#include <mpi.h>

#include "mpi_support.hpp"

namespace gradavg_test {
namespace across = gradavg::mpi;
using world_options = gradavg::mpi::options;
using world_data_parallel = gradavg::libtorch::mpi_data_parallel;
inline MPI_Comm world() { return MPI_COMM_WORLD; }
/// MPI for the life of the program, at the thread level mpi_data_parallel's worker needs.
inline const mpi_session session(MPI_THREAD_SERIALIZED);
}  // namespace gradavg_test
#endif
