// gradavg internals: what data_parallel (<gradavg/torch_data_parallel.hpp>) decides without its
// replicas' threads: the options it accepts, the buckets, their fingerprint across processes,
// which of two errors a finish() throws, and one report from the reports of its calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/modules/embedding.h>

#include "../errors.hpp"
#include "../options.hpp"
#include "../torch_types.hpp"
#include "isa.hpp"
#include "torch_replicas.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// option_error for a module option that is none of its enumeration's values, and for the options
/// that span every parameter in one pass (module_options::include_square,
/// options.compute.per_variable and range): buckets are calls over parts of the parameters.
inline void check_bucket_options(const options& opts, const module_options& mopts) {
  require_named_module_options(mopts);
  const char* what = nullptr;
  if (mopts.include_square) what = "module_options::include_square";
  else if (!opts.compute.per_variable.empty()) what = "options.compute.per_variable";
  else if (opts.compute.range.begin != 0 || opts.compute.range.end != element_range{}.end)
    what = "options.compute.range";
  if (what != nullptr)
    throw option_error(std::string("gradavg::libtorch::data_parallel: ") + what +
                       " is not available with buckets (it spans every parameter); use average_module_gradients");
}

/// The weights of the Embedding and EmbeddingBag modules of `replica` built with sparse(true), as
/// bits (presence's) over `params`, its named_parameters(): their gradients are sparse, which a
/// bucket's dense call does not take.
inline std::vector<std::uint64_t> sparse_weights(::torch::nn::Module& replica, const named_tensors& params) {
  std::vector<std::uint64_t> bits((params.size() + 63) / 64, 0);
  replica.apply([&](const std::string& name, ::torch::nn::Module& m) {
    bool sparse = false;
    if (const auto* e = dynamic_cast<const ::torch::nn::EmbeddingImpl*>(&m))
      sparse = e->options.sparse();
    else if (const auto* b = dynamic_cast<const ::torch::nn::EmbeddingBagImpl*>(&m))
      sparse = b->options.sparse();
    if (!sparse) return;
    const std::string weight = name.empty() ? std::string("weight") : name + ".weight";
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].key() == weight) presence::set(bits, i);
  });
  return bits;
}

/// Buckets of parameter indices over the parameters of `params` that require a gradient, but those
/// `excluded` marks (bits as presence's, or null), in reverse order: consecutive parameters of one
/// dtype until their bytes would pass `bytes` (a larger parameter is a bucket of its own).
inline std::vector<std::vector<std::size_t>> assign_buckets(const named_tensors& params, std::size_t bytes,
                                                            const std::vector<std::uint64_t>* excluded = nullptr) {
  std::vector<std::vector<std::size_t>> buckets;
  std::size_t filled = 0;
  for (std::size_t n = params.size(); n-- > 0;) {
    const at::Tensor& p = params[n].value();
    if (!p.defined() || !p.requires_grad() || replica_call::marked(excluded, n)) continue;
    const std::size_t size = p.nbytes();
    if (buckets.empty() || filled + size > bytes ||
        params[buckets.back().back()].value().scalar_type() != p.scalar_type()) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(n);
    filled += size;
  }
  return buckets;
}

/// FNV-1a of the parameter count and every bucket's parameters.
inline std::uint64_t buckets_fingerprint(std::size_t parameter_count,
                                         const std::vector<std::vector<std::size_t>>& buckets) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  const auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(parameter_count);
  for (const auto& b : buckets) {
    mix(b.size());
    for (const std::size_t i : b) mix(i);
  }
  return h;
}

/// Of two errors (either may be null), the one a call over every parameter would throw: the
/// one naming the earlier parameter (gradavg::error::variable_index()), else a; errors that
/// name no parameter (another rank's, an executor's) before those that do.
inline std::exception_ptr earlier_in_parameter_order(std::exception_ptr a, std::exception_ptr b) {
  if (!a || !b) return a ? a : b;
  const auto index = [](const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const error& g) {
      return g.variable_index();
    } catch (...) {
      return error::npos;
    }
  };
  const std::size_t ia = index(a), ib = index(b);
  if (ia == error::npos) return a;
  if (ib == error::npos) return b;
  return ib < ia ? b : a;
}

/// The report of one call over every parameter from the reports of calls over parts of them:
/// counts summed (less `masked`, the parameters the calls read as absent, which each counted as
/// skipped), statistics (when `statistics`) summed in the reports' order, names in the order of
/// params (replica 0's named_parameters(); null when there are no replicas).
inline module_report merged_report(const std::vector<const module_report*>& reports, std::size_t masked,
                                   bool statistics, const named_tensors* params) {
  const auto index_of = [&](const std::string& name) {
    const std::size_t count = params != nullptr ? params->size() : 0;
    for (std::size_t i = 0; i < count; ++i)
      if ((*params)[i].key() == name) return i;
    return count;
  };
  module_report all;
  all.report.statistics = statistics;
  if (statistics) all.report.sum_mean_squared = all.report.sum_mean_of_squares = 0;
  std::vector<std::pair<std::size_t, std::string>> skipped, zero_filled;
  for (const module_report* r : reports) {
    add_part(all.report, r->report);  // without statistics the sums stay NaN, as every call's are
    all.report.towers = r->report.towers;
    all.report.weighted_towers = r->report.weighted_towers;
    for (const auto& name : r->skipped) skipped.emplace_back(index_of(name), name);
    for (const auto& name : r->zero_filled) zero_filled.emplace_back(index_of(name), name);
  }
  all.report.skipped -= std::min(all.report.skipped, masked);
  std::sort(skipped.begin(), skipped.end());
  std::sort(zero_filled.begin(), zero_filled.end());
  for (auto& e : skipped) all.skipped.push_back(std::move(e.second));
  for (auto& e : zero_filled) all.zero_filled.push_back(std::move(e.second));
  return all;
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
