// gradavg internals: the libtorch module helpers' reading of K replicas — their parameters as
// towers of (gradient, name) entries, presence, the averaging by dtype, then the copies into the
// other replicas (torch_copies.hpp, which also holds the broadcasts' checks and copies).
#pragma once

#include <torch/nn/module.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../average.hpp"
#include "../errors.hpp"
#include "../options.hpp"
#include "../torch_tensor.hpp"
#include "../torch_types.hpp"
#include "isa.hpp"
#include "torch_copies.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// The module behind a Module*, a std::shared_ptr<Module> or a ModuleHolder (torch::nn::Linear).
template <class M>
::torch::nn::Module* module_of(const M& m) {
  if constexpr (std::is_pointer_v<M>)
    return m;
  else if constexpr (requires { m.ptr(); })
    return m.is_empty() ? nullptr : m.ptr().get();
  else
    return m.get();
}

/// Which parameters have a gradient on some replica, and which lack one on some replica: bit i % 64
/// of word i / 64 for parameter i. known: false where the replicas could not be read or list
/// different parameter counts (validation then reports it).
struct presence {
  bool known = false;
  std::size_t parameters = 0;
  std::vector<std::uint64_t> present, absent;
  /// FNV-1a of replica 0's parameters' dtypes in order (0 where not known).
  std::uint64_t dtypes = 0;

  static bool has(const std::vector<std::uint64_t>& bits, std::size_t i) noexcept {
    return ((bits[i / 64] >> (i % 64)) & 1u) != 0;
  }
  static void set(std::vector<std::uint64_t>& bits, std::size_t i) noexcept {
    bits[i / 64] |= std::uint64_t{1} << (i % 64);
  }
};

/// The indices of the parameters of each dtype, the dtypes in order of first appearance.
inline std::vector<std::vector<std::size_t>> dtype_groups(const ::torch::OrderedDict<std::string, at::Tensor>& params) {
  std::vector<at::ScalarType> dtypes;
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const at::ScalarType t = params[i].value().scalar_type();
    const auto g = static_cast<std::size_t>(std::find(dtypes.begin(), dtypes.end(), t) - dtypes.begin());
    if (g == dtypes.size()) {
      dtypes.push_back(t);
      groups.emplace_back();
    }
    groups[g].push_back(i);
  }
  return groups;
}

using named_tensors = ::torch::OrderedDict<std::string, at::Tensor>;

/// option_error unless every enumeration of mopts holds one of its named values.
inline void require_named_module_options(const module_options& mopts) {
  gradavg::shared_detail::require_named(mopts.means_to, mean_target::first_replica, "module_options::means_to");
}

/// How many replicas, from replica 0 on, receive the means (module_options::means_to).
inline std::size_t receiving_replicas(const module_options& mopts, std::size_t k_count) noexcept {
  return mopts.means_to == mean_target::first_replica ? std::min<std::size_t>(1, k_count) : k_count;
}

/// Adds the counts and the statistics' sums of a call over other parameters to `into`.
inline void add_part(summary& into, const summary& part) noexcept {
  // The parts' flat ranges end to end (each part averages its whole range: the helpers take no
  // range or sharded output where they split a call).
  into.shard.end += part.shard.end - part.shard.begin;
  into.averaged += part.averaged;
  into.skipped += part.skipped;
  into.nonfinite_variables += part.nonfinite_variables;
  into.sum_mean_squared += part.sum_mean_squared;
  into.sum_mean_of_squares += part.sum_mean_of_squares;
}
using replica_towers = std::vector<std::vector<std::pair<at::Tensor, std::string_view>>>;

/// One module-helper call's state, step by step (average_replicas): the replicas' parameters as
/// towers of (gradient, name) entries, viewing the names named_parameters() holds; the means
/// (replica 0's gradients, averaged in place); the presence; and `prior`, what a step before the
/// averaging threw, for the averaging call to rethrow (after agreeing on it with the other
/// processes, where there are any). A step that throws sets prior and leaves nothing half made.
struct replica_call {
  struct fill {
    std::size_t replica, parameter;
  };
  std::size_t k_count = 0;
  std::vector<named_tensors> asked;  // named_parameters() of each replica, unless known
  const std::vector<named_tensors>* params = &asked;
  replica_towers tg;
  std::vector<at::Tensor> means;
  presence seen;
  std::exception_ptr prior;
  std::vector<fill> fills;  // absent_as_zeros' new gradients, attached once the call succeeded
  module_report result;

  const std::vector<named_tensors>& parameters() const noexcept { return *params; }

  /// Whether `done` (null, or bits as presence's) marks parameter i.
  static bool marked(const std::vector<std::uint64_t>* done, std::size_t i) noexcept {
    return done != nullptr && presence::has(*done, i);
  }

  /// Reads every replica's gradients: a parameter that requires no gradient, or that `done` marks
  /// (bits as presence's), reads as absent. known: the replicas' named_parameters(), or null.
  void read(std::span<::torch::nn::Module* const> replicas, const std::vector<std::uint64_t>* done,
            const std::vector<named_tensors>* known) noexcept {
    k_count = replicas.size();
    if (known != nullptr) params = known;
    try {
      for (std::size_t k = 0; k < k_count; ++k)
        if (replicas[k] == nullptr) throw tower_error("gradavg: replica " + std::to_string(k) + " is null");
      if (known == nullptr) {
        asked.reserve(k_count);
        for (auto* m : replicas) asked.push_back(m->named_parameters(/*recurse=*/true));
      }
      tg.resize(k_count);
      for (std::size_t k = 0; k < k_count; ++k) {
        tg[k].reserve(parameters()[k].size());
        for (std::size_t i = 0; i < parameters()[k].size(); ++i) {
          const auto& item = parameters()[k][i];
          const at::Tensor& p = item.value();
          const bool take = p.requires_grad() && !marked(done, i);
          tg[k].emplace_back(take ? p.grad() : at::Tensor(), std::string_view(item.key()));
        }
      }
      // In place: each mean is replica 0's gradient (undefined where the parameter is skipped).
      if (k_count > 0) {
        means.reserve(tg[0].size());
        for (const auto& e : tg[0]) means.push_back(e.first);
      }
      if (k_count > 0 && std::all_of(tg.begin(), tg.end(), [&](const auto& t) { return t.size() == tg[0].size(); }))
        note_presence();
    } catch (...) {
      prior = std::current_exception();
      tg.clear();
      means.clear();
      seen = presence{};
    }
  }

  /// seen from tg (every replica lists as many parameters), with the fingerprint of the dtypes.
  void note_presence() {
    seen.parameters = tg[0].size();
    seen.present.assign((seen.parameters + 63) / 64, 0);
    seen.absent.assign(seen.present.size(), 0);
    for (const auto& tower : tg)
      for (std::size_t i = 0; i < seen.parameters; ++i)
        presence::set(tower[i].first.defined() ? seen.present : seen.absent, i);
    seen.dtypes = 1469598103934665603ull;
    for (const auto& item : parameters()[0])
      seen.dtypes = (seen.dtypes ^ static_cast<std::uint64_t>(item.value().scalar_type())) * 1099511628211ull;
    seen.known = true;
  }

  /// absent_as_zeros: a zero gradient, laid out as its parameter, for every replica that lacks one
  /// of a parameter present on some replica; listed in result.zero_filled.
  void zero_fill() noexcept {
    if (!seen.known || prior) return;
    try {
      for (std::size_t i = 0; i < seen.parameters; ++i) {
        if (!presence::has(seen.present, i) || !presence::has(seen.absent, i)) continue;
        result.zero_filled.emplace_back(tg[0][i].second);
        for (std::size_t k = 0; k < k_count; ++k) {
          if (tg[k][i].first.defined()) continue;
          tg[k][i].first = at::zeros_like(parameters()[k][i].value());
          if (k == 0) means[i] = tg[0][i].first;
          fills.push_back({k, i});
        }
      }
    } catch (...) {
      prior = std::current_exception();
      tg.clear();
      means.clear();
      fills.clear();
      result.zero_filled.clear();
    }
  }

  /// module_options::include_square: new tensors laid out as the means (the same memory-order
  /// shapes).
  void make_squares() noexcept {
    if (prior) return;
    try {
      result.squares.resize(means.size());
      for (std::size_t i = 0; i < means.size(); ++i)
        if (means[i].defined()) result.squares[i] = at::empty_like(means[i]);
    } catch (...) {
      prior = std::current_exception();
      result.squares.clear();
    }
  }

  /// The parameters' indices by dtype (dtype_groups), checked against the options that need one
  /// call over everything; empty when the towers are not known.
  std::vector<std::vector<std::size_t>> groups_by_dtype(const options& opts) noexcept {
    std::vector<std::vector<std::size_t>> groups;
    if (!seen.known || prior || k_count == 0) return groups;
    try {
      groups = dtype_groups(parameters()[0]);
      if (groups.size() > 1) {
        if (opts.compute.range.begin != 0 || opts.compute.range.end != element_range{}.end)
          throw option_error("gradavg::libtorch: options.compute.range with parameters of several dtypes (each dtype is "
                             "averaged in a call of its own); pass the whole range");
        const std::size_t entries = opts.compute.per_variable.size();
        if (entries != 0 && entries != seen.parameters)
          throw option_error("gradavg: options.compute.per_variable holds " + std::to_string(entries) +
                             " entries but the replicas hold " + std::to_string(seen.parameters) +
                             " parameters; pass one per parameter or none");
      }
    } catch (...) {
      prior = std::current_exception();
      groups.clear();
    }
    return groups;
  }

  /// Parameters of several dtypes: one average() call per dtype (in order of first appearance),
  /// each into outputs of its own, which become the means (copied into every replica afterwards);
  /// the report sums the calls' counts and statistics.
  template <class Average>
  void average_by_dtype(const std::vector<std::vector<std::size_t>>& groups, const options& opts,
                        std::vector<at::Tensor>* squares, Average& average) {
    std::vector<at::Tensor> outputs(means.size());
    for (std::size_t i = 0; i < means.size(); ++i)
      if (means[i].defined()) outputs[i] = at::empty_like(means[i]);
    replica_towers group_tg(k_count);
    std::vector<at::Tensor> group_outputs, group_squares;
    std::vector<variable_statistics> group_statistics;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (std::size_t k = 0; k < k_count; ++k) {
        group_tg[k].clear();
        for (const std::size_t i : groups[g]) group_tg[k].push_back(tg[k][i]);
      }
      group_outputs.clear();
      group_squares.clear();
      group_statistics.clear();
      for (const std::size_t i : groups[g]) {
        group_outputs.push_back(outputs[i]);
        if (squares) group_squares.push_back(result.squares[i]);
        if (!opts.compute.per_variable.empty()) group_statistics.push_back(opts.compute.per_variable[i]);
      }
      const summary s = average(group_tg, group_outputs, squares ? &group_squares : nullptr, nullptr,
                                std::span<variable_statistics>(group_statistics));
      for (std::size_t j = 0; j < group_statistics.size(); ++j)
        opts.compute.per_variable[groups[g][j]] = group_statistics[j];
      if (g == 0)
        result.report = s;
      else
        add_part(result.report, s);
    }
    means = std::move(outputs);
  }

  /// After the averaging succeeded: attaches the zero-filled gradients (of replica 0 only with
  /// mean_target::first_replica), lists the skipped parameters (not those `done` marks) and copies
  /// the means into the receiving replicas (from replica 0 on when the means are outputs of their
  /// own: by_dtype).
  void deliver(const options& opts, const module_options& mopts, const std::vector<std::uint64_t>* done,
               bool by_dtype) {
    const std::size_t receivers = receiving_replicas(mopts, k_count);
    for (const auto& f : fills)
      if (f.replica < receivers)
        parameters()[f.replica][f.parameter].value().mutable_grad() = tg[f.replica][f.parameter].first;
    for (std::size_t i = 0; i < means.size(); ++i)
      if (!means[i].defined() && !marked(done, i))
        result.skipped.emplace_back(tg[0][i].second);
    copy_to_replicas(tg, means, by_dtype ? 0 : 1, receivers, opts);
  }
};

/// The replicas' parameters as towers of (gradient, name) entries, averaged by average(towers,
/// means, squares, prior, per_variable) in place into replica 0's gradients (squares: null, or new
/// tensors for module_options::include_square, module_report::squares), then copied to the other
/// replicas on opts' executor (none with mean_target::first_replica); parameters of several dtypes
/// (the same on every process: agree leaves presence unknown otherwise) in one call per dtype, into
/// outputs of their own, copied into every replica once every call has succeeded (an error in any
/// call leaves every replica as it was). prior: what a step before the averaging threw (a null
/// replica, an allocation), for the averaging call to rethrow, after agreeing on it with the other
/// processes where there are any. agree(presence&, mopts): makes the replicas' presence that of
/// every replica of every process (a no-op in one process), or unknown where the processes'
/// parameter counts or dtypes differ; called on every call, known or not. done: null, or the
/// parameters (bits as presence's) averaged already (data_parallel's buckets), read as absent on
/// every replica and left out of module_report::skipped. known: null, or the replicas'
/// named_parameters() kept from an earlier call (data_parallel's, whose replicas do not change),
/// read instead of asking every replica again.
template <class Agree, class Average>
module_report average_replicas(std::span<::torch::nn::Module* const> replicas, const options& opts,
                               const module_options& mopts, Agree&& agree, Average&& average,
                               const std::vector<std::uint64_t>* done = nullptr,
                               const std::vector<named_tensors>* known = nullptr) {
  replica_call call;
  call.read(replicas, done, known);
  if (!call.prior) {
    try {
      require_named_module_options(mopts);
    } catch (...) {
      call.prior = std::current_exception();  // rethrown by the averaging call, agreed across processes
    }
  }
  agree(call.seen, mopts);
  if (mopts.absent_as_zeros) call.zero_fill();
  if (mopts.include_square) call.make_squares();
  std::vector<at::Tensor>* squares = mopts.include_square ? &call.result.squares : nullptr;
  const auto groups = call.groups_by_dtype(opts);
  if (groups.size() <= 1)
    call.result.report = average(call.tg, call.means, squares, call.prior, opts.compute.per_variable);
  else
    call.average_by_dtype(groups, opts, squares, average);
  call.deliver(opts, mopts, done, groups.size() > 1);
  return std::move(call.result);
}

/// Module* of each element of a range of replicas (Module*, std::shared_ptr<M>, ModuleHolder).
template <class R>
std::vector<::torch::nn::Module*> modules_of(const R& replicas) {
  std::vector<::torch::nn::Module*> modules;
  for (const auto& m : replicas) modules.push_back(module_of(m));
  return modules;
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
