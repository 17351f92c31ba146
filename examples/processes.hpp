// The processes a cross-process example runs on, and the few calls it makes besides gradavg's:
// MPI_COMM_WORLD (the default: gradavg/torch_mpi.hpp, started by mpiexec), or, built with
// GRADAVG_EXAMPLE_C10D, a gloo c10d::ProcessGroup made the torchrun way (gradavg/torch_c10d.hpp,
// started by torchrun --no_python or a shell loop that sets RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT). gradavg's calls take world() either way.
#pragma once

#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#if defined(GRADAVG_EXAMPLE_C10D)
#include <gradavg/torch_c10d.hpp>
#else
#include <gradavg/torch_mpi.hpp>

#include <mpi.h>
#endif

namespace processes {

#if defined(GRADAVG_EXAMPLE_C10D)
using options = gradavg::c10d::options;
using data_parallel = gradavg::libtorch::c10d_data_parallel;

/// The job's process group, made by run() before the example's code.
inline c10::intrusive_ptr<::c10d::ProcessGroup> group;
inline ::c10d::ProcessGroup& world() { return *group; }
inline int rank() { return group->getRank(); }
inline int ranks() { return group->getSize(); }

/// The sum over ranks of value (a collective).
inline double sum(double value) {
  std::vector<at::Tensor> t{at::from_blob(&value, {1}, at::TensorOptions(at::kDouble))};
  group->allreduce(t)->wait();
  return value;
}
/// Rank 0's value (a collective).
inline std::uint64_t from_rank_0(std::uint64_t value) {
  std::vector<at::Tensor> t{at::from_blob(&value, {1}, at::TensorOptions(at::kLong))};
  group->broadcast(t)->wait();
  return value;
}

/// main(): the group from the torchrun variables, then example(rank, ranks)'s exit code; an
/// exception is printed and exits 1 (the other ranks' next call then fails).
template <class Example>
int run(const Example& example) {
  try {
    group = gradavg::c10d::process_group_from_environment();
    const int code = example(rank(), ranks());
    group.reset();
    return code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
#else
using options = gradavg::mpi::options;
using data_parallel = gradavg::libtorch::mpi_data_parallel;

inline MPI_Comm world() { return MPI_COMM_WORLD; }
inline int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int ranks() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// The sum over ranks of value (a collective).
inline double sum(double value) {
  MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return value;
}
/// Rank 0's value (a collective).
inline std::uint64_t from_rank_0(std::uint64_t value) {
  MPI_Bcast(&value, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return value;
}

/// main(): MPI at the level mpi_data_parallel's worker thread needs, then example(rank, ranks)'s
/// exit code; an exception is printed and aborts every rank.
template <class Example>
int run(const Example& example) {
  int provided = 0;
  // mpi_data_parallel's worker thread calls MPI, one call at a time with the main thread.
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  int code = 1;
  try {
    code = example(rank(), ranks());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank(), e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return code;
}
#endif

/// Whether every rank passes true (a collective).
inline bool on_every_rank(bool ok) { return sum(ok ? 0.0 : 1.0) == 0.0; }

}  // namespace processes
