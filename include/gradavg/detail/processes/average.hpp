// gradavg internals: the way into a call across processes over any transport — the element
// types (static, or this rank's run-time ones), then the call (call.hpp). A transport's public
// function checks its own context, makes its transport and calls average_into.
#pragma once

#include <exception>
#include <string>

#include "call.hpp"
#include "exchange.hpp"
#include "workspace.hpp"
#include "../access.hpp"
#include "../elements.hpp"
#include "../isa.hpp"
#include "../../plan.hpp"
#include "../../statistics.hpp"
#include "../../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// Averages tg's gradients over every rank of wire into means (and squares: null or no_squares for
/// none). work: the call's tables and buffers (the transport's own state apart). prior: this
/// rank's failure before the call, which still takes part in the agreement (every other rank
/// throws remote_error). planned: the caller's plan, or null. SameElements: every output holds its
/// gradients' element type by construction (the libtorch replicas'): see with_kernel_types.
template <bool SameElements = false, transport Transport, class TG, class Means, class Squares>
summary average_into(Transport& wire, gradavg::shared_detail::process_buffers& work, const TG& tg, Means& means,
                     Squares* squares, const typename Transport::options_type& opts, std::exception_ptr prior,
                     plan* planned) {
  using G = gradient_tensor_t<TG>;
  using OT = output_tensor_t<Means&>;
  // A refusal before the first collective takes part in it (every rank throws).
  if (!prior && opts.exchange.feedback != error_feedback::off) {
    std::string message = Transport::caller;  // appended: GCC 12 warns on operator+ temporaries here
    message.append(": options.exchange.feedback is kept: only the libtorch module helpers keep residuals (one per "
                   "bucket); a direct call takes its residual in options.exchange.residual");
    prior = std::make_exception_ptr(option_error(message));
  }
  static_assert(gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);
  static_assert(dynamic_tensor<G> || supported_scalar<tensor_value_t<G>>,
                "gradavg: gradient elements must be " GRADAVG_ELEMENT_TYPES_MESSAGE_);
  static_assert(dynamic_tensor<OT> || supported_scalar<tensor_value_t<OT>>,
                "gradavg: output elements must be " GRADAVG_ELEMENT_TYPES_MESSAGE_);
  if constexpr (static_tensor<G> && static_tensor<OT>) {
    using S = tensor_value_t<G>;
    using O = tensor_value_t<OT>;
    static_assert(supported_output<S, O>,
                  "gradavg: the means outputs must hold the gradients' element type (or float for 16-bit gradients)");
    return call<Transport, TG, Means, Squares, S, O>{{wire, tg, means, squares, opts, work}, planned}(prior);
  } else {
    // Run-time element types: this rank's are found first (a failure still takes part in the
    // agreement, as prior), then every rank runs the kernel of its types; the first collective
    // compares them.
    call_elements e;
    if (!prior) {
      try {
        e = validate_elements(tg, validate_tower_counts(tg), &means, squares);
      } catch (...) {
        prior = std::current_exception();
      }
    }
    return with_kernel_types<G, OT, true, SameElements>(e, !prior, [&]<class S, class O>() {
      return call<Transport, TG, Means, Squares, S, O>{{wire, tg, means, squares, opts, work}, planned}(prior);
    });
  }
}

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
