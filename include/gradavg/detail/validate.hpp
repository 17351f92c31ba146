// gradavg internals: validate_into, every check of average_gradients_into in one pass over the
// variables (check.hpp's rules, overlap.hpp's proof), before anything is written.
#pragma once

#include <cstddef>
#include <optional>
#include <ranges>
#include <type_traits>
#include <utility>

#include "access.hpp"
#include "check.hpp"
#include "isa.hpp"
#include "messages.hpp"
#include "overlap.hpp"
#include "layout_proof.hpp"
#include "../options.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// What validate_into found: the counts, and the layout the kernel may read pointers from.
struct validated {
  std::size_t variables = 0;
  std::size_t averaged = 0;
  std::size_t skipped = 0;
  std::size_t elements = 0;  // of every averaged variable
  buffer_table layout;  // the table the pass reads (layout_slots)
};

/// Where validate_into keeps the call's table of buffers (tower_count + 1 or + 2 first bytes and
/// one element count per variable), the table the pass reads: a plan's proof (remembering whether
/// the last proved layout is repeated), the stack's when it fits, or one heap block (the one
/// allocation, documented in average.hpp).
inline layout_writer layout_slots(layout_proof* proof, check_scratch& scratch, std::size_t variable_count,
                                  std::size_t tower_count, bool with_squares, std::size_t gradient_size,
                                  std::size_t output_size) {
  layout_writer layout;
  layout.stride = tower_count + (with_squares ? 2 : 1);
  const std::size_t slots = variable_count * layout.stride;
  if (proof != nullptr) {
    layout.same = proof->proved && proof->firsts.size() == slots && proof->elements.size() == variable_count &&
                  proof->towers == tower_count && proof->squares == with_squares &&
                  proof->gradient_size == gradient_size && proof->output_size == output_size;
    proof->proved = false;  // until this call's layout passes
    proof->firsts.resize(slots);
    proof->elements.resize(variable_count);
    layout.firsts = proof->firsts.data();
    layout.elements = proof->elements.data();
  } else if (slots <= stack_ranges) {
    layout.firsts = scratch.firsts.data();
    layout.elements = scratch.elements.data();
  } else {
    static_assert(sizeof(std::size_t) % alignof(const std::byte*) == 0);
    const std::size_t count_bytes = variable_count * sizeof(std::size_t);
    scratch.heap_table.reset(new std::byte[count_bytes + slots * sizeof(const std::byte*)]);
    layout.elements = reinterpret_cast<std::size_t*>(scratch.heap_table.get());
    layout.firsts = reinterpret_cast<const std::byte**>(scratch.heap_table.get() + count_bytes);
  }
  return layout;
}

/// What the walk over the variables gathers besides the layout.
struct variable_walk {
  validated result;
  bool output_problem = false;  // some output's read found a problem: the full output check names it
  std::optional<std::pair<tagged_range, tagged_range>> own_overlap;  // alias_check::same_variable
};

/// validate_into's default for what it tells of each variable that passed its checks: nothing.
struct ignore_variables {
  template <class V>
  void operator()(std::size_t, const V&, const shape*) const noexcept {}
};

/// Variable i's outputs read into m and q (q: unless squares are passed, untouched) where its
/// gradient on tower 0, g0, is present; a problem (absent, not fitting g0, not contiguous) is
/// recorded in walk, reported after the walk.
template <class O, class TG, class Means, class Squares, class S>
GRADAVG_HOT_ void read_outputs(const TG& tg, Means& means, Squares* squares, std::size_t i, const gradient_read<S>& g0,
                               variable_walk& walk, output_read<O>& m, output_read<O>& q) {
  if (!g0.present) return;
  m = read_output_at<TG, Means, O>(tg, means, i, "means");
  walk.output_problem = walk.output_problem || !m.present || !output_fits(m.dims, g0.dims) || !m.contiguous;
  if constexpr (outputs_passed<Squares>) {
    q = read_output_at<TG, Squares, O>(tg, *squares, i, "squares");
    walk.output_problem = walk.output_problem || !q.present || !output_fits(q.dims, g0.dims) || !q.contiguous;
  }
}

/// Variable i's checks (towers' variables, presence, shapes, contiguity; its outputs' reads; with
/// alias_check::same_variable its own overlaps), its buffers appended to layout. Throws the
/// variable's error; output problems and overlaps are only recorded in walk. Once its gradients
/// pass: seen(i, tower 0's variable, their shape, or null when absent on every tower).
template <class S, class O, class TG, class Means, class Squares, class Seen>
void check_variable(const TG& tg, Means& means, Squares* squares, const options& opts, std::size_t i,
                    layout_writer& layout, variable_walk& walk, Seen& seen) {
  using V = variable_t<TG>;
  using E = entry_t<TG>;
  constexpr bool with_squares = outputs_passed<Squares>;
  const std::size_t tower_count = std::ranges::size(tg);
  auto tag = [](byte_range b, std::size_t v, std::size_t k, tagged_range::kind_t kind) {
    return tagged_range{b, v, k, kind};
  };
  with_entry(tg, 0, i, [&](const E& e0) {
    auto&& v0 = entry_traits<E>::variable(e0);
    const gradient_read<S> g0 = read_gradient_at<TG, S>(tg, e0, 0, i);
    const byte_range g0_bytes = g0.bytes();
    output_read<O> m, q;
    read_outputs<O>(tg, means, squares, i, g0, walk, m, q);
    const std::size_t elements = g0.present ? g0.dims.size() : 0;  // of each output
    const byte_range m_bytes = bytes_of(m.data, m.present ? elements : 0);
    const byte_range q_bytes = bytes_of(q.data, q.present ? elements : 0);
    auto& own_overlap = walk.own_overlap;
    const bool check_own = opts.check.aliasing == alias_check::same_variable && g0.present && !own_overlap;
    auto check_own_gradient = [&](const byte_range& g, std::size_t k) {
      if (!check_own || own_overlap) return;
      if (m_bytes.overlaps(g) && !(k == 0 && m_bytes == g))
        own_overlap.emplace(tag(m_bytes, i, 0, tagged_range::means), tag(g, i, k, tagged_range::gradient));
      else if (q_bytes.overlaps(g))
        own_overlap.emplace(tag(q_bytes, i, 0, tagged_range::squares), tag(g, i, k, tagged_range::gradient));
    };

    bool problem = !g0.contiguous;
    std::size_t present = g0.present ? 1 : 0;
    layout.put(g0_bytes.first);
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
        layout.put(gk.bytes().first);
        check_own_gradient(gk.bytes(), k);
      });
    }
    if (present != 0 && present != tower_count) problem = true;
    if (problem) {
      validate_variable(tg, i);  // throws the precise error
      throw shape_error(describe_variable_at(tg, i) + ": its gradients changed while being read", i);
    }
    layout.put(m_bytes.first);
    if constexpr (with_squares) layout.put(q_bytes.first);
    layout.put_elements(elements);
    if (check_own && !own_overlap && m_bytes.overlaps(q_bytes))
      own_overlap.emplace(tag(m_bytes, i, 0, tagged_range::means), tag(q_bytes, i, 0, tagged_range::squares));
    seen(i, v0, g0.present ? &g0.dims : nullptr);
    ++(g0.present ? walk.result.averaged : walk.result.skipped);
    walk.result.elements += elements;
  });
}

/// alias_check::all on a layout not already proved, once the walk has put every variable: every
/// range against every other (overlap.hpp), the sort's room from the plan's proof, the stack or
/// the heap. Throws overlap_error.
template <class S, class O, class TG>
void prove_disjoint(const TG& tg, layout_proof* proof, check_scratch& scratch, const layout_writer& layout) {
  const std::size_t tower_count = std::ranges::size(tg);
  const std::size_t variable_count = layout.variables;
  const std::size_t slots = layout.count;
  // Room for the ranges and as many again for the radix sort, except on the stack.
  tagged_range* tagged = scratch.tagged.data();
  tagged_range* sort_scratch = nullptr;
  if (proof != nullptr) {
    proof->sorted.resize(2 * slots);
    tagged = proof->sorted.data();
  } else if (slots > stack_ranges) {
    scratch.heap_tagged.reset(new tagged_range[2 * slots]);
    tagged = scratch.heap_tagged.get();
  }
  if (tagged != scratch.tagged.data()) sort_scratch = tagged + slots;
  check_overlaps(
      tg, tagged, tag_ranges(layout.table(), variable_count, tower_count, sizeof(S), sizeof(O), tagged),
      sort_scratch);
}

/// Every check of average_gradients_into, reading each gradient and output once (data(), shape(),
/// contiguity, the variable), in one pass over the variables. Errors keep their precedence:
/// towers and gradients first (variable by variable), then outputs, then overlaps. `scratch`
/// holds the layout when no proof is given (layout_slots); proof: a plan's, which
/// keeps the layout (and proved, for the full check) when every check passes.
/// S and O: the element types the gradients are read as and the outputs written as (the traits'
/// value_type, or the run-time type validate_elements found). seen: told of each variable whose
/// gradients passed (check_variable), for a caller that needs their presence and shape too.
template <class TG, class Means, class Squares, class S = default_value_t<gradient_tensor_t<TG>>,
          class O = default_value_t<output_tensor_t<Means&>>, class Seen = ignore_variables>
validated validate_into(const TG& tg, Means& means, Squares* squares, const options& opts, check_scratch& scratch,
                        layout_proof* proof = nullptr, Seen seen = {}) {
  constexpr bool with_squares = outputs_passed<Squares>;
  const std::size_t variable_count = validate_tower_counts(tg);
  const std::size_t tower_count = std::ranges::size(tg);

  bool outputs_counted = std::ranges::size(means) == variable_count;
  if constexpr (with_squares) outputs_counted = outputs_counted && std::ranges::size(*squares) == variable_count;
  if (!outputs_counted) {
    validate_towers(tg);
    validate_all_outputs(tg, means, squares, variable_count);
  }

  const bool full = opts.check.aliasing == alias_check::all;
  layout_writer layout =
      layout_slots(proof, scratch, variable_count, tower_count, with_squares, sizeof(S), sizeof(O));
  variable_walk walk;
  walk.result.variables = variable_count;
  for (std::size_t i = 0; i < variable_count; ++i)
    check_variable<S, O>(tg, means, squares, opts, i, layout, walk, seen);

  if (walk.output_problem) {
    validate_all_outputs(tg, means, squares, variable_count);
    throw output_error("gradavg: an output changed while being read");
  }
  if (walk.own_overlap) throw_overlap(tg, walk.own_overlap->first, walk.own_overlap->second);
  if (full && !layout.same) prove_disjoint<S, O>(tg, proof, scratch, layout);
  if (proof != nullptr) {
    // Remembered as proved only for the full check: a repeated layout skips it.
    proof->towers = tower_count;
    proof->squares = with_squares;
    proof->gradient_size = sizeof(S);
    proof->output_size = sizeof(O);
    proof->proved = full;
  }
  walk.result.layout = layout.table();
  return walk.result;
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
