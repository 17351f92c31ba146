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
using sparse_block = shared_detail::sparse_scratch::block;

/// Dense rows up to this multiple of the values rows (plus a constant) are ordered by counting;
/// more (a huge vocabulary, few rows touched) by sorting.
inline constexpr std::size_t counting_rows_per_entry = 8;
inline constexpr std::size_t counting_rows_extra = std::size_t{1} << 16;

/// Whether a variable of `rows` dense rows and n values rows in all is ordered by counting.
constexpr bool counted_order(std::size_t rows, std::size_t n) noexcept {
  return rows <= counting_rows_per_entry * n + counting_rows_extra;
}

/// Orders entries [first, first + n) of one variable by (row, tower, position). They were appended
/// tower by tower, position by position, so a stable counting sort over rows keeps that order.
inline void order_entries(std::vector<sparse_entry>& entries, std::size_t first, std::size_t rows,
                          std::vector<std::size_t>& starts) {
  const std::size_t n = entries.size() - first;
  auto e = std::span<sparse_entry>(entries).subspan(first);
  if (!counted_order(rows, n)) {
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
struct zero_results {
  Acc mean, square;
};
template <class Acc>
zero_results<Acc> zero_row_results(const options& opts, std::size_t towers) {
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
  // Room for every range a call can add (a coalesced output adds up to 3, an empty one none), so
  // that a loop's first call grows it once.
  w.ranges.reserve(variables * (2 * towers + 6));
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
/// contract), with w's scratch, in phases: every check (check), the rows' order and the tables'
/// sizes (order), the tables and the rows no tower lists (lay_out), the pass (run). divisor: what
/// the plain pass divides the sums by (0: the tower count; 1: the sums themselves, for the calls
/// across processes).
template <class S, class O, class TG, class Means, class Squares>
class sparse_call {
 public:
  static constexpr bool with_squares = outputs_passed<Squares>;

  sparse_call(const TG& tg, Means& means, Squares* squares, const options& opts, shared_detail::sparse_scratch& w,
              double divisor)
      : tg_(tg), opts_(opts), w_(w), divisor_(divisor), means_{&means} {
    if constexpr (with_squares) squares_.outputs = squares;
  }

  summary operator()() {
    check();
    order();
    lay_out();
    return run();
  }

 private:
  using square_rows_t = sparse_output_rows<std::conditional_t<with_squares, Squares, Means>, O>;

  /// Gradients, outputs, options, overlaps (the indices: order()); nothing written.
  void check() {
    variables_ = validate_tower_counts(tg_);
    towers_ = std::ranges::size(tg_);
    w_.present.assign(variables_, 0);
    w_.dense.assign(variables_, shape{});
    for (std::size_t i = 0; i < variables_; ++i) {
      if (!check_sparse_variable(tg_, i, w_.dense[i])) continue;
      w_.present[i] = 1;
      ++averaged_;
      dense_elements_ += w_.dense[i].size();
    }
    check_sparse_outputs(tg_, *means_.outputs, w_.present, w_.dense, "means");
    if constexpr (with_squares) check_sparse_outputs(tg_, *squares_.outputs, w_.present, w_.dense, "squares");
    validate_options(opts_, towers_, variables_, accumulator_max<S>(opts_));
    if (opts_.compute.range.begin != 0 || opts_.compute.range.end != element_range{}.end)
      throw option_error("gradavg: options.compute.range: row-sparse gradients are averaged whole");
    if (opts_.check.aliasing != alias_check::none) check_sparse_overlaps(tg_, *means_.outputs, squares_ptr(), w_);
    fused_ = fused_requested(opts_);
  }

  auto* squares_ptr() const {
    if constexpr (with_squares)
      return squares_.outputs;
    else
      return no_squares;
  }

  /// The block of a row that `listing` towers list.
  [[nodiscard]] std::size_t block_of(std::size_t listing) const noexcept { return fused_ ? towers_ : listing; }

  /// Every values row as an entry, ordered by (row, tower, position) within its variable, the
  /// indices checked on the way (index_error: still nothing written); then the tables' sizes: one
  /// row per distinct index, in the block of the number of towers that list it.
  void order() {
    w_.entries.clear();
    w_.first_entry.assign(variables_ + 1, 0);
    w_.first_row.assign(variables_ + 1, 0);
    w_.blocks.assign(towers_ + 1, {});
    std::size_t distinct = 0;
    for (std::size_t i = 0; i < variables_; ++i) {
      w_.first_entry[i] = w_.entries.size();
      w_.first_row[i] = distinct;
      if (!w_.present[i]) continue;
      for (std::size_t k = 0; k < towers_; ++k) {
        const auto g = read_sparse(tg_, k, i);
        check_sparse_indices(tg_, i, k, g);
        for (std::size_t n = 0; n < g.indices.size(); ++n)
          w_.entries.push_back({static_cast<std::uint64_t>(g.indices[n]), k, n});
      }
      order_entries(w_.entries, w_.first_entry[i], static_cast<std::size_t>(w_.dense[i].dims[0]), w_.starts);
      const std::size_t length = row_length_of(w_.dense[i]);
      widest_ = std::max(widest_, length);
      for (std::size_t e = w_.first_entry[i]; e < w_.entries.size();) {
        const std::uint64_t row = w_.entries[e].row;
        std::size_t listing = 0;
        while (e < w_.entries.size() && w_.entries[e].row == row) {
          const std::size_t first = e, tower = w_.entries[e].tower;
          while (e < w_.entries.size() && w_.entries[e].row == row && w_.entries[e].tower == tower) ++e;
          if (e - first > 1) summed_ += length;
          ++listing;
        }
        sparse_block& b = w_.blocks[block_of(listing)];
        ++b.rows;
        b.elements += length;
        ++distinct;
      }
    }
    w_.first_entry[variables_] = w_.entries.size();
    w_.first_row[variables_] = distinct;
    std::size_t slots = 0;
    for (std::size_t c = 1; c <= towers_; ++c) {
      sparse_block& b = w_.blocks[c];
      // A row that some towers do not list reads one row of zeros, first, then theirs (the dense
      // call's sum over densified gradients, whose zeros count only for the sign of a zero: x + 0
      // is x for every x but -0); one that every tower lists reads each tower's. Fused: every
      // tower's, zeros where it lists none (the weights meet every tower).
      b.towers = c == towers_ || fused_ ? towers_ : c + 1;
      b.first_row = b.next = table_rows_;
      b.first_slot = slots;
      table_rows_ += b.rows;
      slots += b.rows * (b.towers + outputs);
    }
    w_.firsts.resize(slots);
    w_.elements.resize(table_rows_);
  }

  /// The scratch rows (zeros, sums of repeated indices), what the kernel gives for zeros, then
  /// each variable's outputs and table rows.
  void lay_out() {
    constexpr std::size_t line = 64;
    w_.bytes.resize((widest_ + summed_) * sizeof(S) + line);
    const auto misalignment = reinterpret_cast<std::uintptr_t>(w_.bytes.data()) % line;
    zeros_ = reinterpret_cast<S*>(w_.bytes.data() + (line - misalignment) % line);
    std::memset(static_cast<void*>(zeros_), 0, widest_ * sizeof(S));
    next_sum_ = zeros_ + widest_;
    w_.values.resize(towers_);
    with_accumulator<S>(opts_, [&]<class Acc>() {
      const auto z = zero_row_results<Acc>(opts_, towers_);
      zero_mean_ = static_cast<O>(z.mean);
      zero_square_ = static_cast<O>(z.square);
    });
    for (std::size_t i = 0; i < variables_; ++i)
      if (w_.present[i]) lay_out_variable(i);
  }

  /// Variable i's outputs (sized, the rows no tower lists written, the coalesced indices) and
  /// table rows.
  void lay_out_variable(std::size_t i) {
    constexpr std::size_t unplaced = static_cast<std::size_t>(-1);
    const std::size_t length = row_length_of(w_.dense[i]), begin = w_.first_entry[i], end = w_.first_entry[i + 1];
    const auto dense_rows = static_cast<std::uint64_t>(w_.dense[i].dims[0]);
    for (std::size_t k = 0; k < towers_; ++k)
      w_.values[k] = reinterpret_cast<const std::byte*>(read_sparse(tg_, k, i).values);

    // The rows in index order: the coalesced outputs' sizes and indices, the dense outputs' rows
    // that no tower lists, each row's place in that order (and, where the dense rows can be
    // mapped, the map from row to place).
    const std::size_t rows = w_.first_row[i + 1] - w_.first_row[i];
    means_.prepare(i, rows, w_.dense[i]);
    if constexpr (with_squares) squares_.prepare(i, rows, w_.dense[i]);
    O* const mean_base = means_.base(i);
    O* square_base = nullptr;
    if constexpr (with_squares) square_base = squares_.base(i);
    const bool mapped = counted_order(static_cast<std::size_t>(dense_rows), end - begin);
    if (mapped) w_.starts.assign(static_cast<std::size_t>(dense_rows), unplaced);
    w_.groups.resize(rows);
    std::uint64_t next_row = 0;  // the dense rows before it are written
    for (std::size_t e = begin, place = 0; e < end; ++place) {
      const std::uint64_t row = w_.entries[e].row;
      w_.groups[place] = e;
      if (mapped) w_.starts[static_cast<std::size_t>(row)] = place;
      while (e < end && w_.entries[e].row == row) ++e;
      means_.fill(mean_base, next_row, row, length, zero_mean_);
      means_.set_index(i, place, row);
      if constexpr (with_squares) {
        squares_.fill(square_base, next_row, row, length, zero_square_);
        squares_.set_index(i, place, row);
      }
      next_row = row + 1;
    }
    means_.fill(mean_base, next_row, dense_rows, length, zero_mean_);
    if constexpr (with_squares) squares_.fill(square_base, next_row, dense_rows, length, zero_square_);

    // The table rows, in the order the towers list the rows (tower 0's in its order, then those
    // tower 1 lists first, ...): the pass then reads each tower's values mostly forwards (with
    // indices in random order, a third faster than in index order). In index order where the
    // rows were ordered by sorting (no map).
    auto table_row = [&](std::size_t place) {
      std::size_t e = w_.groups[place], listing = 0;
      const std::uint64_t row = w_.entries[e].row;
      for (std::size_t f = e; f < end && w_.entries[f].row == row; ++f)
        listing += f == e || w_.entries[f].tower != w_.entries[f - 1].tower ? 1 : 0;
      sparse_block& b = w_.blocks[block_of(listing)];
      const std::size_t t = b.next++;
      const std::byte** slot = w_.firsts.data() + b.first_slot + (t - b.first_row) * (b.towers + outputs);
      read_row(e, end, slot, b.towers, length);
      w_.elements[t] = length;
      slot[b.towers] = reinterpret_cast<const std::byte*>(means_.row(mean_base, place, row, length));
      if constexpr (with_squares)
        slot[b.towers + 1] = reinterpret_cast<const std::byte*>(squares_.row(square_base, place, row, length));
    };
    if (mapped) {
      for (std::size_t k = 0; k < towers_; ++k)
        for (const auto index : read_sparse(tg_, k, i).indices)
          if (std::size_t& place = w_.starts[static_cast<std::size_t>(index)]; place != unplaced) {
            const std::size_t p = place;
            place = unplaced;
            table_row(p);
          }
    } else {
      for (std::size_t place = 0; place < rows; ++place) table_row(place);
    }
  }

  /// The buffers a table row reads (slot[0, block_towers)) for the entries [e, end) of one index,
  /// e left at the next index's: the towers' values rows, a row's sum where a tower repeats it,
  /// the row of zeros.
  void read_row(std::size_t& e, std::size_t end, const std::byte** slot, std::size_t block_towers,
                std::size_t length) {
    const auto* const zero_row = reinterpret_cast<const std::byte*>(zeros_);
    const std::uint64_t index = w_.entries[e].row;
    const bool every_tower = block_towers == towers_;
    if (every_tower) std::fill(slot, slot + towers_, zero_row);
    std::size_t next = 0;
    if (!every_tower) slot[next++] = zero_row;
    while (e < end && w_.entries[e].row == index) {
      const std::size_t first = e, tower = w_.entries[e].tower;
      while (e < end && w_.entries[e].row == index && w_.entries[e].tower == tower) ++e;
      auto values_row = [&](std::size_t n) {
        return reinterpret_cast<const S*>(w_.values[tower]) + w_.entries[n].position * length;
      };
      const S* read = values_row(first);
      if (e - first > 1) {
        // densify's sum of the rows that repeat the index, in index order, in S.
        S* sum = next_sum_;
        next_sum_ += length;
        std::copy(read, read + length, sum);
        for (std::size_t n = first + 1; n < e; ++n) {
          const S* v = values_row(n);
          for (std::size_t j = 0; j < length; ++j) sum[j] = static_cast<S>(sum[j] + v[j]);
        }
        read = sum;
      }
      slot[every_tower ? tower : next++] = reinterpret_cast<const std::byte*>(read);
    }
  }

  /// The pass over each block; a fused call's per-row results folded into its variables. Rows
  /// are stored as the caller's stores option says, and ordinarily where it leaves the choice
  /// (store_policy::automatic): streamed, the scattered rows of a BERT-base embedding took a
  /// quarter longer (gradavg_bench_sparse).
  summary run() {
    options run = opts_;
    if (run.run.stores == store_policy::automatic) run.run.stores = store_policy::regular;
    if (fused_) {
      w_.rows.assign(table_rows_, variable_statistics{});
      run.compute.per_variable = w_.rows;
      if (run.compute.on_nonfinite == nonfinite_policy::zero) run.compute.on_nonfinite = nonfinite_policy::report;
    }
    pass_result pass;
    for (std::size_t c = 1; c <= towers_; ++c) {
      const sparse_block& b = w_.blocks[c];
      if (b.rows == 0) continue;
      const pass_table table{
          buffer_table{w_.firsts.data() + b.first_slot, w_.elements.data() + b.first_row, b.towers + outputs},
          b.elements};
      pass = with_accumulator<S>(opts_, [&]<class Acc>() {
        return average_pass<S, Acc, O>(b.rows, b.towers, table, with_squares, run,
                                       fused_ ? 0.0 : divisor_ > 0 ? divisor_ : static_cast<double>(towers_));
      });
    }
    if (fused_) pass = fold_rows();
    return make_summary(averaged_, variables_ - averaged_, towers_, dense_elements_, pass, opts_);
  }

  /// A fused call's per-row results (the one block's rows, each variable's together) folded into
  /// its variables: non-finite flags, statistics, on_nonfinite zero.
  pass_result fold_rows() {
    pass_result pass;
    const compute_options& c = opts_.compute;
    for (std::size_t i = 0; i < variables_; ++i) {
      if (!w_.present[i]) continue;
      piece_result r{false, 0, 0};
      for (std::size_t t = w_.first_row[i]; t < w_.first_row[i + 1]; ++t) {
        r.nonfinite = r.nonfinite || w_.rows[t].nonfinite;
        if (c.statistics) r.sum_mean_squared += w_.rows[t].sum_mean_squared;
        if (c.statistics) r.sum_mean_of_squares += w_.rows[t].sum_mean_of_squares;
      }
      if (c.on_nonfinite == nonfinite_policy::zero && r.nonfinite) {
        means_.zero(i, w_.dense[i].size());
        if constexpr (with_squares) squares_.zero(i, w_.dense[i].size());
      }
      finish_variable(c, i, r);
      pass.nonfinite += r.nonfinite ? 1 : 0;
      pass.sum_mean_squared += r.sum_mean_squared;
      pass.sum_mean_of_squares += r.sum_mean_of_squares;
    }
    return pass;
  }

  static constexpr std::size_t outputs = with_squares ? 2 : 1;
  const TG& tg_;
  const options& opts_;
  shared_detail::sparse_scratch& w_;
  double divisor_;
  sparse_output_rows<Means, O> means_;
  square_rows_t squares_{};
  std::size_t variables_ = 0, towers_ = 0, averaged_ = 0, dense_elements_ = 0;
  bool fused_ = false;
  std::size_t widest_ = 0, summed_ = 0, table_rows_ = 0;
  S* zeros_ = nullptr;
  S* next_sum_ = nullptr;
  O zero_mean_{}, zero_square_{};
};

/// sparse_call's checks and pass as one call.
template <class S, class O, class TG, class Means, class Squares>
summary average_sparse_typed(const TG& tg, Means& means, Squares* squares, const options& opts,
                             shared_detail::sparse_scratch& w, double divisor = 0) {
  return sparse_call<S, O, TG, Means, Squares>(tg, means, squares, opts, w, divisor)();
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
