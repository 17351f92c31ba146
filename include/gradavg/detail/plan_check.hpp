// gradavg internals: a plan's proof (plan.hpp) — kept after a call's full checks, and compared
// with a later call's buffers.
#pragma once

#include <cstddef>
#include <ranges>
#include <type_traits>

#include "access.hpp"
#include "../errors.hpp"
#include "elements.hpp"
#include "isa.hpp"
#include "validate.hpp"
#include "../options.hpp"
#include "../plan.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

using gradavg::shared_detail::plan_access;

/// How much of the overlap rules a check proves: none < same_variable < all.
constexpr int alias_strength(alias_check a) noexcept {
  return a == alias_check::all ? 2 : a == alias_check::same_variable ? 1 : 0;
}

/// Where validate_into keeps the checks' layout, tower count and squares in a call that proves
/// into p. p is empty until keep_proof.
inline layout_proof* proving_into(plan& p) {
  plan_access::ready(p) = false;
  return &plan_access::proof(p);
}

/// Whether output slot s holds exactly `elements` elements from `first` on, writable as O.
template <class O, class Slot>
GRADAVG_HOT_ bool output_matches(Slot&& s, const std::byte* first, std::size_t elements) {
  if (!slot_present(s)) return false;
  auto& t = slot_get(s);
  using T = std::remove_cvref_t<decltype(t)>;
  if constexpr (dynamic_tensor<T>) {
    if (tensor_traits<T>::element(t) != element_of_type<O>()) return false;
  }
  return is_contiguous(t) && reinterpret_cast<const std::byte*>(typed_mutable_data<O>(t)) == first &&
         tensor_traits<T>::shape(t).size() == elements;
}

/// Whether gradient slot e of a variable present (expected) or absent in the proof is so in this
/// call, and when present, contiguous, of type S, of `elements` elements from `first` on.
template <class S, class E>
GRADAVG_HOT_ bool gradient_matches(const E& e, bool expected, const std::byte* first, std::size_t elements) {
  using G = slot_tensor_t<std::remove_cvref_t<decltype(entry_traits<E>::gradient(e))>>;
  auto&& s = entry_traits<E>::gradient(e);
  if (!slot_present(s)) return !expected;
  if (!expected) return false;
  const G& g = slot_get(s);
  if constexpr (dynamic_tensor<G>) {
    if (tensor_traits<G>::element(g) != element_of_type<S>()) return false;
  }
  return is_contiguous(g) && reinterpret_cast<const std::byte*>(typed_data<S>(g)) == first &&
         tensor_traits<G>::shape(g).size() == elements;
}

/// Towers that matches_plan reads through their first entries' addresses, taken once per call:
/// contiguous ranges yielded by reference, at most this many.
inline constexpr std::size_t towers_read_directly = 16;
template <class TG>
inline constexpr bool towers_contiguous = std::is_lvalue_reference_v<tower_ref_t<TG>> &&
                                          std::ranges::contiguous_range<std::remove_reference_t<tower_ref_t<TG>>>;

/// Whether p was proved for calls like this one: ready, the same call signature, tower, variable
/// and output counts, element types, and aliasing checks at most as strong as the ones it ran.
template <class S, class O, class TG, class Means, class Squares>
bool plan_fits(plan& p, const void* signature, const TG& tg, Means& means, Squares* squares, const options& opts) {
  using A = plan_access;
  const std::size_t towers = std::ranges::size(tg);
  const std::size_t variables = A::variables(p);
  if (!A::ready(p) || A::signature(p) != signature || A::towers(p) != towers ||
      A::squares(p) != outputs_passed<Squares> || A::gradients(p) != element_of_type<S>() ||
      A::outputs(p) != element_of_type<O>() || alias_strength(opts.check.aliasing) > alias_strength(A::proved(p)) ||
      std::ranges::size(means) != variables)
    return false;
  if constexpr (outputs_passed<Squares>) {
    if (std::ranges::size(*squares) != variables) return false;
  }
  for (std::size_t k = 0; k < towers; ++k)
    if (std::ranges::size(at(tg, k)) != variables) return false;
  return true;
}

/// Whether every buffer of this call is one p proved for the same signature, towers, variables,
/// squares, element types S / O and at least options.check.aliasing's overlap check: each gradient
/// present exactly where it was, and every present gradient and output of an averaged variable
/// contiguous, of type S / O, at the same first element with the same element count. False too
/// when a tensor_traits function throws: the full checks then locate the error.
template <class S, class O, class TG, class Means, class Squares>
bool matches_plan(plan& p, const void* signature, const TG& tg, Means& means, Squares* squares, const options& opts) {
  using A = plan_access;
  using E = entry_t<TG>;
  constexpr bool with_squares = outputs_passed<Squares>;
  if (!plan_fits<S, O>(p, signature, tg, means, squares, opts)) return false;
  const std::size_t towers = std::ranges::size(tg);
  const std::size_t variables = A::variables(p);

  const unsigned char* present = A::present(p).data();
  // Every variable's buffers against its row of the proof, for tower_count towers (the call's
  // count, or the same as a std::integral_constant); entry_matches(k, i, expected, first,
  // elements) compares tower k's entry i.
  const auto all_match = [&](auto tower_count, auto&& entry_matches) {
    const std::size_t stride = tower_count + (with_squares ? 2 : 1);
    const std::byte* const* row = A::proof(p).firsts.data();
    const std::size_t* counts = A::proof(p).elements.data();
    for (std::size_t i = 0; i < variables; ++i, row += stride) {
      const bool expected = present[i] != 0;
      const std::size_t elements = counts[i];
      for (std::size_t k = 0; k < tower_count; ++k)
        if (!entry_matches(k, i, expected, row[k], elements)) return false;
      if (!expected) continue;
      if (!output_matches<O>(at(means, i), row[tower_count], elements)) return false;
      if constexpr (with_squares) {
        if (!output_matches<O>(at(*squares, i), row[tower_count + 1], elements)) return false;
      }
    }
    return true;
  };
  try {
    if constexpr (towers_contiguous<TG>) {
      // The towers' first entries held in registers or the stack, not reloaded per entry.
      if (towers <= towers_read_directly) {
        const E* first[towers_read_directly];
        for (std::size_t k = 0; k < towers; ++k) first[k] = std::ranges::data(at(tg, k));
        const auto direct = [&](std::size_t k, std::size_t i, bool expected, const std::byte* proved,
                                std::size_t elements) {
          return gradient_matches<S>(first[k][i], expected, proved, elements);
        };
        // The usual tower counts as constants: the towers' entries then stay in registers.
        switch (towers) {
          case 2: return all_match(std::integral_constant<std::size_t, 2>{}, direct);
          case 4: return all_match(std::integral_constant<std::size_t, 4>{}, direct);
          case 8: return all_match(std::integral_constant<std::size_t, 8>{}, direct);
          default: return all_match(towers, direct);
        }
      }
    }
    return all_match(towers, [&](std::size_t k, std::size_t i, bool expected, const std::byte* proved,
                                 std::size_t elements) {
      return with_entry(tg, k, i, [&](const E& e) { return gradient_matches<S>(e, expected, proved, elements); });
    });
  } catch (...) {
    return false;
  }
}

/// Keeps in p what a call's full checks proved (the proof from proving_into): v, whose layout,
/// tower count and squares validate_into left in p's proof, and which variables are
/// present. Called after every check has passed, before anything is written.
template <class S, class O, class TG>
void keep_proof(plan& p, const void* signature, const TG& tg, const validated& v, alias_check aliasing) {
  using A = plan_access;
  using E = entry_t<TG>;
  auto& present = A::present(p);
  present.resize(v.variables);
  for (std::size_t i = 0; i < v.variables; ++i)
    present[i] = with_entry(tg, 0, i, [](const E& e) { return slot_present(entry_traits<E>::gradient(e)); }) ? 1 : 0;
  A::signature(p) = signature;
  A::variables(p) = v.variables;
  A::averaged(p) = v.averaged;
  A::elements(p) = v.elements;
  A::gradients(p) = element_of_type<S>();
  A::outputs(p) = element_of_type<O>();
  A::proved(p) = aliasing;
  A::ready(p) = true;
  A::agreed(p).clear();  // a new local proof: the ranks have not agreed on it yet
  ++A::proofs(p);
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
