// gradavg internals: averaging row-sparse gradients (sparse.hpp) as the dense pass over a table of
// rows. Every row that some tower lists becomes one entry of the kernel's table (layout_proof.hpp):
// on each tower, that tower's values row, the sum of its values rows where it repeats the index,
// or a shared row of zeros where it lists none; its output row in each output. The pass then runs
// as for dense gradients (pass.hpp: threads, accumulator, fused options), and a dense output's
// rows that no tower lists receive what the kernel gives for zeros. So each output element has
// the dense call's value over the densified gradients, bit for bit; only the rows listed are read.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "layout_proof.hpp"
#include "pass.hpp"
#include "sparse_check.hpp"
#include "../errors.hpp"
#include "../options.hpp"
#include "../sparse_types.hpp"
#include "../statistics.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

using sparse_entry = shared_detail::sparse_scratch::entry;

/// Dense rows up to this multiple of the values rows (plus a constant) are ordered by counting;
/// more (a huge vocabulary, few rows touched) by sorting.
inline constexpr std::size_t counting_rows_per_entry = 8;
inline constexpr std::size_t counting_rows_extra = std::size_t{1} << 16;

/// Orders entries [first, first + n) of one variable by (row, tower, position). They were appended
/// tower by tower, position by position, so a stable counting sort over rows keeps that order.
inline void order_entries(std::vector<sparse_entry>& entries, std::size_t first, std::size_t rows,
                          std::vector<std::size_t>& starts) {
  const std::size_t n = entries.size() - first;
  auto e = std::span<sparse_entry>(entries).subspan(first);
  if (rows > counting_rows_per_entry * n + counting_rows_extra) {
    std::sort(e.begin(), e.end(), [](const sparse_entry& a, const sparse_entry& b) {
      return a.row != b.row ? a.row < b.row : a.tower != b.tower ? a.tower < b.tower : a.position < b.position;
    });
    return;
  }
  starts.assign(rows + 1, 0);
  for (const sparse_entry& x : e) ++starts[x.row + 1];
  for (std::size_t r = 0; r < rows; ++r) starts[r + 1] += starts[r];
  // Placed through a copy at the end of entries (no second buffer to keep).
  entries.resize(first + 2 * n);
  auto from = std::span<sparse_entry>(entries).subspan(first, n), to = std::span<sparse_entry>(entries).subspan(first + n);
  for (const sparse_entry& x : from) to[starts[x.row]++] = x;
  std::copy(to.begin(), to.end(), from.begin());
  entries.resize(first + n);
}

/// What the kernel writes for a row that no tower lists (every input +0): +0, or -0 where the
/// fused weights and scale make every product -0 (a negative scale, say). Scalar, with the
/// kernel's operations in its order: products f_k * 0 (f_k = w_k scale, rounded to Acc), squares
/// (f_k * 0) * (scale * 0), summed in tower order, divided by the weights' sum.
template <class Acc>
std::pair<Acc, Acc> zero_row_results(const options& opts, std::size_t towers) {
  if (!fused_requested(opts)) return {Acc(0), Acc(0)};
  const compute_options& c = opts.compute;
  Acc mean = 0, square = 0;
  const Acc zero = 0;
  for (std::size_t k = 0; k < towers; ++k) {
    const Acc product = static_cast<Acc>((c.weights.empty() ? 1.0 : c.weights[k]) * c.scale) * zero;
    const Acc squared = product * (static_cast<Acc>(c.scale) * zero);
    mean = k == 0 ? product : mean + product;
    square = k == 0 ? squared : square + squared;
  }
  const Acc divisor = static_cast<Acc>(weight_sum(c.weights, towers));
  return {mean / divisor, square / divisor};
}

/// One output range of a sparse call as the table fills it.
template <class Outputs, class O>
struct sparse_output_rows {
  Outputs* outputs = nullptr;  // null: not passed

  static constexpr bool coalesced = coalesced_outputs<Outputs&>;

  /// Variable i's first output element (after prepare for the coalesced form).
  O* base(std::size_t i) const {
    if constexpr (coalesced)
      return coalesced_target(at(*outputs, i))->values.data();
    else
      return read_output<Outputs, O>(*outputs, i).data;
  }
  /// The coalesced form: variable i's output sized for `rows` rows of dense shape `dense`.
  void prepare(std::size_t i, std::size_t rows, const shape& dense) const {
    if constexpr (coalesced) {
      auto* t = coalesced_target(at(*outputs, i));
      t->dense_shape = dense;
      t->indices.resize(rows);
      t->values.resize(rows * row_length_of(dense));
    }
  }
  void set_index(std::size_t i, std::size_t ordinal, std::uint64_t row) const {
    if constexpr (coalesced) {
      auto* t = coalesced_target(at(*outputs, i));
      t->indices[ordinal] = static_cast<typename std::remove_reference_t<decltype(t->indices)>::value_type>(row);
    }
  }
  /// Where table row `ordinal` (dense row `row`) of variable i is written.
  O* row(O* base, std::size_t ordinal, std::uint64_t row, std::size_t length) const {
    return base + (coalesced ? ordinal : static_cast<std::size_t>(row)) * length;
  }
  /// The dense form: rows [from, to) receive `value` (the kernel's result for zeros).
  void fill(O* base, std::uint64_t from, std::uint64_t to, std::size_t length, O value) const {
    if constexpr (!coalesced) {
      O* first = base + static_cast<std::size_t>(from) * length;
      const std::size_t n = static_cast<std::size_t>(to - from) * length;
      if (!std::signbit(static_cast<float>(value)))
        std::memset(static_cast<void*>(first), 0, n * sizeof(O));
      else
        std::fill(first, first + n, value);
    }
  }
  /// All of variable i's output elements (on_nonfinite zero).
  void zero(std::size_t i, std::size_t dense_elements) const {
    if constexpr (coalesced) {
      auto& v = coalesced_target(at(*outputs, i))->values;
      std::fill(v.begin(), v.end(), O(0));
    } else {
      std::fill(base(i), base(i) + dense_elements, O(0));
    }
  }
};


/// aliasing_error when an output overlaps a gradient's indices or values or another output (the
/// byte ranges of every buffer sorted by address and swept; a coalesced output counts as the
/// object and its vectors' whole capacity, which the call may write). Gradients may overlap.
template <class TG, class Means, class Squares>
void check_sparse_overlaps(const TG& tg, Means& means, Squares* squares, shared_detail::sparse_scratch& w) {
  using tagged = shared_detail::sparse_scratch::tagged_bytes;
  using S = sparse_value_t<TG>;
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  const std::size_t variables = w.present.size(), towers = std::ranges::size(tg);
  w.ranges.clear();
  auto add = [&](const void* p, std::size_t bytes, std::size_t i, std::size_t k, std::uint8_t kind) {
    if (bytes == 0 || p == nullptr) return;
    const auto* b = static_cast<const std::byte*>(p);
    w.ranges.push_back({b, b + bytes, i, k, kind});
  };
  auto add_outputs = [&]<class Outputs>(Outputs& outputs, std::size_t i, std::uint8_t kind) {
    if constexpr (coalesced_outputs<Outputs&>) {
      const auto* t = coalesced_target(at(outputs, i));
      using T = std::remove_cvref_t<decltype(*t)>;
      add(t, sizeof(T), i, none, kind);
      add(t->indices.data(), t->indices.capacity() * sizeof(t->indices[0]), i, none, kind);
      add(t->values.data(), t->values.capacity() * sizeof(t->values[0]), i, none, kind);
    } else {
      using O = typename sparse_output_value<Outputs&>::type;
      const auto o = read_output<Outputs, O>(outputs, i);
      add(o.data, o.dims.size() * sizeof(O), i, none, kind);
    }
  };
  for (std::size_t i = 0; i < variables; ++i) {
    if (!w.present[i]) continue;
    for (std::size_t k = 0; k < towers; ++k) {
      const auto g = read_sparse(tg, k, i);
      add(g.indices.data(), g.indices.size_bytes(), i, k, 0);
      add(g.values, g.indices.size() * g.row_length() * sizeof(S), i, k, 1);
    }
    add_outputs(means, i, 2);
    if constexpr (outputs_passed<Squares>) add_outputs(*squares, i, 3);
  }
  std::sort(w.ranges.begin(), w.ranges.end(), [](const tagged& a, const tagged& b) {
    return std::less<const std::byte*>()(a.first, b.first);
  });
  auto name = [&](const tagged& r) {
    static constexpr const char* kinds[] = {"indices", "values", "means output", "squares output"};
    std::string s = describe_variable_at(tg, r.variable) + "'s ";
    if (r.kind < 2) s.append("gradient on tower ").append(std::to_string(r.tower)).append(" (its ");
    s.append(kinds[r.kind]);
    if (r.kind < 2) s.append(")");
    return s;
  };
  auto conflict = [&](const tagged& output, const tagged& other) {
    std::string message = "gradavg: ";
    message.append(name(output)).append(" overlaps ").append(name(other));
    message.append("; outputs of row-sparse gradients overlap nothing (not even a gradient: no averaging in place)");
    throw aliasing_error(message, output.variable);
  };
  const tagged* reach_any = nullptr;  // of the ranges so far, the one that ends last
  const tagged* reach_output = nullptr;
  const std::less<const std::byte*> before;
  for (const tagged& r : w.ranges) {
    const bool output = r.kind >= 2;
    if (output && reach_any != nullptr && before(r.first, reach_any->last)) conflict(r, *reach_any);
    if (!output && reach_output != nullptr && before(r.first, reach_output->last)) conflict(*reach_output, r);
    if (reach_any == nullptr || before(reach_any->last, r.last)) reach_any = &r;
    if (output && (reach_output == nullptr || before(reach_output->last, r.last))) reach_output = &r;
  }
}

/// average_gradients_into over row-sparse gradients read as S into outputs of O (sparse.hpp's
/// contract), with w's scratch: every check, then the table, then the pass.
template <class S, class O, class TG, class Means, class Squares>
summary average_sparse_typed(const TG& tg, Means& means, Squares* squares, const options& opts,
                             shared_detail::sparse_scratch& w) {
  constexpr bool with_squares = outputs_passed<Squares>;
  const std::size_t variables = validate_tower_counts(tg), towers = std::ranges::size(tg);

  // ---- Checks: gradients, outputs, options, overlaps, indices (nothing written before the end).
  w.present.assign(variables, 0);
  w.dense.assign(variables, shape{});
  std::size_t averaged = 0, dense_elements = 0;
  for (std::size_t i = 0; i < variables; ++i) {
    if (!check_sparse_variable(tg, i, w.dense[i])) continue;
    w.present[i] = 1;
    ++averaged;
    dense_elements += w.dense[i].size();
  }
  check_sparse_outputs(tg, means, w.present, w.dense, "means");
  if constexpr (with_squares) check_sparse_outputs(tg, *squares, w.present, w.dense, "squares");
  validate_options(opts, towers, variables, accumulator_max<S>(opts));
  if (opts.compute.range.begin != 0 || opts.compute.range.end != element_range{}.end)
    throw option_error("gradavg: options.compute.range: row-sparse gradients are averaged whole");
  if (opts.check.aliasing != alias_check::none) check_sparse_overlaps(tg, means, squares, w);

  // Every values row as an entry, ordered by (row, tower, position) within its variable; the
  // indices checked on the way. Then the table's size: one row per distinct index.
  w.entries.clear();
  w.first_entry.assign(variables + 1, 0);
  w.first_row.assign(variables + 1, 0);
  std::size_t table_rows = 0, total = 0, summed = 0, widest = 0;
  for (std::size_t i = 0; i < variables; ++i) {
    w.first_entry[i] = w.entries.size();
    w.first_row[i] = table_rows;
    if (!w.present[i]) continue;
    for (std::size_t k = 0; k < towers; ++k) {
      const auto g = read_sparse(tg, k, i);
      check_sparse_indices(tg, i, k, g);
      for (std::size_t n = 0; n < g.indices.size(); ++n)
        w.entries.push_back({static_cast<std::uint64_t>(g.indices[n]), k, n});
    }
    order_entries(w.entries, w.first_entry[i], static_cast<std::size_t>(w.dense[i].dims[0]), w.starts);
    const std::size_t length = row_length_of(w.dense[i]);
    widest = std::max(widest, length);
    for (std::size_t e = w.first_entry[i]; e < w.entries.size();) {
      const std::uint64_t row = w.entries[e].row;
      ++table_rows;
      total += length;
      while (e < w.entries.size() && w.entries[e].row == row) {
        const std::size_t first = e, tower = w.entries[e].tower;
        while (e < w.entries.size() && w.entries[e].row == row && w.entries[e].tower == tower) ++e;
        if (e - first > 1) summed += length;
      }
    }
  }
  w.first_entry[variables] = w.entries.size();
  w.first_row[variables] = table_rows;

  // ---- Writing: the scratch, the coalesced outputs' sizes, the table, the rows no tower lists.
  const std::size_t stride = towers + (with_squares ? 2 : 1);
  w.firsts.resize(table_rows * stride);
  w.elements.resize(table_rows);
  constexpr std::size_t line = 64;
  w.bytes.resize((widest + summed) * sizeof(S) + line);
  S* const zeros = reinterpret_cast<S*>(w.bytes.data() + (line - reinterpret_cast<std::uintptr_t>(w.bytes.data()) % line) % line);
  std::memset(static_cast<void*>(zeros), 0, widest * sizeof(S));
  S* next_sum = zeros + widest;
  w.values.resize(towers);

  const sparse_output_rows<Means, O> mean_rows{&means};
  sparse_output_rows<std::conditional_t<with_squares, Squares, Means>, O> square_rows{};
  if constexpr (with_squares) square_rows.outputs = squares;
  O zero_mean{}, zero_square{};
  with_accumulator<S>(opts, [&]<class Acc>() {
    const auto z = zero_row_results<Acc>(opts, towers);
    zero_mean = static_cast<O>(z.first);
    zero_square = static_cast<O>(z.second);
  });

  for (std::size_t i = 0; i < variables; ++i) {
    if (!w.present[i]) continue;
    const std::size_t rows = w.first_row[i + 1] - w.first_row[i], length = row_length_of(w.dense[i]);
    const auto dense_rows = static_cast<std::uint64_t>(w.dense[i].dims[0]);
    mean_rows.prepare(i, rows, w.dense[i]);
    if constexpr (with_squares) square_rows.prepare(i, rows, w.dense[i]);
    for (std::size_t k = 0; k < towers; ++k)
      w.values[k] = reinterpret_cast<const std::byte*>(read_sparse(tg, k, i).values);
    O* const mean_base = mean_rows.base(i);
    O* square_base = nullptr;
    if constexpr (with_squares) square_base = square_rows.base(i);
    std::uint64_t next_row = 0;  // the dense rows before it are written
    std::size_t ordinal = 0;
    const std::size_t end = w.first_entry[i + 1];
    for (std::size_t e = w.first_entry[i]; e < end; ++ordinal) {
      const std::uint64_t row = w.entries[e].row;
      const std::size_t t = w.first_row[i] + ordinal;
      const std::byte** slot = w.firsts.data() + t * stride;
      std::fill(slot, slot + towers, reinterpret_cast<const std::byte*>(zeros));
      while (e < end && w.entries[e].row == row) {
        const std::size_t first = e, tower = w.entries[e].tower;
        while (e < end && w.entries[e].row == row && w.entries[e].tower == tower) ++e;
        auto values_row = [&](std::size_t n) {
          return reinterpret_cast<const S*>(w.values[tower]) + w.entries[n].position * length;
        };
        if (e - first == 1) {
          slot[tower] = reinterpret_cast<const std::byte*>(values_row(first));
          continue;
        }
        // densify's sum of the rows that repeat the index, in index order, in S.
        S* sum = next_sum;
        next_sum += length;
        std::copy(values_row(first), values_row(first) + length, sum);
        for (std::size_t n = first + 1; n < e; ++n) {
          const S* v = values_row(n);
          for (std::size_t j = 0; j < length; ++j) sum[j] = static_cast<S>(sum[j] + v[j]);
        }
        slot[tower] = reinterpret_cast<const std::byte*>(sum);
      }
      w.elements[t] = length;
      mean_rows.fill(mean_base, next_row, row, length, zero_mean);
      mean_rows.set_index(i, ordinal, row);
      slot[towers] = reinterpret_cast<const std::byte*>(mean_rows.row(mean_base, ordinal, row, length));
      if constexpr (with_squares) {
        square_rows.fill(square_base, next_row, row, length, zero_square);
        square_rows.set_index(i, ordinal, row);
        slot[towers + 1] = reinterpret_cast<const std::byte*>(square_rows.row(square_base, ordinal, row, length));
      }
      next_row = row + 1;
    }
    mean_rows.fill(mean_base, next_row, dense_rows, length, zero_mean);
    if constexpr (with_squares) square_rows.fill(square_base, next_row, dense_rows, length, zero_square);
  }

  // ---- The pass over the table; a fused call's per-row results folded into its variables.
  const bool fused = fused_requested(opts);
  options run = opts;
  if (fused) {
    w.rows.assign(table_rows, variable_statistics{});
    run.compute.per_variable = w.rows;
    if (run.compute.on_nonfinite == nonfinite_policy::zero) run.compute.on_nonfinite = nonfinite_policy::report;
  }
  const pass_table table{buffer_table{w.firsts.data(), w.elements.data(), stride}, total};
  pass_result pass = with_accumulator<S>(
      opts, [&]<class Acc>() { return average_pass<S, Acc, O>(table_rows, towers, table, with_squares, run); });
  if (fused) {
    pass = {};
    const compute_options& c = opts.compute;
    for (std::size_t i = 0; i < variables; ++i) {
      if (!w.present[i]) continue;
      piece_result r{false, 0, 0};
      for (std::size_t t = w.first_row[i]; t < w.first_row[i + 1]; ++t) {
        r.nonfinite = r.nonfinite || w.rows[t].nonfinite;
        if (c.statistics) r.sum_mean_squared += w.rows[t].sum_mean_squared;
        if (c.statistics) r.sum_mean_of_squares += w.rows[t].sum_mean_of_squares;
      }
      if (c.on_nonfinite == nonfinite_policy::zero && r.nonfinite) {
        mean_rows.zero(i, w.dense[i].size());
        if constexpr (with_squares) square_rows.zero(i, w.dense[i].size());
      }
      finish_variable(c, i, r);
      pass.nonfinite += r.nonfinite ? 1 : 0;
      pass.sum_mean_squared += r.sum_mean_squared;
      pass.sum_mean_of_squares += r.sum_mean_of_squares;
    }
  }
  return make_summary(averaged, variables - averaged, towers, dense_elements, pass, opts);
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
