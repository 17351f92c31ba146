// gradavg: libtorch across the ranks of an MPI communicator (gradavg::mpi): the module helpers of
// torch_processes.hpp (broadcast_buffers, broadcast_parameters, average_module_gradients, and
// mpi_data_parallel) with an MPI_Comm as their first argument. Link the CMake targets
// gradavg::torch and gradavg::mpi.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>

#include "mpi.hpp"
#include "torch_processes.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// An MPI communicator as the module helpers' group: MPI_Allreduce (MPI_MAX, MPI_BOR), MPI_Bcast
/// in pieces of at most 1 GiB, and the call of gradavg::mpi.
struct mpi_group {
  MPI_Comm comm;

  using options_type = gradavg::mpi::options;
  static constexpr const char* data_parallel_name = "gradavg::libtorch::mpi_data_parallel";

  mpi_group(MPI_Comm c) noexcept : comm(c) {}  // NOLINT(google-explicit-constructor): the handle itself

  void check() const { gradavg::mpi::detail::check_communicator(comm); }
  [[nodiscard]] int rank() const { return gradavg::mpi::detail::comm_rank(comm); }
  [[nodiscard]] int ranks() const { return gradavg::mpi::detail::comm_size(comm); }
  void max_words(std::uint64_t* words, std::size_t n) const { reduce(words, n, MPI_MAX); }
  void or_words(std::uint64_t* words, std::size_t n) const { reduce(words, n, MPI_BOR); }
  void broadcast(std::byte* bytes, std::size_t n, int root) const {
    constexpr std::size_t piece = std::size_t{1} << 30;
    for (std::size_t at = 0; at < n; at += piece)
      gradavg::mpi::detail::check(
          MPI_Bcast(bytes + at, static_cast<int>(std::min(piece, n - at)), MPI_BYTE, root, comm), "MPI_Bcast");
  }
  /// The worker thread of mpi_data_parallel calls MPI: MPI_THREAD_SERIALIZED or more.
  [[nodiscard]] std::exception_ptr worker_failure() const {
    int level = MPI_THREAD_SINGLE;
    gradavg::mpi::detail::check(MPI_Query_thread(&level), "MPI_Query_thread");
    if (level >= MPI_THREAD_SERIALIZED) return nullptr;
    return std::make_exception_ptr(option_error(
        "gradavg::libtorch::mpi_data_parallel: its worker thread calls MPI, so MPI must be initialised with "
        "MPI_Init_thread and MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE"));
  }
  template <bool SameElements, class TG, class Means, class Squares>
  summary average(const TG& tg, Means& means, Squares* squares, const options_type& opts,
                  std::exception_ptr prior) const {
    return gradavg::mpi::detail::average_into<SameElements>(comm, tg, means, squares, opts, prior);
  }

 private:
  void reduce(std::uint64_t* words, std::size_t n, MPI_Op op) const {
    gradavg::mpi::detail::check(
        MPI_Allreduce(MPI_IN_PLACE, words, static_cast<int>(n), MPI_UINT64_T, op, comm), "MPI_Allreduce");
  }
};

template <>
struct process_group_traits<MPI_Comm> {
  using type = mpi_group;
};

}  // namespace detail

/// data_parallel across the ranks of an MPI communicator (torch_processes.hpp's
/// process_data_parallel): mpi_data_parallel(comm, replicas, gradavg::mpi::options, module_options,
/// bucket_options). MPI must be initialised with MPI_THREAD_SERIALIZED or more.
using mpi_data_parallel = detail::process_data_parallel<detail::mpi_group>;

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
