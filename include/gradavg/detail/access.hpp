// gradavg internals: reading tower_grads[k][i] — the towers, entries, gradient slots and outputs'
// element pointers and shapes, through the traits — for the checks and the pass.
//
// Lifetimes: a tower, an entry or a gradient slot may be yielded by value (a views::transform,
// an entry_traits::gradient() returning a view). Each is then held in a local for as long as it
// is read, and only values (pointers, shapes, copies) leave that scope — so the elements a
// pointer refers to must outlive the slot: a slot held by value must be a view
// (borrowed_slot), which the API entry points check at compile time.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "isa.hpp"
#include "layout_proof.hpp"
#include "../entry.hpp"
#include "../errors.hpp"
#include "../sparse_types.hpp"
#include "../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

// Shared by every level (layout_proof.hpp).
using gradavg::shared_detail::byte_range;
using gradavg::shared_detail::buffer_table;
using gradavg::shared_detail::layout_proof;
using gradavg::shared_detail::tagged_range;

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
/// pointer, a std::reference_wrapper, a view tensor (tensor_traits<T>::view) or row-sparse view
/// (sparse_traits<T>::view), or an optional of one.
template <class S>
constexpr bool borrowed_slot() {
  if constexpr (std::is_pointer_v<S> || is_reference_wrapper<S>::value)
    return true;
  else if constexpr (is_optional<S>::value)
    return borrowed_slot<typename S::value_type>();
  else if constexpr (tensor<S>)
    return view_tensor<S>;
  else if constexpr (sparse_tensor<S>)
    return requires { requires sparse_traits<S>::view; };
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

/// A copy of tower 0's variable i.
template <class TG>
variable_t<TG> variable_copy(const TG& tg, std::size_t i) {
  return with_entry(tg, 0, i,
                    [](const entry_t<TG>& e) { return variable_t<TG>(entry_traits<entry_t<TG>>::variable(e)); });
}

// ---- Access to the outputs. ---------------------------------------------------------------

/// The outputs of a call that writes none of a kind: the squares range of a call without means
/// of squares (no_squares), and both ranges of the allocating calls' element check (no_means too).
struct no_outputs {};
inline constexpr no_outputs* no_means = nullptr;
inline constexpr no_outputs* no_squares = nullptr;

/// Whether an output range type R (Means or Squares of a call) is a range passed by the caller.
template <class R>
inline constexpr bool outputs_passed = !std::is_same_v<R, no_outputs>;

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

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
