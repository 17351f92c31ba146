// gradavg: libtorch. The gradients of K replicas of a torch::nn::Module averaged in place (data
// parallelism with threads as replicas, which the C++ frontend has no helper for on CPU):
// average_module_gradients; broadcast_parameters and broadcast_buffers copy replica 0's
// parameters and buffers into the others. torch::Tensor as gradavg's tensor and variable:
// torch_tensor.hpp (included). Link the CMake target gradavg::torch.
#pragma once

#include <torch/nn/module.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "average.hpp"
#include "detail/isa.hpp"
#include "detail/torch_replicas.hpp"
#include "options.hpp"
#include "torch_sparse.hpp"
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

/// The parameters whose gradient is a sparse tensor on some replica, in named_parameters() order,
/// but those `done` marks (null, or bits as presence's); none where the replicas list different
/// parameter counts (the dense call reports that).
inline std::vector<std::size_t> sparse_parameters(const std::vector<named_tensors>& params,
                                                  const std::vector<std::uint64_t>* done = nullptr) {
  std::vector<std::size_t> sparse;
  for (const auto& p : params)
    if (p.size() != params[0].size()) return sparse;
  for (std::size_t i = 0; !params.empty() && i < params[0].size(); ++i)
    for (const auto& p : params) {
      if (replica_call::marked(done, i)) break;
      const at::Tensor& v = p[i].value();
      if (v.requires_grad() && v.grad().defined() && v.grad().is_sparse()) {
        sparse.push_back(i);
        break;
      }
    }
  return sparse;
}

/// A sparse COO tensor with no rows, of p's sizes and dtype: absent_as_zeros' zero gradient.
inline at::Tensor no_rows_like(const at::Tensor& p) {
  std::vector<std::int64_t> values{0};
  for (std::int64_t d = 1; d < p.dim(); ++d) values.push_back(p.size(d));
  return at::_sparse_coo_tensor_unsafe(at::empty({1, 0}, at::TensorOptions(at::kLong)),
                                       at::empty(values, p.options()), p.sizes(), p.options().layout(at::kSparse));
}

/// average_module_gradients where the gradients of `sparse` (sparse_parameters) are sparse, as
/// Embedding with sparse(true) leaves them. Those are averaged first by the row-sparse call
/// (torch_sparse.hpp), into new coalesced sparse tensors, writing nothing; then the others by
/// average_replicas(..., dense), those read as absent; once both have succeeded, each sparse mean
/// becomes the grad() of every receiving replica (one tensor, shared by them: an optimizer reads
/// it). An error in either call leaves every replica as it was. The report merges both calls':
/// counts and statistics summed, names in named_parameters() order; dense(done) gets the sparse
/// parameters' bits and may mask more parameters (data_parallel's buckets), which it counts as
/// skipped, as average_replicas does.
template <class Dense>
module_report average_with_sparse(std::span<::torch::nn::Module* const> replicas, const std::vector<named_tensors>& params,
                                  const std::vector<std::size_t>& sparse, const options& opts,
                                  const module_options& mopts, Dense&& dense) {
  require_named_module_options(mopts);
  const std::size_t k_count = replicas.size();
  std::vector<std::vector<std::pair<at::Tensor, std::string_view>>> tg(k_count);
  std::vector<unsigned char> filled(sparse.size(), 0);
  for (std::size_t j = 0; j < sparse.size(); ++j) {
    const std::size_t i = sparse[j];
    for (std::size_t k = 0; k < k_count; ++k) {
      const at::Tensor& p = params[k][i].value();
      tg[k].emplace_back(p.requires_grad() ? p.grad() : at::Tensor(), std::string_view(params[k][i].key()));
    }
    if (!mopts.absent_as_zeros) continue;
    for (std::size_t k = 0; k < k_count; ++k)
      if (!tg[k][j].first.defined()) tg[k][j].first = no_rows_like(params[k][i].value()), filled[j] = 1;
  }
  // per_variable of another length than the parameters' is the dense call's option_error.
  std::vector<variable_statistics> statistics;
  if (opts.compute.per_variable.size() == params[0].size())
    for (const std::size_t i : sparse) statistics.push_back(opts.compute.per_variable[i]);
  options sparse_opts = opts;
  sparse_opts.compute.per_variable = statistics;
  auto averaged = average_sparse_allocating(tg, mopts.include_square, sparse_opts);

  std::vector<std::uint64_t> done((params[0].size() + 63) / 64, 0);
  for (const std::size_t i : sparse) presence::set(done, i);
  module_report dense_report = dense(&done);

  module_report result;
  result.report = dense_report.report;
  add_part(result.report, averaged.report);
  const std::size_t receivers = receiving_replicas(mopts, k_count);
  std::vector<unsigned char> skipped(sparse.size(), 0);
  for (const auto& s : averaged.skipped) skipped[s.index] = 1;
  if (mopts.include_square) result.squares = std::move(dense_report.squares);
  std::size_t next = 0, next_skipped = 0, next_filled = 0;
  for (std::size_t j = 0; j < sparse.size(); ++j) {
    if (skipped[j]) continue;
    for (std::size_t k = 0; k < receivers; ++k) params[k][sparse[j]].value().mutable_grad() = averaged.gradients[next].first;
    if (mopts.include_square) result.squares[sparse[j]] = averaged.squares[next].first;
    ++next;
  }
  for (std::size_t j = 0; j < statistics.size(); ++j) opts.compute.per_variable[sparse[j]] = statistics[j];
  // The names of both calls, in named_parameters() order.
  for (std::size_t i = 0, j = 0; i < params[0].size(); ++i) {
    const bool is_sparse = j < sparse.size() && sparse[j] == i;
    const std::string& name = params[0][i].key();
    if (is_sparse ? skipped[j] != 0 : next_skipped < dense_report.skipped.size() && dense_report.skipped[next_skipped] == name)
      result.skipped.push_back(is_sparse ? name : std::move(dense_report.skipped[next_skipped++]));
    if (is_sparse ? filled[j] != 0 && skipped[j] == 0
                  : next_filled < dense_report.zero_filled.size() && dense_report.zero_filled[next_filled] == name)
      result.zero_filled.push_back(is_sparse ? name : std::move(dense_report.zero_filled[next_filled++]));
    j += is_sparse ? 1 : 0;
  }
  // The dense call counted the sparse parameters as skipped (read as absent); the sparse call
  // counted its own. Parameters that `dense` masks stay counted, as the dense call counts them.
  result.report.skipped -= std::min(result.report.skipped, sparse.size());
  return result;
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
/// (channels_last gradients are averaged as such), each of its parameter's dtype; or sparse COO
/// (an Embedding with sparse(true)): averaged without densifying them (torch_sparse.hpp) before
/// the dense ones, each mean a new coalesced sparse tensor set as the grad() of every receiving
/// replica once both calls have succeeded (detail::average_with_sparse). Parameters of
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
  const auto average = [&](const auto& tg, auto& means, std::vector<at::Tensor>* squares, std::exception_ptr prior,
                           std::span<variable_statistics> per_variable) {
    if (prior) std::rethrow_exception(prior);
    options call = opts;
    call.compute.per_variable = per_variable;
    return detail::average_into_own_dtypes(tg, means, squares, call);
  };
  const auto alone = [](detail::presence&, const module_options&) {};
  if (std::find(replicas.begin(), replicas.end(), nullptr) != replicas.end())
    return detail::average_replicas(replicas, opts, mopts, alone, average);  // which names the null one
  std::vector<detail::named_tensors> params;
  params.reserve(replicas.size());
  for (auto* m : replicas) params.push_back(m->named_parameters(/*recurse=*/true));
  const std::vector<std::size_t> sparse = detail::sparse_parameters(params);
  if (sparse.empty()) return detail::average_replicas(replicas, opts, mopts, alone, average, nullptr, &params);
  return detail::average_with_sparse(replicas, params, sparse, opts, mopts, [&](const std::vector<std::uint64_t>* done) {
    return detail::average_replicas(replicas, opts, mopts, alone, average, done, &params);
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
