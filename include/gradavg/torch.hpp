// gradavg: libtorch. The gradients of K replicas of a torch::nn::Module averaged in place (data
// parallelism with threads as replicas, which the C++ frontend has no helper for on CPU):
// average_module_gradients; broadcast_parameters and broadcast_buffers copy replica 0's
// parameters and buffers into the others. torch::Tensor as gradavg's tensor and variable:
// torch_tensor.hpp (included). Link the CMake target gradavg::torch.
#pragma once

#include <torch/nn/module.h>

#include <concepts>
#include <cstddef>
#include <exception>
#include <ranges>
#include <span>
#include <type_traits>
#include <vector>

#include "average.hpp"
#include "detail/isa.hpp"
#include "detail/torch_replicas.hpp"
#include "options.hpp"
#include "torch_tensor.hpp"
#include "torch_types.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE

namespace detail {

/// average_gradients_into over replicas' gradients into outputs of their dtypes (replica 0's
/// gradients, or tensors made like them): only the kernels of those types are compiled.
template <class TG>
summary average_into_own_dtypes(const TG& tg, std::vector<at::Tensor>& means, std::vector<at::Tensor>* squares,
                                const options& opts) {
  if (squares) return gradavg::detail::average_into_impl<true>(tg, means, squares, opts);
  return gradavg::detail::average_into_impl<true>(tg, means, gradavg::detail::no_squares, opts);
}

}  // namespace detail

/// Averages the gradients of K replicas of one model (each a clone() trained on its own slice of
/// the batch, on its own thread) into replica 0's .grad() tensors, in place, and copies the result
/// into every other replica's, so each replica's optimizer takes the same step (or, with
/// module_options::means_to = mean_target::first_replica, leaves the others' gradients alone, for
/// one optimizer on replica 0 followed by broadcast_parameters).
///
/// Variables are the parameters in named_parameters() order (recursively), named in messages; every
/// replica must list the same names in the same order (variable_mismatch_error, or tower_error for
/// different counts: towers are replicas). A parameter whose requires_grad is false counts as
/// having no gradient. A parameter without a gradient on every replica is skipped and listed in the
/// report; without one on some replicas only, it is missing_gradient_error, or averaged with zeros
/// in their place with module_options::absent_as_zeros (module_options). The gradients must be as
/// torch::Tensor gradients (torch_tensor.hpp): CPU, dense, of the same memory-order shapes
/// (channels_last gradients are averaged as such), each of its parameter's dtype. Parameters of
/// several dtypes (a bfloat16 body and a float head) are averaged one dtype per call, in order of
/// first appearance, into outputs of their own that are copied into every replica once every call
/// has succeeded (so an error leaves every replica as it was); the report sums the calls' counts
/// and statistics; options.compute.range must then cover everything (option_error). Everything is
/// checked before anything is written. options pass through (threads, the fused statistics:
/// report.global_norm(), clip_coefficient(), noise(); weights, scale, non-finite policy, range);
/// module_options::include_square also returns the means of squared gradients
/// (module_report::squares); options.compute.per_variable, when given, has one entry per parameter,
/// skipped ones included. The copies into replicas 1..K-1 run on the same executor as the averaging
/// (options.run.threads, options.run.pool), split by bytes, with non-temporal stores as
/// options.run.stores says; an exception from it reaches the caller with replica 0 holding the
/// means and the other replicas partly written. A null replica is a tower_error.
inline module_report average_module_gradients(std::span<::torch::nn::Module* const> replicas,
                                              const options& opts = {}, const module_options& mopts = {}) {
  return detail::average_replicas(
      replicas, opts, mopts, [](detail::presence&, const module_options&) {},
      [&](const auto& tg, auto& means, std::vector<at::Tensor>* squares, std::exception_ptr prior,
          std::span<variable_statistics> per_variable) {
        if (prior) std::rethrow_exception(prior);
        options call = opts;
        call.compute.per_variable = per_variable;
        return detail::average_into_own_dtypes(tg, means, squares, call);
      });
}

/// The same for any range of replicas: Module*, std::shared_ptr<M> or a ModuleHolder (the
/// torch::nn::Linear-style handles TORCH_MODULE defines).
template <std::ranges::random_access_range R>
  requires(!std::is_convertible_v<const R&, std::span<::torch::nn::Module* const>>) &&
          requires(const std::ranges::range_value_t<R>& m) {
            { detail::module_of(m) } -> std::convertible_to<::torch::nn::Module*>;
          }
module_report average_module_gradients(const R& replicas, const options& opts = {},
                                       const module_options& mopts = {}) {
  std::vector<::torch::nn::Module*> modules;
  for (const auto& m : replicas) modules.push_back(detail::module_of(m));
  return average_module_gradients(std::span<::torch::nn::Module* const>(modules), opts, mopts);
}

/// A range of replicas that is not itself a span of Module*: Module*, std::shared_ptr<M> or a
/// ModuleHolder.
template <class R>
concept replica_range = std::ranges::random_access_range<R> &&
                        !std::is_convertible_v<const R&, std::span<::torch::nn::Module* const>> &&
                        requires(const std::ranges::range_value_t<R>& m) {
                          { detail::module_of(m) } -> std::convertible_to<::torch::nn::Module*>;
                        };

/// Copies replica 0's buffers (named_buffers(), recursive: BatchNorm's running_mean, running_var
/// and num_batches_tracked) into every other replica's, in place, byte for byte: after it the
/// replicas compute the same eval() outputs from the same parameters. Every replica must list the
/// same buffers, of one dtype and memory-order shape each (detail::alike_states' errors), all
/// checked before anything is written. Call it between steps (no thread using the replicas). The
/// copies run on opts' executor (options.run.threads, options.run.pool), split by bytes, through
/// non-temporal stores as options.run.stores says; no other field of opts is read.
inline void broadcast_buffers(std::span<::torch::nn::Module* const> replicas, const options& opts = {}) {
  detail::copy_state_to_other_replicas(detail::alike_states(replicas, detail::state_kind::buffers), opts);
}

/// The same for the parameters (named_parameters(), recursive, frozen ones included): replica 0's
/// values into every other replica's, in place (gradients and autograd history untouched), so the
/// replicas start in sync, as DistributedDataParallel's construction makes them; and, after one
/// optimizer's step on replica 0 (module_options::means_to = mean_target::first_replica), so that
/// every replica holds the stepped parameters.
inline void broadcast_parameters(std::span<::torch::nn::Module* const> replicas, const options& opts = {}) {
  detail::copy_state_to_other_replicas(detail::alike_states(replicas, detail::state_kind::parameters), opts);
}

/// broadcast_buffers for any range of replicas.
template <replica_range R>
void broadcast_buffers(const R& replicas, const options& opts = {}) {
  const auto modules = detail::modules_of(replicas);
  broadcast_buffers(std::span<::torch::nn::Module* const>(modules), opts);
}

/// broadcast_parameters for any range of replicas.
template <replica_range R>
void broadcast_parameters(const R& replicas, const options& opts = {}) {
  const auto modules = detail::modules_of(replicas);
  broadcast_parameters(std::span<::torch::nn::Module* const>(modules), opts);
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
