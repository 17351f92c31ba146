// gradavg internals: reading tower_grads, and every check made before anything is written.
#pragma once

#include <cstddef>
#include <functional>
#include <ranges>
#include <sstream>
#include <string>
#include <type_traits>

#include "isa.hpp"
#include "../entry.hpp"
#include "../errors.hpp"
#include "../options.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

// ---- Access to tower_grads[k][i]. ----------------------------------------------------------

template <class R>
constexpr decltype(auto) at(R&& r, std::size_t i) {
  return std::ranges::begin(r)[static_cast<std::ranges::range_difference_t<R>>(i)];
}

template <class TG>
using tower_ref_t = std::ranges::range_reference_t<const TG>;
template <class TG>
using entry_t = std::remove_cvref_t<std::ranges::range_reference_t<std::remove_reference_t<tower_ref_t<TG>>>>;
template <class TG>
using gradient_slot_t =
    std::remove_cvref_t<decltype(entry_traits<entry_t<TG>>::gradient(std::declval<const entry_t<TG>&>()))>;
template <class TG>
using variable_t =
    std::remove_cvref_t<decltype(entry_traits<entry_t<TG>>::variable(std::declval<const entry_t<TG>&>()))>;
template <class TG>
using gradient_tensor_t = slot_tensor_t<gradient_slot_t<TG>>;

template <class TG>
constexpr decltype(auto) entry_at(const TG& tg, std::size_t tower, std::size_t i) {
  return at(at(tg, tower), i);
}
template <class TG>
constexpr decltype(auto) gradient_slot_at(const TG& tg, std::size_t tower, std::size_t i) {
  return entry_traits<entry_t<TG>>::gradient(entry_at(tg, tower, i));
}
template <class TG>
constexpr decltype(auto) variable_at(const TG& tg, std::size_t tower, std::size_t i) {
  return entry_traits<entry_t<TG>>::variable(entry_at(tg, tower, i));
}
/// Tower k's gradient of variable i; the caller has checked that it is present.
template <class TG>
constexpr decltype(auto) gradient_at(const TG& tg, std::size_t tower, std::size_t i) {
  return slot_get(gradient_slot_at(tg, tower, i));
}
template <class TG>
constexpr bool is_skipped(const TG& tg, std::size_t i) {
  // After validation, absent on tower 0 means absent on every tower.
  return !slot_present(gradient_slot_at(tg, 0, i));
}

// ---- Messages. -----------------------------------------------------------------------------

/// "variable #3 'conv1/weights'", or "variable #3" when the variable cannot be printed.
template <class V>
std::string describe_variable(std::size_t i, const V& v) {
  std::ostringstream printed;
  variable_traits<V>::print(printed, v);
  std::string s = "variable #" + std::to_string(i);
  if (!printed.str().empty()) s.append(" '").append(printed.str()).append("'");
  return s;
}

template <class V>
std::string describe_value(const V& v) {
  std::ostringstream printed;
  variable_traits<V>::print(printed, v);
  if (printed.str().empty()) return "(unprintable)";
  return std::string("'").append(printed.str()).append("'");
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

/// Checks tower_grads as a whole and returns the number of variables. Throws tower_error,
/// variable_mismatch_error, missing_gradient_error or shape_error.
template <class TG>
std::size_t validate_towers(const TG& tg) {
  using V = variable_t<TG>;
  using G = gradient_tensor_t<TG>;
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

  for (std::size_t i = 0; i < variable_count; ++i) {
    const V& v0 = variable_at(tg, 0, i);
    if constexpr (comparable_variable<V>) {
      for (std::size_t k = 1; k < tower_count; ++k) {
        const V& vk = variable_at(tg, k, i);
        if (!variable_traits<V>::same(v0, vk))
          throw variable_mismatch_error(describe_variable(i, v0) + ": tower " + std::to_string(k) + " has variable " +
                                            describe_value(vk) + " at this position but tower 0 has " +
                                            describe_value(v0) + "; every tower must list the same variables in the "
                                            "same order",
                                        i);
      }
    }

    std::size_t present = 0;
    for (std::size_t k = 0; k < tower_count; ++k) present += slot_present(gradient_slot_at(tg, k, i)) ? 1 : 0;
    if (present == 0) continue;  // skipped: absent on every tower
    if (present != tower_count) {
      constexpr std::size_t max_listed = 16;
      std::size_t listed[max_listed];
      std::size_t count = 0;
      for (std::size_t k = 0; k < tower_count && count < max_listed; ++k)
        if (!slot_present(gradient_slot_at(tg, k, i))) listed[count++] = k;
      const std::string missing = describe_towers(listed, count, tower_count - present);
      throw missing_gradient_error(describe_variable(i, v0) + ": gradient missing on tower" +
                                       (tower_count - present > 1 ? "s " : " ") + missing + " of " +
                                       std::to_string(tower_count) + " but present on " + std::to_string(present) +
                                       "; a gradient must be present on every tower or on none",
                                   i);
    }

    const G& g0 = gradient_at(tg, 0, i);
    const shape s0 = tensor_traits<G>::shape(g0);
    for (std::size_t k = 0; k < tower_count; ++k) {
      const G& gk = gradient_at(tg, k, i);
      if (k > 0) {
        const shape sk = tensor_traits<G>::shape(gk);
        if (!(sk == s0))
          throw shape_error(describe_variable(i, v0) + ": gradient on tower " + std::to_string(k) + " has shape " +
                                describe_shape(sk) + " but on tower 0 has shape " + describe_shape(s0),
                            i);
      }
      if (!is_contiguous(gk))
        throw shape_error(describe_variable(i, v0) + ": gradient on tower " + std::to_string(k) +
                              " is not contiguous (strided); pass a contiguous tensor or a copy",
                          i);
    }
  }
  return variable_count;
}

// ---- Checks on the outputs. ----------------------------------------------------------------

template <class R>
using output_slot_t = std::remove_cvref_t<std::ranges::range_reference_t<R>>;

/// The element pointer of an output slot (non-const access through the range's reference).
template <class Slot>
auto output_data(Slot&& s) {
  auto& t = slot_get(s);
  return tensor_traits<std::remove_cvref_t<decltype(t)>>::mutable_data(t);
}

template <class R>
using output_tensor_t = std::remove_cvref_t<decltype(slot_get(std::declval<std::ranges::range_reference_t<R>>()))>;

/// A range with one output slot per variable, each giving write access to a tensor (a const
/// range of Eigen maps, say, does not).
template <class R>
concept output_range =
    std::ranges::random_access_range<R> && std::ranges::sized_range<R> && slot<output_slot_t<R>> &&
    requires(std::ranges::range_reference_t<R> s) {
      { tensor_traits<output_tensor_t<R>>::mutable_data(slot_get(s)) } -> std::same_as<tensor_value_t<output_tensor_t<R>>*>;
    };

/// Checks one output range (what = "means" or "squares") against validated tower_grads.
template <class TG, class Outputs>
void validate_outputs(const TG& tg, Outputs& outputs, std::size_t variable_count, const char* what) {
  using G = gradient_tensor_t<TG>;
  using O = output_tensor_t<Outputs&>;
  const std::size_t n = std::ranges::size(outputs);
  if (n != variable_count)
    throw output_error(std::string("gradavg: ") + what + " holds " + std::to_string(n) + " outputs but the towers hold " +
                       std::to_string(variable_count) + " variables; pass one output per variable (skipped ones are "
                       "left untouched)");
  for (std::size_t i = 0; i < variable_count; ++i) {
    if (is_skipped(tg, i)) continue;
    auto&& slot = at(outputs, i);
    if (!slot_present(slot))
      throw output_error(describe_variable(i, variable_at(tg, 0, i)) + ": the " + what + " output is null", i);
    const O& out = slot_get(slot);
    const shape expected = tensor_traits<G>::shape(gradient_at(tg, 0, i));
    const shape got = tensor_traits<O>::shape(out);
    if (!(got == expected))
      throw output_error(describe_variable(i, variable_at(tg, 0, i)) + ": the " + what + " output has shape " +
                             describe_shape(got) + " but the gradient has shape " + describe_shape(expected),
                         i);
    if (!is_contiguous(out))
      throw output_error(describe_variable(i, variable_at(tg, 0, i)) + ": the " + what +
                             " output is not contiguous (strided)",
                         i);
  }
}

/// Bytes a tensor occupies.
struct byte_range {
  const std::byte* first = nullptr;
  const std::byte* last = nullptr;  // one past the end

  [[nodiscard]] bool empty() const noexcept { return first == last; }
  [[nodiscard]] bool overlaps(const byte_range& o) const noexcept {
    const std::less<const std::byte*> before;
    return !empty() && !o.empty() && before(first, o.last) && before(o.first, last);
  }
  friend bool operator==(const byte_range&, const byte_range&) = default;
};

template <class T>
byte_range bytes_of(const T& t) {
  const auto* p = reinterpret_cast<const std::byte*>(tensor_traits<T>::data(t));
  return {p, p + tensor_traits<T>::shape(t).size() * sizeof(tensor_value_t<T>)};
}

/// Enforces the aliasing rule of average_gradients_into: means[i] may be tower 0's gradient i
/// itself (same bytes); no other output overlaps any gradient or any other output.
template <class TG, class Means, class Squares>
void validate_aliasing(const TG& tg, Means& means, Squares* squares, std::size_t variable_count, alias_check mode) {
  if (mode == alias_check::none) return;
  using O = output_tensor_t<Means&>;
  const std::size_t tower_count = std::ranges::size(tg);

  auto output_bytes = [&](std::size_t i, bool square) -> byte_range {
    if constexpr (std::is_same_v<Squares, std::nullptr_t>) {
      (void)square;
      return bytes_of<O>(slot_get(at(means, i)));
    } else {
      using OS = output_tensor_t<Squares&>;
      return square ? bytes_of<OS>(slot_get(at(*squares, i))) : bytes_of<O>(slot_get(at(means, i)));
    }
  };
  auto fail = [&](std::size_t i, bool square, const std::string& other) {
    throw aliasing_error(describe_variable(i, variable_at(tg, 0, i)) + ": the " + (square ? "squares" : "means") +
                             " output overlaps " + other +
                             "; outputs may overlap nothing, except that means[i] may be tower 0's gradient i "
                             "itself (averaging in place)",
                         i);
  };
  const bool has_squares = !std::is_same_v<Squares, std::nullptr_t>;
  for (std::size_t i = 0; i < variable_count; ++i) {
    if (is_skipped(tg, i)) continue;
    for (int sq = 0; sq <= (has_squares ? 1 : 0); ++sq) {
      const byte_range out = output_bytes(i, sq == 1);
      const std::size_t first = mode == alias_check::all ? 0 : i;
      const std::size_t last = mode == alias_check::all ? variable_count : i + 1;
      for (std::size_t j = first; j < last; ++j) {
        if (is_skipped(tg, j)) continue;
        const std::string of_other = j == i ? std::string() : " of " + describe_variable(j, variable_at(tg, 0, j));
        for (std::size_t k = 0; k < tower_count; ++k) {
          const byte_range g = bytes_of(gradient_at(tg, k, j));
          const bool in_place = sq == 0 && j == i && k == 0 && out == g;
          if (!in_place && out.overlaps(g))
            fail(i, sq == 1, (j == i ? "its gradient on tower " : "the gradient on tower ") + std::to_string(k) + of_other);
        }
        for (int osq = 0; osq <= (has_squares ? 1 : 0); ++osq) {
          if (j == i && osq == sq) continue;
          if (out.overlaps(output_bytes(j, osq == 1)))
            fail(i, sq == 1, std::string(j == i ? "its " : "the ") + (osq ? "squares" : "means") + " output" + of_other);
        }
      }
    }
  }
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
