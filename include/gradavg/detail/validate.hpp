// gradavg internals: reading tower_grads, and every check made before anything is written.
//
// Lifetimes: a tower, an entry or a gradient slot may be yielded by value (a views::transform,
// an entry_traits::gradient() returning a view). Each is then held in a local for as long as it
// is read, and only values (pointers, shapes, copies) leave that scope — so the elements a
// pointer refers to must outlive the slot: a slot held by value must be a view
// (borrowed_slot), which the API entry points check at compile time.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <ranges>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.hpp"
#include "../entry.hpp"
#include "../errors.hpp"
#include "../layout_cache.hpp"
#include "../options.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

// Shared by every level (layout_cache.hpp).
using gradavg::layout_detail::byte_range;
using gradavg::layout_detail::layout_cache_access;
using gradavg::layout_detail::tagged_range;

// ---- Access to tower_grads[k][i]. ----------------------------------------------------------

template <class R>
constexpr decltype(auto) at(R&& r, std::size_t i) {
  return std::ranges::begin(r)[static_cast<std::ranges::range_difference_t<R>>(i)];
}

template <class TG>
using tower_ref_t = std::ranges::range_reference_t<const TG>;
template <class TG>
using entry_ref_t = std::ranges::range_reference_t<std::remove_reference_t<tower_ref_t<TG>>>;
template <class TG>
using entry_t = std::remove_cvref_t<entry_ref_t<TG>>;
template <class TG>
using gradient_ref_t = decltype(entry_traits<entry_t<TG>>::gradient(std::declval<const entry_t<TG>&>()));
template <class TG>
using gradient_slot_t = std::remove_cvref_t<gradient_ref_t<TG>>;
template <class TG>
using variable_t =
    std::remove_cvref_t<decltype(entry_traits<entry_t<TG>>::variable(std::declval<const entry_t<TG>&>()))>;
template <class TG>
using gradient_tensor_t = slot_tensor_t<gradient_slot_t<TG>>;

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

/// A slot whose tensor's elements live elsewhere, so a pointer to them outlives the slot: a raw
/// pointer, a std::reference_wrapper, a view tensor (tensor_traits<T>::view), or an optional of one.
template <class S>
constexpr bool borrowed_slot() {
  if constexpr (std::is_pointer_v<S> || is_reference_wrapper<S>::value)
    return true;
  else if constexpr (is_optional<S>::value)
    return borrowed_slot<typename S::value_type>();
  else if constexpr (tensor<S>)
    return view_tensor<S>;
  else
    return false;  // smart pointers and other holders may own the tensor
}

/// Whether tower_grads yields its gradient slots by value: a tower that is not a borrowed range,
/// an entry, or entry_traits::gradient() returned by value.
template <class TG>
inline constexpr bool slots_held_by_value =
    (!std::is_lvalue_reference_v<tower_ref_t<TG>> && !std::ranges::borrowed_range<tower_ref_t<TG>>) ||
    !std::is_lvalue_reference_v<entry_ref_t<TG>> || !std::is_lvalue_reference_v<gradient_ref_t<TG>>;

/// The lifetime rule of entry.hpp: gradients yielded by value must be views.
template <class TG>
inline constexpr bool gradients_outlive_reads = !slots_held_by_value<TG> || borrowed_slot<gradient_slot_t<TG>>();

#define GRADAVG_LIFETIME_MESSAGE_                                                                                \
  "gradavg: tower_grads yields gradients by value (a tower, an entry or entry_traits::gradient() returned by "   \
  "value) that own their elements, which would be destroyed before they are read. Yield references, or views: " \
  "a pointer, std::reference_wrapper, std::span, Eigen::Map, Eigen::TensorMap, a non-const Eigen::Ref, or a "    \
  "std::optional of one; a tensor type of your own is a view when its tensor_traits say "                        \
  "`static constexpr bool view = true;`"

/// Inlined into the per-entry loops: called for every entry of every call.
#define GRADAVG_HOT_ [[gnu::always_inline]] inline

/// Calls f(entry) with tower k's entry i (and the tower it came from) alive for the call. f returns
/// a value that does not refer into the entry.
template <class TG, class F>
GRADAVG_HOT_ constexpr auto with_entry(const TG& tg, std::size_t k, std::size_t i, F&& f) {
  auto&& tower = at(tg, k);
  auto&& e = at(tower, i);
  return std::forward<F>(f)(std::as_const(e));
}

/// The element type a call reads T as when it does not choose one: value_type, or for a dynamic
/// tensor a placeholder (the checks that need only presence and shape).
template <class T>
using default_value_t = tensor_value_t<T>;

/// t's first element as S: value_type* for a static tensor (S is value_type), the dynamic
/// tensor's data() cast to the element type the call chose.
template <class S, class T>
GRADAVG_HOT_ const S* typed_data(const T& t) {
  if constexpr (dynamic_tensor<T>)
    return static_cast<const S*>(tensor_traits<T>::data(t));
  else
    return tensor_traits<T>::data(t);
}

template <class S, class T>
GRADAVG_HOT_ S* typed_mutable_data(T& t) {
  if constexpr (dynamic_tensor<T>)
    return static_cast<S*>(tensor_traits<T>::mutable_data(t));
  else
    return tensor_traits<T>::mutable_data(t);
}

/// Re-raises the gradavg::error being handled (thrown by a tensor_traits function) naming the
/// variable and what was read ("gradient on tower 2"), as the same type; any other exception,
/// or a gradavg::error that already names a variable, unchanged. Called from a catch handler.
template <class TG>
[[noreturn, gnu::cold, gnu::noinline]] void rethrow_located(const TG& tg, std::size_t i, const std::string& what);

/// The bytes of n elements from p: empty for n = 0 (p null for an absent buffer). Every byte range
/// is built this way, from a pointer and a count, never chosen whole between an empty range and
/// another: GCC 12 (baseline x86-64, -O2) can copy such a chosen 16-byte value through an MMX
/// register, which leaves the caller's x87 stack full and its next long double NaN (test_x87,
/// and the no_mmx checks in tests/CMakeLists.txt).
template <class T>
GRADAVG_HOT_ byte_range bytes_of(const T* p, std::size_t n) noexcept {
  const auto* b = reinterpret_cast<const std::byte*>(p);
  return {b, b + n * sizeof(T)};
}

/// What the checks and the kernel need of one gradient, read once.
template <class S>
struct gradient_read {
  const S* data = nullptr;
  shape dims;
  bool present = false;
  bool contiguous = true;

  [[nodiscard]] byte_range bytes() const noexcept { return bytes_of(data, present ? dims.size() : 0); }
};

/// Entry e's gradient, read as S. Validation reads through read_gradient_at, which names the
/// variable and tower in the errors of tensor_traits functions.
template <class TG, class S = default_value_t<gradient_tensor_t<TG>>>
GRADAVG_HOT_ gradient_read<S> read_gradient(const entry_t<TG>& e) {
  using G = gradient_tensor_t<TG>;
  gradient_read<S> r;
  auto&& s = entry_traits<entry_t<TG>>::gradient(e);
  if (!slot_present(s)) return r;
  const G& g = slot_get(s);
  r.data = typed_data<S>(g);
  r.dims = tensor_traits<G>::shape(g);
  r.present = true;
  r.contiguous = is_contiguous(g);
  return r;
}

/// read_gradient of tower k's entry e of variable i, for the checks.
template <class TG, class S = default_value_t<gradient_tensor_t<TG>>>
GRADAVG_HOT_ gradient_read<S> read_gradient_at(const TG& tg, const entry_t<TG>& e, std::size_t k, std::size_t i) {
  try {
    return read_gradient<TG, S>(e);
  } catch (const error&) {
    rethrow_located(tg, i, "gradient on tower " + std::to_string(k));
  }
}

template <class TG, class S = default_value_t<gradient_tensor_t<TG>>>
GRADAVG_HOT_ auto read_gradient(const TG& tg, std::size_t tower, std::size_t i) {
  return with_entry(tg, tower, i, [&tg, tower, i](const entry_t<TG>& e) { return read_gradient_at<TG, S>(tg, e, tower, i); });
}

/// Tower k's gradient of variable i's first element; the caller has checked that it is present.
template <class TG, class S = default_value_t<gradient_tensor_t<TG>>>
GRADAVG_HOT_ auto gradient_data(const TG& tg, std::size_t tower, std::size_t i) {
  return with_entry(tg, tower, i, [](const entry_t<TG>& e) -> const S* {
    auto&& s = entry_traits<entry_t<TG>>::gradient(e);
    return typed_data<S>(slot_get(s));
  });
}

/// A copy of tower 0's variable i.
template <class TG>
variable_t<TG> variable_copy(const TG& tg, std::size_t i) {
  return with_entry(tg, 0, i,
                    [](const entry_t<TG>& e) { return variable_t<TG>(entry_traits<entry_t<TG>>::variable(e)); });
}

// ---- Messages (built only when something is wrong). -----------------------------------------

/// What variable_traits<V>::print writes, or "" when it writes nothing or throws.
template <class V>
std::string printed(const V& v) noexcept {
  try {
    std::ostringstream os;
    variable_traits<V>::print(os, v);
    return os.str();
  } catch (...) {
    return {};
  }
}

/// "variable #3 'conv1/weights'", or "variable #3" when the variable cannot be printed.
template <class V>
std::string describe_variable(std::size_t i, const V& v) {
  const std::string p = printed(v);
  std::string s = "variable #" + std::to_string(i);
  if (!p.empty()) s.append(" '").append(p).append("'");
  return s;
}

template <class V>
std::string describe_value(const V& v) {
  const std::string p = printed(v);
  if (p.empty()) return "(unprintable)";
  return std::string("'").append(p).append("'");
}

/// describe_variable of tower 0's variable i.
template <class TG>
std::string describe_variable_at(const TG& tg, std::size_t i) {
  return with_entry(tg, 0, i, [i](const entry_t<TG>& e) {
    return describe_variable(i, entry_traits<entry_t<TG>>::variable(e));
  });
}

/// Throws, with message and variable index i, an exception of the first of Types that e is (most
/// derived types first), or a gradavg::error.
template <class Type, class... Types>
[[noreturn]] void throw_same_type(const error& e, const std::string& message, std::size_t i) {
  if (dynamic_cast<const Type*>(&e) != nullptr) throw Type(message, i);
  if constexpr (sizeof...(Types) > 0)
    throw_same_type<Types...>(e, message, i);
  else
    throw error(message, i);
}

/// Inside a catch block: rethrows the current exception, and a gradavg::error that names no
/// variable as one of the same type naming variable i and `what` (e.g. "gradient on tower 2").
template <class TG>
void rethrow_located(const TG& tg, std::size_t i, const std::string& what) {
  try {
    throw;
  } catch (const error& e) {
    if (e.variable_index() != error::npos) throw;
    std::string message = e.what();
    if (message.rfind("gradavg: ", 0) == 0) message.erase(0, 9);
    throw_same_type<weight_error, option_error, tower_error, shape_error, element_type_error, unsupported_tensor_error,
                    missing_gradient_error, variable_mismatch_error, output_error, aliasing_error>(
        e, describe_variable_at(tg, i) + ": " + what + ": " + message, i);
  }
}

inline std::string describe_shape(const shape& s) {
  std::string out = "[";
  for (std::size_t d = 0; d < s.rank; ++d) out += (d ? ", " : "") + std::to_string(s.dims[d]);
  out += "]";
  if (s.rank >= 2) out += s.order == storage_order::row_major ? " row-major" : " col-major";
  return out;
}

/// "1, 3 and 4": the first `listed` of `total` towers; "0, 1, ..., 15, ... (40 in all)" when
/// not all are listed.
inline std::string describe_towers(const std::size_t* towers, std::size_t listed, std::size_t total) {
  std::string out;
  for (std::size_t n = 0; n < listed; ++n) {
    if (n > 0) out += (n + 1 == listed && listed == total) ? " and " : ", ";
    out += std::to_string(towers[n]);
  }
  if (total > listed) out += ", ... (" + std::to_string(total) + " in all)";
  return out;
}

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

/// Throws the first of variable_mismatch_error, missing_gradient_error, shape_error that
/// variable i has, in that order of precedence.
template <class TG>
void validate_variable(const TG& tg, std::size_t i) {
  using V = variable_t<TG>;
  using E = entry_t<TG>;
  const std::size_t tower_count = std::ranges::size(tg);
  if constexpr (comparable_variable<V>) {
    bool all_same = true;
    with_entry(tg, 0, i, [&](const E& e0) {
      auto&& v0 = entry_traits<E>::variable(e0);
      for (std::size_t k = 1; k < tower_count && all_same; ++k)
        with_entry(tg, k, i,
                   [&](const E& ek) { all_same = variable_traits<V>::same(v0, entry_traits<E>::variable(ek)); });
    });
    if (!all_same) throw_variable_mismatch(tg, i);
  }

  std::size_t present = 0;
  for (std::size_t k = 0; k < tower_count; ++k) present += read_gradient(tg, k, i).present ? 1 : 0;
  if (present == 0) return;  // skipped: absent on every tower
  if (present != tower_count) {
    constexpr std::size_t max_listed = 16;
    std::size_t absent_towers[max_listed]{}, present_towers[max_listed]{};
    std::size_t absent_listed = 0, present_listed = 0;
    for (std::size_t k = 0; k < tower_count; ++k) {
      if (read_gradient(tg, k, i).present) {
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

  const shape s0 = read_gradient(tg, 0, i).dims;
  for (std::size_t k = 0; k < tower_count; ++k) {
    const auto gk = read_gradient(tg, k, i);
    if (k > 0 && !(gk.dims == s0))
      throw shape_error(describe_variable_at(tg, i) + ": gradient on tower " + std::to_string(k) + " has shape " +
                            describe_shape(gk.dims) + " but on tower 0 has shape " + describe_shape(s0),
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

template <class R>
using output_slot_t = std::remove_cvref_t<std::ranges::range_reference_t<R>>;

template <class R>
using output_tensor_t = std::remove_cvref_t<decltype(slot_get(std::declval<std::ranges::range_reference_t<R>>()))>;

/// A range with one output slot per variable, each giving write access to a tensor (a const
/// range of Eigen maps, say, does not).
template <class R>
concept output_range =
    std::ranges::random_access_range<R> && std::ranges::sized_range<R> && slot<output_slot_t<R>> &&
    writable_tensor<output_tensor_t<R>> && requires(std::ranges::range_reference_t<R> s) {
      tensor_traits<output_tensor_t<R>>::mutable_data(slot_get(s));
    };

/// Outputs yielded by value must be views too, or the results would be written into temporaries.
template <class R>
inline constexpr bool outputs_outlive_reads =
    std::is_lvalue_reference_v<std::ranges::range_reference_t<R>> || borrowed_slot<output_slot_t<R>>();

/// What the checks and the kernel need of one output, read once.
template <class S>
struct output_read {
  S* data = nullptr;
  shape dims;
  bool present = false;
  bool contiguous = true;
};

template <class Outputs, class O = default_value_t<output_tensor_t<Outputs&>>>
GRADAVG_HOT_ output_read<O> read_output(Outputs& outputs, std::size_t i) {
  using T = output_tensor_t<Outputs&>;
  output_read<O> r;
  auto&& s = at(outputs, i);
  if (!slot_present(s)) return r;
  auto& t = slot_get(s);
  r.data = typed_mutable_data<O>(t);
  r.dims = tensor_traits<T>::shape(t);
  r.present = true;
  r.contiguous = is_contiguous(t);
  return r;
}

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

/// How many towers weigh more than 0 (summary::weighted_towers).
inline std::size_t positive_weights(std::span<const double> weights) noexcept {
  return static_cast<std::size_t>(std::count_if(weights.begin(), weights.end(), [](double w) { return w > 0; }));
}

/// Whether a sum of weights can be the divisor in the accumulator type whose largest finite value
/// is accumulator_max: positive, normal and finite there.
inline bool usable_weight_sum(double sum, double accumulator_max) noexcept {
  const double smallest = accumulator_max > 1e300 ? std::numeric_limits<double>::min()
                                                  : static_cast<double>(std::numeric_limits<float>::min());
  return sum >= smallest && sum <= accumulator_max;
}

/// Checks the options of the fused step against T towers and V variables (option_error,
/// weight_error), before anything is written. accumulator_max: the largest finite value of the
/// accumulator type, which the scale, every weight and the weights' sum are converted to.
/// partial_weights: the towers are one rank's part of a call across ranks (gradavg::mpi): their
/// weights may sum to 0 (the sum over every rank is checked once the ranks' sums are known).
inline void validate_options(const options& opts, std::size_t towers, std::size_t variables,
                             double accumulator_max, bool partial_weights = false) {
  if (!opts.weights.empty()) {
    if (opts.weights.size() != towers)
      throw weight_error("gradavg: options.weights holds " + std::to_string(opts.weights.size()) +
                         " weights but there are " + std::to_string(towers) + " towers; pass one per tower");
    double sum = 0;
    for (std::size_t k = 0; k < towers; ++k) {
      const double w = opts.weights[k];
      if (!std::isfinite(w) || w < 0 || w > accumulator_max)
        throw weight_error("gradavg: options.weights: the weight of tower " + std::to_string(k) + " is " +
                           describe_number(w) + "; weights must be finite (in the accumulator type) and >= 0");
      sum += w;
    }
    // The sum becomes the divisor in the accumulator type: it must stay positive and finite there.
    if (!(partial_weights ? sum <= accumulator_max : usable_weight_sum(sum, accumulator_max)))
      throw weight_error("gradavg: options.weights sum to " + describe_number(sum) +
                         "; the sum must be positive and finite (a normal number in the accumulator type)");
  }
  if (!std::isfinite(opts.scale) || std::abs(opts.scale) > accumulator_max)
    throw option_error("gradavg: options.scale is " + describe_number(opts.scale) +
                       "; it must be finite (in the accumulator type)");
  // The scale is folded into every tower's weight: each product must stay finite there too.
  for (std::size_t k = 0; k < opts.weights.size(); ++k)
    if (std::abs(opts.weights[k] * opts.scale) > accumulator_max)
      throw weight_error("gradavg: options.weights: the weight of tower " + std::to_string(k) + " times options.scale is " +
                         describe_number(opts.weights[k] * opts.scale) + ", beyond the accumulator type's range");
  if (!std::isfinite(opts.samples_per_tower) || opts.samples_per_tower < 0)
    throw option_error("gradavg: options.samples_per_tower is " + describe_number(opts.samples_per_tower) +
                       "; it must be finite and >= 0 (0: unknown)");
  if (opts.range.begin > opts.range.end)
    throw option_error("gradavg: options.range begins at " + std::to_string(opts.range.begin) + " after its end " +
                       std::to_string(opts.range.end));
  if (!opts.per_variable.empty() && opts.per_variable.size() != variables)
    throw option_error("gradavg: options.per_variable holds " + std::to_string(opts.per_variable.size()) +
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
      throw output_error(describe_variable_at(tg, i) + ": the " + what + " output has shape " + describe_shape(out.dims) +
                             " but the gradient has shape " + describe_shape(g0.dims),
                         i);
    if (!out.contiguous)
      throw output_error(describe_variable_at(tg, i) + ": the " + what + " output is not contiguous (strided)", i);
  }
}

/// Throws the first output error of a validated tower_grads, in the order: means, include_square
/// without squares, squares. Returns when there is none.
template <class TG, class Means, class Squares>
void validate_all_outputs(const TG& tg, Means& means, Squares* squares, std::size_t variable_count,
                          const options& opts) {
  validate_outputs(tg, means, variable_count, "means");
  if constexpr (std::is_same_v<Squares, std::nullptr_t>) {
    if (opts.include_square)
      throw output_error(
          "gradavg: options.include_square is set but no squares outputs were passed to average_gradients_into");
  } else {
    validate_outputs(tg, *squares, variable_count, "squares");
  }
}

// ---- Overlaps. -----------------------------------------------------------------------------

/// Throws the aliasing_error for two overlapping buffers, at least one of them an output.
template <class TG>
[[noreturn]] void throw_overlap(const TG& tg, tagged_range a, tagged_range b) {
  // The subject is an output: the one of the lower variable (means before squares) if both are.
  auto key = [](const tagged_range& r) { return std::pair(r.variable, static_cast<int>(r.kind)); };
  if (a.kind == tagged_range::gradient || (b.kind != tagged_range::gradient && key(b) < key(a))) std::swap(a, b);
  auto name = [](tagged_range::kind_t k) { return k == tagged_range::means ? "means" : "squares"; };
  const bool same = a.variable == b.variable;
  std::string other;
  if (b.kind == tagged_range::gradient)
    other = (same ? "its gradient on tower " : "the gradient on tower ") + std::to_string(b.tower);
  else
    other = std::string(same ? "its " : "the ") + name(b.kind) + " output";
  if (!same) other += " of " + describe_variable_at(tg, b.variable);
  throw aliasing_error(describe_variable_at(tg, a.variable) + ": the " + name(a.kind) + " output overlaps " + other +
                           "; outputs may overlap nothing, except that means[i] may be tower 0's gradient i "
                           "itself (averaging in place)",
                       a.variable);
}

/// Sorts ranges by start address. With scratch (room for count more), large inputs are radix
/// sorted on the address bits that differ between them (8 at a time, O(N) per pass: a few
/// passes for buffers within a few GiB of each other); otherwise std::sort, O(N log N).
inline void sort_by_address(tagged_range* ranges, std::size_t count, tagged_range* scratch) {
  auto key = [](const tagged_range& r) { return reinterpret_cast<std::uintptr_t>(r.bytes.first); };
  if (scratch == nullptr || count < 128) {
    std::sort(ranges, ranges + count, [&key](const tagged_range& a, const tagged_range& b) { return key(a) < key(b); });
    return;
  }
  std::uintptr_t all = ~std::uintptr_t{0}, any = 0;
  for (std::size_t n = 0; n < count; ++n) {
    all &= key(ranges[n]);
    any |= key(ranges[n]);
  }
  const std::uintptr_t varying = all ^ any;
  if (varying == 0) return;
  constexpr int digit_bits = 8;
  tagged_range* from = ranges;
  tagged_range* to = scratch;
  const int end = static_cast<int>(std::bit_width(varying));
  for (int shift = std::countr_zero(varying); shift < end; shift += digit_bits) {
    std::size_t start[(1 << digit_bits) + 1] = {};
    auto digit = [&](const tagged_range& r) { return (key(r) >> shift) & ((1u << digit_bits) - 1); };
    for (std::size_t n = 0; n < count; ++n) ++start[digit(from[n]) + 1];
    for (std::size_t d = 1; d <= (1 << digit_bits); ++d) start[d] += start[d - 1];
    for (std::size_t n = 0; n < count; ++n) to[start[digit(from[n])]++] = from[n];
    std::swap(from, to);
  }
  if (from != ranges) std::copy(from, from + count, ranges);
}

/// Sorts the ranges by address and sweeps them once: throws for the first overlap that involves
/// an output (gradients may overlap one another: they are only read). `scratch`: room for count
/// more ranges, or null.
template <class TG>
void check_overlaps(const TG& tg, tagged_range* ranges, std::size_t count, tagged_range* scratch) {
  const std::less<const std::byte*> before;
  sort_by_address(ranges, count, scratch);
  // The range reaching furthest among all seen so far, and among the outputs seen so far: a
  // range overlaps an earlier one exactly when it starts before the furthest earlier end.
  const tagged_range* furthest = nullptr;
  const tagged_range* furthest_output = nullptr;
  for (std::size_t n = 0; n < count; ++n) {
    const tagged_range& r = ranges[n];
    const bool output = r.kind != tagged_range::gradient;
    if (output && furthest && before(r.bytes.first, furthest->bytes.last)) throw_overlap(tg, *furthest, r);
    if (!output && furthest_output && before(r.bytes.first, furthest_output->bytes.last))
      throw_overlap(tg, *furthest_output, r);
    if (!furthest || before(furthest->bytes.last, r.bytes.last)) furthest = &r;
    if (output && (!furthest_output || before(furthest_output->bytes.last, r.bytes.last))) furthest_output = &r;
  }
}

/// Where the single pass puts every buffer's bytes, in the order of layout_cache: for each
/// variable its gradient on every tower, its means, its squares (when passed). Empty ranges
/// stand for absent gradients and for the outputs of skipped variables.
struct layout_writer {
  byte_range* slots = nullptr;  // null: nothing kept
  std::size_t count = 0;
  bool same = false;  // every range equals the one already there

  void put(const byte_range& r) noexcept {
    if (slots == nullptr) return;
    if (same && slots[count] == r) {  // a repeated layout is only read, not written again
      ++count;
      return;
    }
    same = false;  // from here on the old ranges are not read (uninitialised in stack scratch)
    slots[count++] = r;
  }
};

/// The ranges the sweep must see, from a layout: the non-empty ones. A means output in place
/// into tower 0's gradient stands for both (one range, an output), so it may overlap nothing else
/// — not even the same variable's gradient on another tower.
inline std::size_t tag_ranges(const byte_range* layout, std::size_t variable_count, std::size_t tower_count,
                              bool with_squares, tagged_range* out) {
  const std::size_t stride = tower_count + (with_squares ? 2 : 1);
  std::size_t n = 0;
  for (std::size_t i = 0; i < variable_count; ++i) {
    const byte_range* v = layout + i * stride;
    const bool in_place = !v[0].empty() && v[tower_count] == v[0];
    for (std::size_t k = in_place ? 1 : 0; k < stride; ++k) {
      if (v[k].empty()) continue;
      const auto kind =
          k < tower_count ? tagged_range::gradient : k == tower_count ? tagged_range::means : tagged_range::squares;
      out[n++] = tagged_range{v[k], i, k < tower_count ? k : 0, kind};
    }
  }
  return n;
}

/// Layouts of at most this many ranges are checked on the stack when no layout_cache is passed.
inline constexpr std::size_t stack_ranges = 256;

/// Scratch memory of one call without a layout_cache: on the stack (left uninitialised, so it
/// costs nothing to declare) unless the layout is larger than stack_ranges.
struct check_scratch {
  std::array<byte_range, stack_ranges> layout;
  std::array<tagged_range, stack_ranges> tagged;
  std::unique_ptr<byte_range[]> heap_layout;  // new T[n]: left uninitialised, like the arrays
  std::unique_ptr<tagged_range[]> heap_tagged;
};

/// What validate_into found: the counts, and the layout the kernel may read pointers from.
struct validated {
  std::size_t variables = 0;
  std::size_t averaged = 0;
  std::size_t skipped = 0;
  std::size_t elements = 0;  // of every averaged variable
  const byte_range* layout = nullptr;  // null: the kernel reads the entries again
};

/// Every check of average_gradients_into, reading each gradient and output once (data(), shape(),
/// contiguity, the variable), in one pass over the variables. Errors keep their precedence:
/// towers and gradients first (variable by variable), then outputs, then overlaps. `stack` holds
/// the layout when no cache is given and it fits; `heap` when neither holds and the full
/// check needs it (the one allocation, documented in options.hpp).
/// S and O: the element types the gradients are read as and the outputs written as (the traits'
/// value_type, or the run-time type validate_elements found).
template <class TG, class Means, class Squares, class S = default_value_t<gradient_tensor_t<TG>>,
          class O = default_value_t<output_tensor_t<Means&>>>
validated validate_into(const TG& tg, Means& means, Squares* squares, const options& opts, check_scratch& scratch) {
  using V = variable_t<TG>;
  using E = entry_t<TG>;
  constexpr bool with_squares = !std::is_same_v<Squares, std::nullptr_t>;
  const std::size_t variable_count = validate_tower_counts(tg);
  const std::size_t tower_count = std::ranges::size(tg);

  bool outputs_counted = std::ranges::size(means) == variable_count && (with_squares || !opts.include_square);
  if constexpr (with_squares) outputs_counted = outputs_counted && std::ranges::size(*squares) == variable_count;
  if (!outputs_counted) {
    validate_towers(tg);
    validate_all_outputs(tg, means, squares, variable_count, opts);
  }

  // Where the layout goes.
  const std::size_t stride = tower_count + (with_squares ? 2 : 1);
  const std::size_t slots = variable_count * stride;
  const bool full = opts.aliasing == alias_check::all;
  layout_writer layout;
  if (opts.layout != nullptr) {
    auto& kept = layout_cache_access::layout(*opts.layout);
    bool& proved = layout_cache_access::proved(*opts.layout);
    layout.same = proved && kept.size() == slots && layout_cache_access::towers(*opts.layout) == tower_count &&
                  layout_cache_access::squares(*opts.layout) == with_squares;
    proved = false;  // until this call's layout passes
    kept.resize(slots);
    layout.slots = kept.data();
  } else if (slots <= stack_ranges) {
    layout.slots = scratch.layout.data();
  } else if (full) {
    scratch.heap_layout.reset(new byte_range[slots]);
    layout.slots = scratch.heap_layout.get();
  }

  validated result;
  result.variables = variable_count;
  bool output_problem = false;
  std::optional<std::pair<tagged_range, tagged_range>> own_overlap;  // alias_check::same_variable
  auto tag = [](byte_range b, std::size_t i, std::size_t k, tagged_range::kind_t kind) {
    return tagged_range{b, i, k, kind};
  };

  for (std::size_t i = 0; i < variable_count; ++i) {
    with_entry(tg, 0, i, [&](const E& e0) {
      auto&& v0 = entry_traits<E>::variable(e0);
      const gradient_read<S> g0 = read_gradient_at<TG, S>(tg, e0, 0, i);
      const byte_range g0_bytes = g0.bytes();
      output_read<O> m, q;
      if (g0.present) {
        m = read_output_at<TG, Means, O>(tg, means, i, "means");
        output_problem = output_problem || !m.present || !output_fits(m.dims, g0.dims) || !m.contiguous;
        if constexpr (with_squares) {
          q = read_output_at<TG, Squares, O>(tg, *squares, i, "squares");
          output_problem = output_problem || !q.present || !output_fits(q.dims, g0.dims) || !q.contiguous;
        }
      }
      const std::size_t elements = g0.present ? g0.dims.size() : 0;  // of each output
      const byte_range m_bytes = bytes_of(m.data, m.present ? elements : 0);
      const byte_range q_bytes = bytes_of(q.data, q.present ? elements : 0);
      const bool check_own = opts.aliasing == alias_check::same_variable && g0.present && !own_overlap;
      auto check_own_gradient = [&](const byte_range& g, std::size_t k) {
        if (!check_own || own_overlap) return;
        if (m_bytes.overlaps(g) && !(k == 0 && m_bytes == g))
          own_overlap.emplace(tag(m_bytes, i, 0, tagged_range::means), tag(g, i, k, tagged_range::gradient));
        else if (q_bytes.overlaps(g))
          own_overlap.emplace(tag(q_bytes, i, 0, tagged_range::squares), tag(g, i, k, tagged_range::gradient));
      };

      bool problem = !g0.contiguous;
      std::size_t present = g0.present ? 1 : 0;
      layout.put(g0_bytes);
      check_own_gradient(g0_bytes, 0);
      for (std::size_t k = 1; k < tower_count; ++k) {
        with_entry(tg, k, i, [&](const E& ek) {
          if constexpr (comparable_variable<V>) {
            auto&& vk = entry_traits<E>::variable(ek);
            if (!variable_traits<V>::same(v0, vk)) validate_variable(tg, i);  // throws the mismatch
          }
          const gradient_read<S> gk = read_gradient_at<TG, S>(tg, ek, k, i);
          present += gk.present ? 1 : 0;
          problem = problem || (gk.present && (!(gk.dims == g0.dims) || !gk.contiguous));
          layout.put(gk.bytes());
          check_own_gradient(gk.bytes(), k);
        });
      }
      if (present != 0 && present != tower_count) problem = true;
      if (problem) {
        validate_variable(tg, i);  // throws the precise error
        throw shape_error(describe_variable_at(tg, i) + ": its gradients changed while being read", i);
      }
      layout.put(m_bytes);
      if constexpr (with_squares) layout.put(q_bytes);
      if (check_own && !own_overlap && m_bytes.overlaps(q_bytes))
        own_overlap.emplace(tag(m_bytes, i, 0, tagged_range::means), tag(q_bytes, i, 0, tagged_range::squares));
      ++(g0.present ? result.averaged : result.skipped);
      result.elements += g0.present ? g0.dims.size() : 0;
    });
  }

  if (output_problem) {
    validate_all_outputs(tg, means, squares, variable_count, opts);
    throw output_error("gradavg: an output changed while being read");
  }
  if (own_overlap) throw_overlap(tg, own_overlap->first, own_overlap->second);

  if (full && !layout.same) {
    // Room for the ranges and as many again for the radix sort, except on the stack.
    tagged_range* tagged = scratch.tagged.data();
    tagged_range* sort_scratch = nullptr;
    if (opts.layout != nullptr) {
      auto& kept = layout_cache_access::sorted(*opts.layout);
      kept.resize(2 * slots);
      tagged = kept.data();
    } else if (slots > stack_ranges) {
      scratch.heap_tagged.reset(new tagged_range[2 * slots]);
      tagged = scratch.heap_tagged.get();
    }
    if (tagged != scratch.tagged.data()) sort_scratch = tagged + slots;
    check_overlaps(tg, tagged, tag_ranges(layout.slots, variable_count, tower_count, with_squares, tagged),
                   sort_scratch);
  }
  if (opts.layout != nullptr) {
    // Remembered as proved only for the full check: a cache hit skips it.
    layout_cache_access::towers(*opts.layout) = tower_count;
    layout_cache_access::squares(*opts.layout) = with_squares;
    layout_cache_access::proved(*opts.layout) = full;
  }
  result.layout = layout.slots;
  return result;
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
