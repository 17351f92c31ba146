// gradavg internals: row-sparse gradients across processes (gradavg::mpi's calls over row-sparse
// towers) over any processes::transport.
//
// Contract: every rank r sums its own towers' densified gradients row by row (s_r, in the
// accumulator, in tower order: the one-process call's sums), and every rank receives
//   mean   = (s_0 + s_1 + ... + s_{P-1}) / T            summed in rank order, T the towers of all ranks
//   square = (q_0 + ... + q_{P-1}) / T                   q_r: rank r's sums of squared densified rows
// where a rank that lists a row in none of its towers contributes 0: bitwise the same on every rank
// and from run to run. options.exchange.sparse (sparse_wire) says how the sums travel: rows, every
// rank's listed indices and sums to every rank (Horovod's allgather of IndexedSlices, on the
// transport's own moves), each rank then adding them up itself; or dense, the indices so, then the
// sums as a dense tensor in buckets, each slice summed by its owner in rank order and sent back.
// The zeros of the dense tensor leave the sums unchanged: the same bits either way.
//
// Phases, with the error contract of the dense call (call.hpp):
//   - Local: every check of the one-process call, then this rank's sums into its scratch.
//   - Collective 1 (min): the lowest rank whose local phase threw; it rethrows its own error, every
//     other rank throws remote_error.
//   - Collective 2 (gather): every rank's header (counts, types, options, bytes to send).
//   - Collective 3 (gather): per variable, every rank's presence, dense shape and rows listed:
//     every rank throws the same error for ranks that disagree.
//   - The moves (the choice of wire made from what every rank gathered): every rank's rows, in a
//     slot as large as the largest rank's, to every rank; or its indices, then the dense sums.
//   Nothing is written to an output before the moves are complete.
// Options: the plain mean and squares (no weights, scale, non-finite detection, statistics,
// per_variable, double accumulation, range, compression or sharded output: option_error on every
// rank).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "agreement.hpp"
#include "exchange.hpp"
#include "../sparse_pass.hpp"
#include "../../errors.hpp"
#include "../../options.hpp"
#include "../../sparse_types.hpp"
#include "../../statistics.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// The header every rank gathers.
enum sparse_header_field : std::size_t {
  sh_towers,
  sh_variables,
  sh_types,    // the gradients' element type code, and the index type's size
  sh_squares,  // squares passed
  sh_slot,     // bytes of this rank's rows on the wire
  sh_wire,     // options.exchange.sparse
  sparse_header_words
};

/// Per variable, what every rank gathers: presence (0 absent on every tower, 1 present), the
/// dense shape's fingerprint, the variable's identity (0: not compared), the rows listed.
enum sparse_variable_field : std::size_t { sv_present, sv_shape, sv_identity, sv_rows, sparse_variable_words };

/// Buckets of the dense exchange in flight at once (sparse_wire::dense).
inline constexpr std::size_t sparse_sets = 3;

/// gradavg::mpi's average_gradients_into over row-sparse towers (see the file comment), in
/// phases: local(), agree() (collectives 1 to 3), move(), then merge(i) for each variable.
template <class Transport, class TG, class Means, class Squares>
class sparse_exchange {
 public:
  using S = sparse_value_t<TG>;
  using I = sparse_index_t<TG>;
  using O = typename sparse_output_value<Means&>::type;
  using Acc = accumulator_t<S>;
  static constexpr bool with_squares = outputs_passed<Squares>;

  sparse_exchange(Transport& wire, const TG& tg, Means& means, Squares* squares,
                  const typename Transport::options_type& opts)
      : wire_(wire), tg_(tg), opts_(opts), rank_(wire.rank()), ranks_(wire.ranks()),
        P_(static_cast<std::size_t>(wire.ranks())), means_{&means} {
    if constexpr (with_squares) squares_.outputs = squares;
  }

  summary operator()(std::exception_ptr prior) {
    std::exception_ptr own;
    std::size_t failed_variable = error::npos;
    try {
      if (prior) std::rethrow_exception(prior);
      local();
    } catch (const error& e) {
      own = std::current_exception();
      failed_variable = e.variable_index();
    } catch (...) {
      own = std::current_exception();
    }
    agree(own, failed_variable);
    move();
    summary s;
    std::size_t elements = 0;
    for (std::size_t i = 0; i < variables_; ++i) {
      if (!scratch_.present[i]) continue;
      merge(i);
      ++s.averaged;
      elements += scratch_.dense[i].size();
    }
    s.skipped = variables_ - s.averaged;
    s.towers = s.weighted_towers = towers_;
    s.shard = {0, elements};
    return s;
  }

 private:
  using sums_t = sparse_rows<I, Acc>;
  using square_rows_t = sparse_output_rows<std::conditional_t<with_squares, Squares, Means>, O>;

  /// Every check of the one-process call and this rank's sums (nothing written to an output),
  /// the words this rank contributes, the transport's room.
  void local() {
    const options local = opts_.local();
    const compute_options& c = local.compute;
    if (fused_requested(local) || c.accumulate != accumulation::native ||
        opts_.exchange.compression != compression::none || opts_.exchange.output != output_mode::replicated)
      throw option_error(std::string(Transport::caller) +
                         ": row-sparse gradients across processes are averaged plain (no weights, scale, non-finite "
                         "detection, statistics, per_variable, double accumulation, compression or sharded output)");
    wire_.check_options();
    gradavg::shared_detail::require_named(opts_.exchange.sparse, sparse_wire::dense, "options.exchange.sparse");
    const std::size_t variables = validate_tower_counts(tg_);
    sums_.resize(variables);
    if (with_squares) square_sums_.resize(variables);
    std::vector<sums_t*> sum_outputs, square_outputs;
    for (std::size_t i = 0; i < variables; ++i) {
      sum_outputs.push_back(&sums_[i]);
      if (with_squares) square_outputs.push_back(&square_sums_[i]);
    }
    // The local call checks the gradients and options; the caller's outputs are checked here.
    if constexpr (with_squares) {
      average_sparse_typed<S, Acc>(tg_, sum_outputs, &square_outputs, local, scratch_, 1.0);
      check_sparse_outputs(tg_, *squares_.outputs, scratch_.present, scratch_.dense, "squares");
    } else {
      average_sparse_typed<S, Acc>(tg_, sum_outputs, no_squares, local, scratch_, 1.0);
    }
    check_sparse_outputs(tg_, *means_.outputs, scratch_.present, scratch_.dense, "means");
    if (local.check.aliasing != alias_check::none) {
      if constexpr (with_squares)
        check_sparse_overlaps(tg_, *means_.outputs, squares_.outputs, scratch_);
      else
        check_sparse_overlaps(tg_, *means_.outputs, no_squares, scratch_);
    }

    std::size_t slot = 0;
    own_words_.assign(variables * sparse_variable_words, 0);
    for (std::size_t i = 0; i < variables; ++i) {
      std::uint64_t* v = own_words_.data() + i * sparse_variable_words;
      v[sv_identity] = with_entry(tg_, 0, i, [](const entry_t<TG>& e) {
        return identity_fingerprint(entry_traits<entry_t<TG>>::variable(e));
      });
      if (!scratch_.present[i]) continue;
      v[sv_present] = 1;
      v[sv_shape] = shape_fingerprint(scratch_.dense[i]);
      v[sv_rows] = sums_[i].indices.size();
      const std::size_t row_bytes = (with_squares ? 2 : 1) * sums_[i].row_length() * sizeof(Acc);
      slot += sums_[i].indices.size() * (sizeof(std::int64_t) + row_bytes);
    }
    header_[sh_towers] = std::ranges::size(tg_);
    header_[sh_variables] = variables;
    header_[sh_types] = type_code<S>() << 8 | sizeof(I);
    header_[sh_squares] = with_squares ? 1 : 0;
    header_[sh_slot] = (slot + 63) / 64 * 64;
    header_[sh_wire] = static_cast<std::uint64_t>(opts_.exchange.sparse);
    wire_.reserve(sparse_sets);
  }

  /// Collectives 1 to 3: every rank throws the same error, or none does.
  void agree(std::exception_ptr own, std::size_t failed_variable) {
    // Collective 1: the lowest rank that failed.
    constexpr std::uint64_t none = ~std::uint64_t{0};
    std::uint64_t first =
        own ? static_cast<std::uint64_t>(rank_) << 32 | std::min<std::uint64_t>(failed_variable, 0xffffffffu) : none;
    wire_.min_words(&first, 1);
    if (own) std::rethrow_exception(own);
    if (first != none) {
      const std::uint64_t var = first & 0xffffffffu;
      throw remote_error(std::string(Transport::caller) + ": rank " + std::to_string(first >> 32) +
                             " failed its own checks before any data moved (see the error thrown there); nothing "
                             "was averaged or written on any rank",
                         var == 0xffffffffu ? error::npos : static_cast<std::size_t>(var));
    }
    // Collective 2: the headers.
    headers_.resize(P_ * sparse_header_words);
    wire_.gather_words(header_, headers_.data(), sparse_header_words);
    disagree(sh_variables, "the number of variables", [](const std::string& m) { return tower_error(m); });
    disagree(sh_types, "the gradients' element or index type",
             [](const std::string& m) { return element_type_error(m); });
    disagree(sh_squares, "whether squares are passed", [](const std::string& m) { return output_error(m); });
    disagree(sh_wire, "options.exchange.sparse", [](const std::string& m) { return option_error(m); });
    variables_ = field(rank_, sh_variables);
    for (int r = 0; r < ranks_; ++r) {
      towers_ += field(r, sh_towers);
      slot_ = std::max<std::size_t>(slot_, field(r, sh_slot));
    }
    // Collective 3: every rank's words per variable.
    words_.resize(P_ * variables_ * sparse_variable_words);
    if (variables_ != 0) wire_.gather_words(own_words_.data(), words_.data(), variables_ * sparse_variable_words);
    for (std::size_t i = 0; i < variables_; ++i) agree_on_variable(i);
    choose_wire();
  }

  /// Rows or dense (sparse_wire), from what every rank gathered: the same choice on every rank.
  void choose_wire() {
    std::size_t elements = 0, index_slot = 0;
    dense_offset_.assign(variables_, 0);
    for (std::size_t i = 0; i < variables_; ++i) {
      dense_offset_[i] = elements;
      if (word(0, i, sv_present) != 0) elements += scratch_.dense[i].size();
    }
    dense_elements_ = elements;
    for (int r = 0; r < ranks_; ++r) {
      std::size_t bytes = 0;
      for (std::size_t i = 0; i < variables_; ++i) bytes += word(r, i, sv_rows) * sizeof(std::int64_t);
      index_slot = std::max(index_slot, (bytes + 63) / 64 * 64);
    }
    const double others = static_cast<double>(P_ - 1);
    const double rows_bytes = others * static_cast<double>(slot_);
    const double dense_bytes = others * static_cast<double>(index_slot) +
                               2 * others / static_cast<double>(P_) * static_cast<double>(elements) *
                                   (with_squares ? 2 : 1) * sizeof(Acc);
    const auto wire = static_cast<sparse_wire>(field(rank_, sh_wire));
    dense_ = wire == sparse_wire::dense || (wire == sparse_wire::automatic && rows_bytes > 0 &&
                                            rows_bytes >= sparse_rows_share * dense_bytes);
    if (dense_) slot_ = index_slot;
  }

  std::uint64_t field(int r, std::size_t f) const {
    return headers_[static_cast<std::size_t>(r) * sparse_header_words + f];
  }
  std::uint64_t word(int r, std::size_t i, std::size_t f) const {
    return words_[(static_cast<std::size_t>(r) * variables_ + i) * sparse_variable_words + f];
  }

  /// Throws make_error(message) on every rank when the ranks' header field f differs.
  template <class Make>
  void disagree(std::size_t f, const char* what, Make make_error) const {
    const rank_split split = split_ranks(ranks_, [&](int r) { return field(r, f); }, [](int) { return true; });
    if (split.odd.empty()) return;
    throw make_error(std::string(Transport::caller) + ": " + rank_list(split.odd) + " " +
                     verb_s(split.odd, "differs", "differ") + " from " + rank_list(split.common) + " in " + what);
  }

  /// Variable i's identity, presence and dense shape on every rank: the same error everywhere.
  void agree_on_variable(std::size_t i) const {
    const auto named = [&] { return std::string(Transport::caller) + ": " + describe_variable_at(tg_, i) + ": "; };
    if (const rank_split s = split_ranks(ranks_, [&](int r) { return word(r, i, sv_identity); },
                                         [&](int r) { return word(r, i, sv_identity) != 0; });
        !s.odd.empty())
      throw variable_mismatch_error(named() + rank_list(s.odd) + " " + verb_s(s.odd, "has", "have") +
                                        " another variable at this position than " + rank_list(s.common),
                                    i);
    if (const rank_split s =
            split_ranks(ranks_, [&](int r) { return word(r, i, sv_present); }, [](int) { return true; });
        !s.odd.empty()) {
      const bool odd_present = word(s.odd.front(), i, sv_present) != 0;
      throw missing_gradient_error(named() + "gradient missing on every tower of " +
                                       rank_list(odd_present ? s.common : s.odd) + " but present on " +
                                       rank_list(odd_present ? s.odd : s.common) +
                                       "; a gradient must be present on every tower of every rank or on none",
                                   i);
    }
    if (const rank_split s = split_ranks(ranks_, [&](int r) { return word(r, i, sv_shape); },
                                         [&](int r) { return word(r, i, sv_present) != 0; });
        !s.odd.empty())
      throw shape_error(named() + rank_list(s.odd) + " " + verb_s(s.odd, "has", "have") +
                            " another dense shape than " + rank_list(s.common) + " (this rank's: " +
                            describe_shape(scratch_.dense[i]) + ")",
                        i);
  }

  /// Every rank's rows (indices, then sums, then sums of squares, variable by variable) in its
  /// slot, to every rank; dense: the indices only, then move_dense().
  void move() {
    wire_bytes_.resize(P_ * slot_);
    std::byte* mine = wire_bytes_.data() + static_cast<std::size_t>(rank_) * slot_;
    auto put = [&](const void* p, std::size_t bytes) {
      if (bytes == 0) return;
      std::memcpy(mine, p, bytes);
      mine += bytes;
    };
    for (std::size_t i = 0; i < variables_; ++i) {
      if (!scratch_.present[i]) continue;
      for (const I index : sums_[i].indices) {
        const auto wide = static_cast<std::int64_t>(index);
        put(&wide, sizeof wide);
      }
      if (dense_) continue;
      put(sums_[i].values.data(), sums_[i].values.size() * sizeof(Acc));
      if constexpr (with_squares) put(square_sums_[i].values.data(), square_sums_[i].values.size() * sizeof(Acc));
    }
    if (slot_ != 0) {
      wire_.gather(0, wire_bytes_.data(), slice_layout{P_ * slot_, 1, ranks_});
      wire_.wait(0);
    }
    if (dense_) move_dense();
    wire_.rethrow_noted();
    at_.resize(P_);
    for (std::size_t r = 0; r < P_; ++r) at_[r] = wire_bytes_.data() + r * slot_;
  }

  /// The dense exchange of every rank's sums (sums of squares after all sums): each rank's dense
  /// sums (its listed rows, +0 elsewhere), each slice's contributions to its owner, summed there
  /// in rank order (with the zeros of the ranks that list a row nowhere: the rows exchange's sums,
  /// bit for bit), the sums back to every rank.
  void move_dense() {
    const std::size_t total = dense_elements_ * (with_squares ? 2 : 1);
    dense_sums_.assign(total, Acc(0));
    for (std::size_t i = 0; i < variables_; ++i) {
      if (!scratch_.present[i]) continue;
      const std::size_t length = row_length_of(scratch_.dense[i]);
      auto place = [&](const sums_t& from, std::size_t offset) {
        for (std::size_t n = 0; n < from.indices.size(); ++n)
          std::copy_n(from.values.begin() + static_cast<std::ptrdiff_t>(n * length), length,
                      dense_sums_.begin() + static_cast<std::ptrdiff_t>(
                                                offset + static_cast<std::size_t>(from.indices[n]) * length));
      };
      place(sums_[i], dense_offset_[i]);
      if constexpr (with_squares) place(square_sums_[i], dense_elements_ + dense_offset_[i]);
    }
    if (P_ == 1 || total == 0) return;
    // In buckets of the exchange's fusion size, each bucket's contributions sent while the
    // previous bucket is summed and sent back (three sets in flight; a set is reused once its
    // previous bucket's gather is complete).
    const std::size_t bucket = std::max<std::size_t>(
        1, (opts_.exchange.fusion_bytes != 0 ? opts_.exchange.fusion_bytes : wire_.automatic_fusion_bytes()) /
               sizeof(Acc));
    const std::size_t buckets = (total + bucket - 1) / bucket;
    const std::size_t room = (P_ - 1) * ((std::min(bucket, total) + P_ - 1) / P_) * sizeof(Acc);
    received_.resize(sparse_sets * room);
    auto layout_of = [&](std::size_t k) {
      return slice_layout{std::min(bucket, total - k * bucket), sizeof(Acc), ranks_};
    };
    auto bytes_of = [&](std::size_t k) { return reinterpret_cast<std::byte*>(dense_sums_.data() + k * bucket); };
    auto finish = [&](std::size_t k) {  // bucket k: its slice summed in rank order, sent back
      const std::size_t set = k % sparse_sets;
      wire_.wait(set);
      const slice_layout layout = layout_of(k);
      const std::size_t first = layout.first(rank_), count = layout.first(rank_ + 1) - first;
      Acc* own = dense_sums_.data() + k * bucket + first;
      const std::byte* received = received_.data() + set * room;
      for (int r = 0; r < ranks_; ++r) {
        if (r == rank_) {
          for (std::size_t j = 0; j < count; ++j) slice_[j] = r == 0 ? own[j] : slice_[j] + own[j];
          continue;
        }
        const std::byte* from = received + layout.received_at(r, rank_);
        for (std::size_t j = 0; j < count; ++j) {
          Acc x;
          std::memcpy(&x, from + j * sizeof(Acc), sizeof x);
          slice_[j] = r == 0 ? x : slice_[j] + x;
        }
      }
      std::copy_n(slice_.begin(), count, own);
      wire_.gather(set, bytes_of(k), layout);
    };
    slice_.resize(bucket);
    for (std::size_t k = 0; k < buckets; ++k) {
      const std::size_t set = k % sparse_sets;
      if (k >= sparse_sets) wire_.wait(set);  // bucket k - sparse_sets' gather
      wire_.scatter(set, bytes_of(k), received_.data() + set * room, layout_of(k));
      if (k >= 1) finish(k - 1);
    }
    finish(buckets - 1);
    for (std::size_t set = 0; set < sparse_sets; ++set) wire_.wait(set);
  }

  /// Variable i's outputs from every rank's rows: each listed row's sums added in rank order (a
  /// rank that lists it nowhere adds 0: first, where there is one, for x + 0 is x for every x but
  /// -0, and the sum of zeros +0, as in one process), divided by every rank's towers.
  void merge(std::size_t i) {
    const std::size_t length = row_length_of(scratch_.dense[i]);
    const auto dense_rows = static_cast<std::uint64_t>(scratch_.dense[i].dims[0]);
    std::vector<const std::byte*> values(P_), squared(P_);
    listed_.clear();
    for (std::size_t r = 0; r < P_; ++r) {
      const std::size_t rows = word(static_cast<int>(r), i, sv_rows);
      values[r] = at_[r] + rows * sizeof(std::int64_t);
      squared[r] = values[r] + rows * length * sizeof(Acc);
      for (std::size_t n = 0; n < rows; ++n) {
        std::int64_t index;
        std::memcpy(&index, at_[r] + n * sizeof index, sizeof index);
        listed_.push_back({static_cast<std::uint64_t>(index), r, n});
      }
      at_[r] = dense_ ? values[r] : squared[r] + (with_squares ? rows * length * sizeof(Acc) : 0);
    }
    std::sort(listed_.begin(), listed_.end(),
              [](const auto& a, const auto& b) { return a.row != b.row ? a.row < b.row : a.tower < b.tower; });
    std::size_t rows = 0;
    for (std::size_t e = 0; e < listed_.size(); ++e) rows += e == 0 || listed_[e].row != listed_[e - 1].row ? 1 : 0;
    means_.prepare(i, rows, scratch_.dense[i]);
    if constexpr (with_squares) squares_.prepare(i, rows, scratch_.dense[i]);
    O* const mean_base = means_.base(i);
    O* square_base = nullptr;
    if constexpr (with_squares) square_base = squares_.base(i);
    sum_.resize(length);
    square_.resize(length);
    row_copy_.resize(length);
    const auto divisor = static_cast<Acc>(towers_);
    auto write = [&](O* to, const std::vector<Acc>& from) {
      for (std::size_t j = 0; j < length; ++j) {
        const Acc q = from[j] / divisor;
        to[j] = static_cast<O>(q != q ? std::numeric_limits<Acc>::quiet_NaN() : q);
      }
    };
    std::uint64_t next_row = 0;
    for (std::size_t e = 0, place = 0; e < listed_.size(); ++place) {
      const std::uint64_t row = listed_[e].row;
      std::size_t end = e;
      while (end < listed_.size() && listed_[end].row == row) ++end;
      if (dense_)
        copy_dense(dense_offset_[i], row, length, sum_);
      else
        add(e, end, values, length, sum_);
      means_.fill(mean_base, next_row, row, length, O(0));
      means_.set_index(i, place, row);
      write(means_.row(mean_base, place, row, length), sum_);
      if constexpr (with_squares) {
        if (dense_)
          copy_dense(dense_elements_ + dense_offset_[i], row, length, square_);
        else
          add(e, end, squared, length, square_);
        squares_.fill(square_base, next_row, row, length, O(0));
        squares_.set_index(i, place, row);
        write(squares_.row(square_base, place, row, length), square_);
      }
      next_row = row + 1;
      e = end;
    }
    means_.fill(mean_base, next_row, dense_rows, length, O(0));
    if constexpr (with_squares) squares_.fill(square_base, next_row, dense_rows, length, O(0));
  }

  /// into = row `row` of the dense exchange's sums of the variable at `offset`.
  void copy_dense(std::size_t offset, std::uint64_t row, std::size_t length, std::vector<Acc>& into) const {
    std::copy_n(dense_sums_.begin() + static_cast<std::ptrdiff_t>(offset + static_cast<std::size_t>(row) * length),
                length, into.begin());
  }

  /// into = the rows of listed_[e, end) (one row, the ranks that list it, in rank order) added.
  void add(std::size_t e, std::size_t end, const std::vector<const std::byte*>& from, std::size_t length,
           std::vector<Acc>& into) {
    const bool every_rank = end - e == P_;
    for (std::size_t f = e; f < end; ++f) {
      std::memcpy(row_copy_.data(), from[listed_[f].tower] + listed_[f].position * length * sizeof(Acc),
                  length * sizeof(Acc));
      if (f == e && every_rank)
        std::copy(row_copy_.begin(), row_copy_.end(), into.begin());
      else if (f == e)
        for (std::size_t j = 0; j < length; ++j) into[j] = Acc(0) + row_copy_[j];
      else
        for (std::size_t j = 0; j < length; ++j) into[j] += row_copy_[j];
    }
  }

  Transport& wire_;
  const TG& tg_;
  const typename Transport::options_type& opts_;
  const int rank_, ranks_;
  const std::size_t P_;
  sparse_output_rows<Means, O> means_;
  square_rows_t squares_{};
  shared_detail::sparse_scratch scratch_;
  std::vector<sums_t> sums_, square_sums_;
  std::uint64_t header_[sparse_header_words] = {};
  std::vector<std::uint64_t> own_words_, headers_, words_;
  std::size_t variables_ = 0, towers_ = 0, slot_ = 0;
  std::vector<std::byte> wire_bytes_;
  std::vector<const std::byte*> at_;  // each rank's next bytes
  std::vector<shared_detail::sparse_scratch::entry> listed_;  // (row, rank, position)
  std::vector<Acc> sum_, square_, row_copy_;
  bool dense_ = false;                      // sparse_wire chosen: dense
  std::size_t dense_elements_ = 0;          // the averaged variables' elements
  std::vector<std::size_t> dense_offset_;   // per variable: its first in dense_sums_
  std::vector<Acc> dense_sums_, slice_;     // this rank's dense sums, then every rank's
  std::vector<std::byte> received_;         // the other ranks' contributions to this rank's slice
};

/// sparse_exchange as one call; prior: a failure before it, passed to the first collective.
template <class Transport, class TG, class Means, class Squares>
summary average_sparse_across(Transport& wire, const TG& tg, Means& means, Squares* squares,
                              const typename Transport::options_type& opts, std::exception_ptr prior) {
  return sparse_exchange<Transport, TG, Means, Squares>(wire, tg, means, squares, opts)(prior);
}

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
