// gradavg internals: the way into a gradavg::mpi call — the communicator's checks, the element
// types (static, or this rank's run-time ones), then the call across processes (processes/call.hpp)
// over MPI (transport.hpp).
#pragma once

#include <exception>

#include "transport.hpp"
#include "../access.hpp"
#include "../elements.hpp"
#include "../isa.hpp"
#include "../processes/call.hpp"
#include "../../mpi_options.hpp"
#include "../../plan.hpp"
#include "../../statistics.hpp"

namespace gradavg {
namespace mpi {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

template <class S, class O, class TG, class Means, class Squares>
summary average_into_typed(MPI_Comm comm, const TG& tg, Means& means, Squares* squares, const mpi::options& opts,
                           std::exception_ptr prior, plan* planned) {
  workspace own;
  shared_detail::buffers& work = shared_detail::access::of(opts.exchange.work ? *opts.exchange.work : own);
  transport wire(comm, opts, work);
  return processes::call<transport, TG, Means, Squares, S, O>{{wire, tg, means, squares, opts, work}, planned}(prior);
}

/// SameElements: every output holds its gradients' element type by construction (the libtorch
/// replicas'): see gradavg::detail::with_kernel_types.
template <bool SameElements = false, class TG, class Means, class Squares>
summary average_into(MPI_Comm comm, const TG& tg, Means& means, Squares* squares, const mpi::options& opts,
                     std::exception_ptr prior = nullptr, plan* planned = nullptr) {
  using G = gradavg::detail::gradient_tensor_t<TG>;
  using OT = gradavg::detail::output_tensor_t<Means&>;
  check_communicator(comm);
  static_assert(gradavg::detail::gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);
  static_assert(dynamic_tensor<G> || gradavg::detail::supported_scalar<tensor_value_t<G>>,
                "gradavg: gradient elements must be float, double, Eigen::half or Eigen::bfloat16");
  static_assert(dynamic_tensor<OT> || gradavg::detail::supported_scalar<tensor_value_t<OT>>,
                "gradavg: output elements must be float, double, Eigen::half or Eigen::bfloat16");
  if constexpr (static_tensor<G> && static_tensor<OT>) {
    using S = tensor_value_t<G>;
    using O = tensor_value_t<OT>;
    static_assert(gradavg::detail::supported_output<S, O>,
                  "gradavg: the means outputs must hold the gradients' element type (or float for 16-bit gradients)");
    return average_into_typed<S, O>(comm, tg, means, squares, opts, prior, planned);
  } else {
    // Run-time element types: this rank's are found first (a failure still takes part in the
    // agreement, as prior), then every rank runs the kernel of its types; the first collective
    // compares them.
    gradavg::detail::call_elements e;
    if (!prior) {
      try {
        const std::size_t variable_count = gradavg::detail::validate_tower_counts(tg);
        e = gradavg::detail::validate_elements(tg, variable_count, &means, squares);
      } catch (...) {
        prior = std::current_exception();
      }
    }
    return gradavg::detail::with_kernel_types<G, OT, true, SameElements>(e, !prior, [&]<class S, class O>() {
      return average_into_typed<S, O>(comm, tg, means, squares, opts, prior, planned);
    });
  }
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace mpi
}  // namespace gradavg
