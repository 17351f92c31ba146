// gradavg internals: the proof that no output overlaps another buffer — every buffer's byte range
// in layout_proof's order, sorted by address (radix or std::sort) and swept once.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "access.hpp"
#include "messages.hpp"
#include "../errors.hpp"
#include "../options.hpp"
#include "layout_proof.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

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

/// options.compute.weights, read while the outputs are written, against every output of a checked
/// table whose outputs hold output_size bytes per element (gradients may hold the weights: they
/// are only read): aliasing_error for the first variable one of whose outputs overlaps them.
/// Nothing is checked with alias_check::none.
template <class TG>
void check_weights_apart(const TG& tg, const buffer_table& table, std::size_t variables, std::size_t towers,
                         std::size_t output_size, const options& opts) {
  const std::span<const double> w = opts.compute.weights;
  if (w.empty() || opts.check.aliasing == alias_check::none) return;
  const byte_range weights = bytes_of(w.data(), w.size());
  for (std::size_t i = 0; i < variables; ++i) {
    const std::size_t elements = table.elements[i];
    if (elements == 0) continue;
    for (std::size_t slot = towers; slot < table.stride; ++slot) {
      const std::byte* first = table.row(i)[slot];
      if (!byte_range{first, first + elements * output_size}.overlaps(weights)) continue;
      throw aliasing_error(describe_variable_at(tg, i) + ": the " + (slot == towers ? "means" : "squares") +
                               " output overlaps options.compute.weights, which are read while the outputs are "
                               "written",
                           i);
    }
  }
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

/// Where the single pass puts every buffer's first byte, in the order of layout_proof (for each
/// variable its gradient on every tower, its means, its squares when passed), and each variable's
/// element count: a buffer_table. Null first bytes stand for absent gradients and for the outputs
/// of skipped variables.
struct layout_writer {
  const std::byte** firsts = nullptr;
  std::size_t* elements = nullptr;
  std::size_t stride = 0;  // first bytes per variable
  std::size_t count = 0;  // first bytes put
  std::size_t variables = 0;  // element counts put
  bool same = false;  // everything put equals what was already there

  void put(const std::byte* first) noexcept { record(firsts, count, first); }
  void put_elements(std::size_t n) noexcept { record(elements, variables, n); }
  [[nodiscard]] buffer_table table() const noexcept { return {firsts, elements, stride}; }

 private:
  template <class T>
  void record(T* to, std::size_t& at, T value) noexcept {
    if (same && to[at] == value) {  // a repeated layout is only read, not written again
      ++at;
      return;
    }
    same = false;  // from here on the old table is not read (uninitialised in stack scratch)
    to[at++] = value;
  }
};

/// The ranges the sweep must see, from a table whose gradients hold gradient_size bytes per
/// element and outputs output_size: the non-empty ones. A means output in place into tower 0's
/// gradient (the same bytes) stands for both (one range, an output), so it may overlap nothing
/// else — not even the same variable's gradient on another tower.
inline std::size_t tag_ranges(const buffer_table& table, std::size_t variable_count, std::size_t tower_count,
                              std::size_t gradient_size, std::size_t output_size, tagged_range* out) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < variable_count; ++i) {
    const std::size_t elements = table.elements[i];
    if (elements == 0) continue;
    const std::byte* const* v = table.row(i);
    const bool in_place = v[tower_count] == v[0] && gradient_size == output_size;
    for (std::size_t k = in_place ? 1 : 0; k < table.stride; ++k) {
      const std::size_t bytes = elements * (k < tower_count ? gradient_size : output_size);
      const auto kind =
          k < tower_count ? tagged_range::gradient : k == tower_count ? tagged_range::means : tagged_range::squares;
      out[n++] = tagged_range{byte_range{v[k], v[k] + bytes}, i, k < tower_count ? k : 0, kind};
    }
  }
  return n;
}

/// Layouts of at most this many ranges are checked on the stack when no plan is passed.
inline constexpr std::size_t stack_ranges = 256;

/// Scratch memory of one call without a plan: on the stack (left uninitialised, so it
/// costs nothing to declare) unless the layout is larger than stack_ranges.
struct check_scratch {
  std::array<const std::byte*, stack_ranges> firsts;
  std::array<std::size_t, stack_ranges> elements;  // at most one per range
  std::array<tagged_range, stack_ranges> tagged;
  std::unique_ptr<std::byte[]> heap_table;  // the element counts, then the first bytes (one allocation)
  std::unique_ptr<tagged_range[]> heap_tagged;  // new T[n]: left uninitialised, like the arrays
};

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
