// gradavg: libtorch across processes. The gradients of a torch::nn::Module's replicas averaged
// over every replica of every rank of an MPI communicator (gradavg::mpi), in place. Link the CMake
// targets gradavg::torch and gradavg::mpi.
#pragma once

#include <cstddef>
#include <exception>
#include <ranges>
#include <span>
#include <type_traits>
#include <vector>

#include "mpi.hpp"
#include "torch.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace libtorch {

/// average_module_gradients across the ranks of comm: each rank passes its own replicas (one or
/// more; ranks may hold different numbers), and every replica of every rank receives the mean
/// over all of them, bitwise the same on every rank (gradavg::mpi's order of summation). The
/// parameters are named and checked as in one process, and agreed between ranks as
/// gradavg::mpi::average_gradients_into agrees on variables: by name, presence and shape, so a
/// rank whose model differs gets the same error as every other rank, before anything is written.
/// Collective: every rank of comm calls it with the same options (weights: one per local replica).
inline module_report average_module_gradients(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas,
                                              const gradavg::mpi::options& opts = {}) {
  // A rank whose replicas cannot be read takes part in the agreement with its error (prior).
  return detail::average_replicas(replicas, [&](const auto& tg, auto& means, std::exception_ptr prior) {
    return gradavg::mpi::mpi_detail::average_into(comm, tg, means, static_cast<std::nullptr_t*>(nullptr), opts, prior);
  });
}

/// The same for any range of replicas (Module*, std::shared_ptr<M>, or a ModuleHolder).
template <std::ranges::random_access_range R>
  requires(!std::is_convertible_v<const R&, std::span<::torch::nn::Module* const>>) &&
          requires(const std::ranges::range_value_t<R>& m) {
            { detail::module_of(m) } -> std::convertible_to<::torch::nn::Module*>;
          }
module_report average_module_gradients(MPI_Comm comm, const R& replicas, const gradavg::mpi::options& opts = {}) {
  std::vector<::torch::nn::Module*> modules;
  for (const auto& m : replicas) modules.push_back(detail::module_of(m));
  return average_module_gradients(comm, std::span<::torch::nn::Module* const>(modules), opts);
}

}  // namespace libtorch
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
