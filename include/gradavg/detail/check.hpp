// gradavg internals: every rule checked before anything is written — the towers and their
// gradients, the outputs, the options — one function per subject, each throwing the first error
// in the documented order of precedence.
#pragma once

#include <charconv>
#include <cmath>
#include <cstddef>
#include <exception>
#include <limits>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "access.hpp"
#include "messages.hpp"
#include "../errors.hpp"
#include "../options.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

// ---- Checks on the inputs. -----------------------------------------------------------------

/// Checks that there are towers and that they hold the same number of entries; returns it.
template <class TG>
std::size_t validate_tower_counts(const TG& tg) {
  const std::size_t tower_count = std::ranges::size(tg);
  if (tower_count == 0) throw tower_error("gradavg: tower_grads holds no towers; at least one is needed");
  const std::size_t variable_count = std::ranges::size(at(tg, 0));
  for (std::size_t k = 1; k < tower_count; ++k) {
    const std::size_t n = std::ranges::size(at(tg, k));
    if (n != variable_count)
      throw tower_error("gradavg: tower " + std::to_string(k) + " holds " + std::to_string(n) +
                        " (gradient, variable) entries but tower 0 holds " + std::to_string(variable_count) +
                        "; every tower must list the same variables in the same order");
  }
  return variable_count;
}

/// The variable_mismatch_error of variable i, whose variable differs between towers: names the
/// towers that differ from the variable most towers hold (on a tie, the lowest such tower's) and
/// what each side holds. O(T^2) comparisons: built only on an error.
template <class TG>
[[noreturn]] void throw_variable_mismatch(const TG& tg, std::size_t i) {
  using V = variable_t<TG>;
  using E = entry_t<TG>;
  const std::size_t tower_count = std::ranges::size(tg);
  auto same = [&](std::size_t a, std::size_t b) {
    return with_entry(tg, a, i, [&](const E& ea) {
      return with_entry(tg, b, i, [&](const E& eb) {
        return static_cast<bool>(
            variable_traits<V>::same(entry_traits<E>::variable(ea), entry_traits<E>::variable(eb)));
      });
    });
  };
  std::size_t common = 0, common_count = 0;
  for (std::size_t a = 0; a < tower_count; ++a) {
    std::size_t count = 0;
    for (std::size_t b = 0; b < tower_count; ++b) count += same(a, b) ? 1 : 0;
    if (count > common_count) common = a, common_count = count;
  }
  constexpr std::size_t max_listed = 16;
  std::size_t odd_towers[max_listed]{}, common_towers[max_listed]{};
  std::size_t odd_listed = 0, common_listed = 0;
  for (std::size_t k = 0; k < tower_count; ++k) {
    if (same(common, k)) {
      if (common_listed < max_listed) common_towers[common_listed++] = k;
    } else if (odd_listed < max_listed) {
      odd_towers[odd_listed++] = k;
    }
  }
  const std::size_t odd_count = tower_count - common_count;
  auto value_at = [&](std::size_t k) {
    return with_entry(tg, k, i, [](const E& e) { return describe_value(entry_traits<E>::variable(e)); });
  };
  const std::string odd_value = value_at(odd_towers[0]), common_value = value_at(common);
  const std::string name =
      with_entry(tg, common, i, [i](const E& e) { return describe_variable(i, entry_traits<E>::variable(e)); });
  throw variable_mismatch_error(
      name + ": tower" + (odd_count > 1 ? "s " : " ") + describe_towers(odd_towers, odd_listed, odd_count) +
          (odd_count > 1 ? " have" : " has") + " variable " + odd_value + " at this position but tower" +
          (common_count > 1 ? "s " : " ") + describe_towers(common_towers, common_listed, common_count) +
          (common_count > 1 ? " have " : " has ") + common_value +
          (odd_value == common_value ? " (printed alike, but not the same by variable_traits::same)" : "") +
          "; every tower must list the same variables in the same order",
      i);
}

/// Throws variable_mismatch_error when variable i differs between towers (variable_traits::same,
/// where the variable type has it).
template <class TG>
void check_same_variable(const TG& tg, std::size_t i) {
  using V = variable_t<TG>;
  using E = entry_t<TG>;
  if constexpr (comparable_variable<V>) {
    const std::size_t tower_count = std::ranges::size(tg);
    bool all_same = true;
    with_entry(tg, 0, i, [&](const E& e0) {
      auto&& v0 = entry_traits<E>::variable(e0);
      for (std::size_t k = 1; k < tower_count && all_same; ++k)
        with_entry(tg, k, i,
                   [&](const E& ek) { all_same = variable_traits<V>::same(v0, entry_traits<E>::variable(ek)); });
    });
    if (!all_same) throw_variable_mismatch(tg, i);
  }
}

/// Whether variable i's gradient is present (present(k): on tower k): true on every tower, false
/// on none (the variable is skipped); missing_gradient_error, naming the towers, on some only.
template <class TG, class Present>
bool check_presence(const TG& tg, std::size_t i, Present&& present_on) {
  const std::size_t tower_count = std::ranges::size(tg);
  std::size_t present = 0;
  for (std::size_t k = 0; k < tower_count; ++k) present += present_on(k) ? 1 : 0;
  if (present == 0) return false;
  if (present != tower_count) {
    constexpr std::size_t max_listed = 16;
    std::size_t absent_towers[max_listed]{}, present_towers[max_listed]{};
    std::size_t absent_listed = 0, present_listed = 0;
    for (std::size_t k = 0; k < tower_count; ++k) {
      if (present_on(k)) {
        if (present_listed < max_listed) present_towers[present_listed++] = k;
      } else if (absent_listed < max_listed) {
        absent_towers[absent_listed++] = k;
      }
    }
    const std::size_t absent = tower_count - present;
    throw missing_gradient_error(
        describe_variable_at(tg, i) + ": gradient missing on tower" + (absent > 1 ? "s " : " ") +
            describe_towers(absent_towers, absent_listed, absent) + " but present on tower" +
            (present > 1 ? "s " : " ") + describe_towers(present_towers, present_listed, present) + " (" +
            std::to_string(present) + " of " +
            std::to_string(tower_count) + " towers); a gradient must be present on every tower or on none",
        i);
  }
  return true;
}

/// Throws the first of variable_mismatch_error, missing_gradient_error, shape_error that
/// variable i has, in that order of precedence.
template <class TG>
void validate_variable(const TG& tg, std::size_t i) {
  const std::size_t tower_count = std::ranges::size(tg);
  check_same_variable(tg, i);
  if (!check_presence(tg, i, [&](std::size_t k) { return read_gradient(tg, k, i).present; })) return;  // skipped

  const shape s0 = read_gradient(tg, 0, i).dims;
  for (std::size_t k = 0; k < tower_count; ++k) {
    const auto gk = read_gradient(tg, k, i);
    if (k > 0 && !(gk.dims == s0))
      throw shape_error(describe_variable_at(tg, i) + ": gradient on tower " + std::to_string(k) + " has shape " +
                            describe_gradient_at(tg, k, i) + " but on tower 0 has shape " +
                            describe_gradient_at(tg, 0, i),
                        i);
    if (!gk.contiguous)
      throw shape_error(describe_variable_at(tg, i) + ": gradient on tower " + std::to_string(k) +
                            " is not contiguous (strided); pass a contiguous tensor or a copy",
                        i);
  }
}

/// Checks tower_grads as a whole and returns the number of variables. Throws tower_error,
/// variable_mismatch_error, missing_gradient_error or shape_error.
template <class TG>
std::size_t validate_towers(const TG& tg) {
  const std::size_t variable_count = validate_tower_counts(tg);
  for (std::size_t i = 0; i < variable_count; ++i) validate_variable(tg, i);
  return variable_count;
}

// ---- Checks on the outputs. ----------------------------------------------------------------


/// read_output for the checks: errors of tensor_traits functions name the variable.
template <class TG, class Outputs, class O = default_value_t<output_tensor_t<Outputs&>>>
GRADAVG_HOT_ output_read<O> read_output_at(const TG& tg, Outputs& outputs, std::size_t i, const char* what) {
  try {
    return read_output<Outputs, O>(outputs, i);
  } catch (const error&) {
    rethrow_located(tg, i, std::string("the ") + what + " output");
  }
}

/// At most one dimension above 1: the elements' order does not depend on the storage order.
GRADAVG_HOT_ bool flat_shape(const shape& s) noexcept {
  std::size_t non_trivial = 0;
  for (std::size_t d = 0; d < s.rank; ++d) non_trivial += s.dims[d] > 1 ? 1 : 0;
  return non_trivial <= 1;
}

/// The dimensions above 1, in order.
GRADAVG_HOT_ shape squeezed(const shape& s) noexcept {
  shape r;
  r.order = s.order;
  for (std::size_t d = 0; d < s.rank; ++d)
    if (s.dims[d] != 1) r.dims[r.rank++] = s.dims[d];
  return r;
}

/// An output fits a gradient when it holds its elements in the same order: the same shape; or
/// the same element count with either flat (a std::span for a matrix, a slice of a bucket
/// buffer); or the same dimensions once those of extent 1 are dropped, in the same storage order
/// (a 6x4x1 tensor for a 6x4 one).
GRADAVG_HOT_ bool output_fits(const shape& output, const shape& gradient) noexcept {
  if (output == gradient) return true;
  if (output.size() != gradient.size()) return false;
  return flat_shape(output) || flat_shape(gradient) || squeezed(output) == squeezed(gradient);
}

/// x as a message shows it: shortest round-trip form ("0.25", "1e-50", "nan").
inline std::string describe_number(double x) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, x).ptr;
  return std::string(text, end);
}

/// Whether a sum of weights can be the divisor in the accumulator type whose largest finite value
/// is accumulator_max: positive, normal and finite there.
inline bool usable_weight_sum(double sum, double accumulator_max) noexcept {
  const double smallest = accumulator_max > 1e300 ? std::numeric_limits<double>::min()
                                                  : static_cast<double>(std::numeric_limits<float>::min());
  return sum >= smallest && sum <= accumulator_max;
}

/// Checks the options — every enumeration holds a named value; the fused step's against T towers
/// and V variables — (option_error, weight_error), before anything is written. accumulator_max:
/// the largest finite value of the accumulator type, which the scale, every weight and the
/// weights' sum are converted to.
/// partial_weights: the towers are one rank's part of a call across ranks (gradavg::mpi): their
/// weights may sum to 0 (the sum over every rank is checked once the ranks' sums are known).
inline void validate_options(const options& opts, std::size_t towers, std::size_t variables,
                             double accumulator_max, bool partial_weights = false) {
  shared_detail::require_named_options(opts);
  const compute_options& c = opts.compute;
  if (!c.weights.empty()) {
    if (c.weights.size() != towers)
      throw weight_error("gradavg: options.compute.weights holds " + std::to_string(c.weights.size()) +
                         " weights but there are " + std::to_string(towers) + " towers; pass one per tower");
    double sum = 0;
    for (std::size_t k = 0; k < towers; ++k) {
      const double w = c.weights[k];
      if (!std::isfinite(w) || w < 0 || w > accumulator_max)
        throw weight_error("gradavg: options.compute.weights: the weight of tower " + std::to_string(k) + " is " +
                           describe_number(w) + "; weights must be finite (in the accumulator type) and >= 0");
      sum += w;
    }
    // The sum becomes the divisor in the accumulator type: it must stay positive and finite there.
    if (!(partial_weights ? sum <= accumulator_max : usable_weight_sum(sum, accumulator_max)))
      throw weight_error("gradavg: options.compute.weights sum to " + describe_number(sum) +
                         "; the sum must be positive and finite (a normal number in the accumulator type)");
  }
  if (!std::isfinite(c.scale) || std::abs(c.scale) > accumulator_max)
    throw option_error("gradavg: options.compute.scale is " + describe_number(c.scale) +
                       "; it must be finite (in the accumulator type)");
  // The scale is folded into every tower's weight: each product must stay finite there too.
  for (std::size_t k = 0; k < c.weights.size(); ++k)
    if (std::abs(c.weights[k] * c.scale) > accumulator_max)
      throw weight_error("gradavg: options.compute.weights: the weight of tower " + std::to_string(k) +
                         " times options.compute.scale is " + describe_number(c.weights[k] * c.scale) +
                         ", beyond the accumulator type's range");
  if (c.range.begin > c.range.end)
    throw option_error("gradavg: options.compute.range begins at " + std::to_string(c.range.begin) + " after its end " +
                       std::to_string(c.range.end));
  if (!c.per_variable.empty() && c.per_variable.size() != variables)
    throw option_error("gradavg: options.compute.per_variable holds " + std::to_string(c.per_variable.size()) +
                       " entries but the towers hold " + std::to_string(variables) +
                       " variables; pass one per variable or none");
}

/// Checks one output range (what = "means" or "squares") against validated tower_grads.
template <class TG, class Outputs>
void validate_outputs(const TG& tg, Outputs& outputs, std::size_t variable_count, const char* what) {
  const std::size_t n = std::ranges::size(outputs);
  if (n != variable_count)
    throw output_error(std::string("gradavg: ") + what + " holds " + std::to_string(n) + " outputs but the towers hold " +
                       std::to_string(variable_count) + " variables; pass one output per variable (skipped ones are "
                       "left untouched)");
  for (std::size_t i = 0; i < variable_count; ++i) {
    const auto g0 = read_gradient(tg, 0, i);
    if (!g0.present) continue;  // skipped
    const auto out = read_output_at(tg, outputs, i, what);
    if (!out.present) throw output_error(describe_variable_at(tg, i) + ": the " + what + " output is null", i);
    if (!output_fits(out.dims, g0.dims))
      throw output_error(describe_variable_at(tg, i) + ": the " + what + " output has shape " +
                             describe_output_at(outputs, i) + " but the gradient has shape " +
                             describe_gradient_at(tg, 0, i),
                         i);
    if (!out.contiguous)
      throw output_error(describe_variable_at(tg, i) + ": the " + what + " output is not contiguous (strided)", i);
  }
}

/// Throws the first output error of a validated tower_grads, means before squares. Returns when
/// there is none.
template <class TG, class Means, class Squares>
void validate_all_outputs(const TG& tg, Means& means, Squares* squares, std::size_t variable_count) {
  validate_outputs(tg, means, variable_count, "means");
  if constexpr (outputs_passed<Squares>) validate_outputs(tg, *squares, variable_count, "squares");
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
