// gradavg internals: reading row-sparse gradients and their outputs (sparse.hpp), and every check
// of a call over them, before anything is written.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "access.hpp"
#include "check.hpp"
#include "messages.hpp"
#include "types.hpp"
#include "../errors.hpp"
#include "../options.hpp"
#include "../sparse_types.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

// ---- Gradient slots: a row-sparse gradient, a reference_wrapper to one, or a pointer-like. ----

template <class S>
concept sparse_direct_slot = sparse_tensor<unwrapped_t<S>>;

template <class S>
concept sparse_nullable_slot = !sparse_direct_slot<S> && requires(S& s) {
  static_cast<bool>(s);
  *s;
  requires sparse_tensor<unwrapped_t<std::remove_reference_t<decltype(*s)>>>;
};

template <class S>
concept sparse_slot = sparse_direct_slot<S> || sparse_nullable_slot<S>;

template <class S>
constexpr decltype(auto) sparse_slot_get(S& s) noexcept {
  if constexpr (sparse_direct_slot<std::remove_cvref_t<S>>)
    return unwrap_ref(s);
  else
    return unwrap_ref(*s);
}

template <class S>
using sparse_slot_tensor_t = std::remove_cvref_t<decltype(sparse_slot_get(std::declval<const S&>()))>;

template <class T>
bool sparse_tensor_present(const T& t) {
  if constexpr (requires { { sparse_traits<T>::present(t) } -> std::convertible_to<bool>; })
    return static_cast<bool>(sparse_traits<T>::present(t));
  else
    return true;
}

template <class S>
bool sparse_slot_present(const S& s) {
  if constexpr (sparse_direct_slot<S>)
    return sparse_tensor_present(unwrap_ref(s));
  else
    return static_cast<bool>(s) && sparse_tensor_present(unwrap_ref(*s));
}

template <class TG>
using sparse_gradient_t = sparse_slot_tensor_t<gradient_slot_t<TG>>;
template <class TG>
using sparse_index_t = typename sparse_traits<sparse_gradient_t<TG>>::index_type;
template <class TG>
using sparse_value_t = typename sparse_traits<sparse_gradient_t<TG>>::value_type;

/// Elements per row of a dense shape: the product of its dimensions after the first.
inline std::size_t row_length_of(const shape& dense) noexcept {
  std::size_t n = 1;
  for (std::size_t d = 1; d < dense.rank; ++d) n *= static_cast<std::size_t>(dense.dims[d]);
  return n;
}

/// What the checks and the table need of one row-sparse gradient, read once.
template <class I, class S>
struct sparse_read {
  std::span<const I> indices;
  const S* values = nullptr;
  shape values_dims, dense;
  bool present = false;
  bool contiguous = true;

  [[nodiscard]] std::size_t rows() const noexcept { return static_cast<std::size_t>(dense.dims[0]); }
  [[nodiscard]] std::size_t row_length() const noexcept { return row_length_of(dense); }
};

/// Tower k's gradient of variable i; a gradavg::error of the traits names the variable and tower.
template <class TG>
auto read_sparse(const TG& tg, std::size_t k, std::size_t i) {
  using G = sparse_gradient_t<TG>;
  using R = sparse_read<sparse_index_t<TG>, sparse_value_t<TG>>;
  try {
    return with_entry(tg, k, i, [](const entry_t<TG>& e) {
      R r;
      auto&& s = entry_traits<entry_t<TG>>::gradient(e);
      if (!sparse_slot_present(s)) return r;
      const G& g = sparse_slot_get(s);
      r.indices = sparse_traits<G>::indices(g);
      r.values = sparse_traits<G>::values(g);
      r.values_dims = sparse_traits<G>::values_shape(g);
      r.dense = sparse_traits<G>::dense_shape(g);
      r.present = true;
      if constexpr (requires { { sparse_traits<G>::contiguous(g) } -> std::convertible_to<bool>; })
        r.contiguous = sparse_traits<G>::contiguous(g);
      return r;
    });
  } catch (const error&) {
    rethrow_located(tg, i, "gradient on tower " + std::to_string(k));
  }
}

// ---- Output slots: a writable dense tensor (tensor.hpp's slots) or a sparse_rows. ----------

template <class T>
struct is_sparse_rows : std::false_type {};
template <class I, class V>
struct is_sparse_rows<sparse_rows<I, V>> : std::true_type {};

template <class S>
concept coalesced_direct_slot = is_sparse_rows<unwrapped_t<S>>::value && !std::is_const_v<
    std::remove_reference_t<decltype(unwrap_ref(std::declval<S&>()))>>;

template <class S>
concept coalesced_nullable_slot = !coalesced_direct_slot<S> && requires(S& s) {
  static_cast<bool>(s);
  *s;
  requires is_sparse_rows<unwrapped_t<std::remove_reference_t<decltype(*s)>>>::value;
};

template <class R>
using sparse_output_slot_t = std::remove_reference_t<std::ranges::range_reference_t<R>>;

/// Whether an output range's slots are sparse_rows (the coalesced form), not dense tensors.
template <class R>
inline constexpr bool coalesced_outputs =
    coalesced_direct_slot<std::remove_cv_t<sparse_output_slot_t<R>>> ||
    coalesced_nullable_slot<std::remove_cv_t<sparse_output_slot_t<R>>>;

template <class R>
concept sparse_output_range =
    std::ranges::random_access_range<R> && std::ranges::sized_range<R> && (coalesced_outputs<R> || output_range<R>);

/// The sparse_rows of a coalesced output slot, or null where it is absent.
template <class Slot>
auto* coalesced_target(Slot& s) {
  if constexpr (coalesced_direct_slot<std::remove_cv_t<Slot>>)
    return &unwrap_ref(s);
  else
    return static_cast<bool>(s) ? &unwrap_ref(*s) : nullptr;
}

template <class R>
using coalesced_t = std::remove_pointer_t<decltype(coalesced_target(std::declval<sparse_output_slot_t<R>&>()))>;

/// The element type an output range holds.
template <class R, bool Coalesced = coalesced_outputs<R>>
struct sparse_output_value {
  using type = typename coalesced_t<R>::value_type;
};
template <class R>
struct sparse_output_value<R, false> {
  using type = tensor_value_t<output_tensor_t<R>>;
};

/// Checks one output range (what: "means" or "squares") against the gradients: one output per
/// variable, present for every averaged one; a dense output of the dense shape (output_fits) and
/// contiguous. present[i]: whether variable i is averaged; dense[i]: its dense shape.
template <class TG, class Outputs>
void check_sparse_outputs(const TG& tg, Outputs& outputs, std::span<const unsigned char> present,
                          std::span<const shape> dense, const char* what) {
  const std::size_t variables = present.size();
  if (std::ranges::size(outputs) != variables)
    throw output_error(std::string("gradavg: ") + what + " holds " + std::to_string(std::ranges::size(outputs)) +
                       " outputs but the towers hold " + std::to_string(variables) + " variables; pass one per variable");
  for (std::size_t i = 0; i < variables; ++i) {
    if (!present[i]) continue;
    if constexpr (coalesced_outputs<Outputs&>) {
      if (coalesced_target(at(outputs, i)) == nullptr)
        throw output_error(describe_variable_at(tg, i) + ": its " + what + " output is null but the variable is averaged",
                           i);
    } else {
      const auto o = read_output_at(tg, outputs, i, what);
      if (!o.present)
        throw output_error(describe_variable_at(tg, i) + ": its " + what + " output is null but the variable is averaged",
                           i);
      if (!output_fits(o.dims, dense[i]))
        throw output_error(describe_variable_at(tg, i) + ": its " + what + " output has shape " +
                               describe_output_at(outputs, i) + " but the gradients' dense shape is " +
                               describe_shape(dense[i]),
                           i);
      if (!o.contiguous)
        throw output_error(describe_variable_at(tg, i) + ": its " + what + " output is not contiguous (strided)", i);
    }
  }
}

/// Checks variable i's gradients (variable, presence, shapes, index ranges) and returns whether it
/// is averaged; dense receives its dense shape. Throws variable_mismatch_error,
/// missing_gradient_error, shape_error or index_error, in that order of precedence.
template <class TG>
bool check_sparse_variable(const TG& tg, std::size_t i, shape& dense) {
  const std::size_t towers = std::ranges::size(tg);
  check_same_variable(tg, i);
  if (!check_presence(tg, i, [&](std::size_t k) { return read_sparse(tg, k, i).present; })) return false;
  auto where = [&](std::size_t k) { return describe_variable_at(tg, i) + ": gradient on tower " + std::to_string(k); };
  dense = read_sparse(tg, 0, i).dense;
  for (std::size_t k = 0; k < towers; ++k) {
    const auto g = read_sparse(tg, k, i);
    if (g.dense.rank == 0 || g.dense.order != storage_order::row_major)
      throw shape_error(where(k) + " has dense shape " + describe_shape(g.dense) +
                            "; a row-sparse gradient's dense shape is row-major of rank 1 or more",
                        i);
    if (k > 0 && !(g.dense == dense))
      throw shape_error(where(k) + " has dense shape " + describe_shape(g.dense) + " but on tower 0 has " +
                            describe_shape(dense),
                        i);
    // The values rows: one per index, each of the dense shape's row.
    shape expected = g.dense;
    expected.dims[0] = static_cast<std::int64_t>(g.indices.size());
    if (!(g.values_dims == expected))
      throw shape_error(where(k) + " holds " + std::to_string(g.indices.size()) + " indices and values of shape " +
                            describe_shape(g.values_dims) + "; with dense shape " + describe_shape(g.dense) +
                            " its values must be " + describe_shape(expected),
                        i);
    if (!g.contiguous)
      throw shape_error(where(k) + ": its values rows are not packed (strided); pass contiguous rows or a copy", i);
  }
  return true;
}

/// Throws index_error when an index of tower k's gradient g of variable i names no row.
template <class TG, class Read>
void check_sparse_indices(const TG& tg, std::size_t i, std::size_t k, const Read& g) {
  const auto rows = static_cast<std::int64_t>(g.rows());
  for (std::size_t n = 0; n < g.indices.size(); ++n) {
    const auto index = static_cast<std::int64_t>(g.indices[n]);
    if (index < 0 || index >= rows)
      throw index_error(describe_variable_at(tg, i) + ": gradient on tower " + std::to_string(k) + ": index " +
                            std::to_string(n) + " is " + std::to_string(index) + ", outside the " +
                            std::to_string(rows) + " rows of its dense shape " + describe_shape(g.dense),
                        i);
  }
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
