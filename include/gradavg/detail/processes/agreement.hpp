// gradavg internals: what every rank of a call across processes agrees on before its data path,
// whatever the transport: the fingerprints, the header and per-variable words every rank
// contributes, the record gathered on a per-variable error, and the words of the errors that name
// ranks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../check.hpp"
#include "../elements.hpp"
#include "../isa.hpp"
#include "../messages.hpp"
#include "../../errors.hpp"
#include "../../tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// FNV-1a over bytes, never 0 (0 means "nothing to compare" in the reductions).
inline std::uint64_t fnv(const void* data, std::size_t n, std::uint64_t h = 1469598103934665603ull) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

inline std::uint64_t shape_fingerprint(const shape& s) noexcept {
  std::uint64_t h = fnv(&s.rank, sizeof s.rank);
  h = fnv(s.dims.data(), s.rank * sizeof(std::int64_t), h);
  std::size_t non_trivial = 0;
  for (std::size_t d = 0; d < s.rank; ++d) non_trivial += s.dims[d] > 1 ? 1 : 0;
  const int order = non_trivial > 1 && s.order == storage_order::col_major ? 1 : 0;  // as shape's ==
  h = fnv(&order, sizeof order, h);
  return h == 0 ? 1 : h;
}

/// A fingerprint of a variable that means the same in every process: strings and arithmetic
/// values; 0 (not compared) for other types (pointers and handles differ between processes).
template <class V>
std::uint64_t identity_fingerprint(const V& v) noexcept {
  std::uint64_t h = 0;
  if constexpr (std::is_same_v<V, std::string> || std::is_same_v<V, std::string_view>) {
    h = fnv(v.data(), v.size());
  } else if constexpr (std::is_same_v<std::remove_cv_t<V>, const char*> || std::is_same_v<std::remove_cv_t<V>, char*>) {
    h = v == nullptr ? 2 : fnv(v, std::strlen(v));
  } else if constexpr (std::is_arithmetic_v<V>) {
    h = fnv(&v, sizeof v);
  }
  return h == 0 && (std::is_arithmetic_v<V> || std::is_convertible_v<const V&, std::string_view>) ? 1 : h;
}

/// A nonzero code of element type S (header field h_types).
template <class S>
constexpr std::uint64_t type_code() noexcept {
  return static_cast<std::uint64_t>(gradavg::detail::element_of_type<S>()) + 1;
}

/// The fixed header every rank contributes to the first collective.
enum header_field : std::size_t {
  h_towers,
  h_variables,
  h_squares,    // squares outputs passed
  h_policy,     // on_nonfinite, statistics, accumulate
  h_range_begin,
  h_range_end,
  h_fusion_bytes,
  h_types,        // gradient and output element types
  h_weight_sum,   // bits of the double sum of this rank's weights (T when none)
  h_weighted_towers,  // this rank's towers of positive weight (T when no weights)
  h_scale,        // bits of the scale
  h_per_variable,  // per_variable passed
  h_exchange,     // the transport's method_code
  h_compression,  // options.exchange.compression
  h_output,       // options.exchange.output
  header_words
};

/// Per-variable words of the second collective (MPI_MAX): a value and its complement give the
/// maximum and the minimum over ranks.
enum variable_field : std::size_t { v_state, v_state_min, v_identity, v_identity_min, v_shape, v_shape_min, variable_words };

/// A variable's presence on one rank's towers.
enum presence : std::uint64_t { absent_everywhere = 0, partial = 1, present_everywhere = 2 };

/// What the third collective (only on a per-variable error) gathers from every rank.
enum record_field : std::size_t {
  r_state,
  r_present,
  r_towers,
  r_identity,
  r_shape,
  r_rank_dims,  // rank of the shape, then its dimensions, then the order
  r_missing = r_rank_dims + shape::max_rank + 2,  // the first missing towers
  r_missing_listed = r_missing + 8,
  record_words
};

/// The call's words, in one buffer (the workspace's) sized before the first collective so that no
/// collective allocates: every rank's header (rank order), this rank's per-variable words, their
/// reduction over the ranks, each variable's element count and first flat element, and the error
/// records (this rank's, then every rank's). Each part's place, for `ranks` ranks and `variables`
/// variables.
struct word_layout {
  std::uint64_t* base;
  std::size_t ranks, variables;

  [[nodiscard]] static std::size_t size(std::size_t ranks, std::size_t variables) noexcept {
    return ranks * header_words + variables * (2 * variable_words + 2) + (ranks + 1) * record_words;
  }
  [[nodiscard]] std::uint64_t* headers() const noexcept { return base; }
  [[nodiscard]] std::uint64_t* own_variables() const noexcept { return base + ranks * header_words; }
  [[nodiscard]] std::uint64_t* own_variable(std::size_t i) const noexcept {
    return own_variables() + i * variable_words;
  }
  [[nodiscard]] std::uint64_t* reduced() const noexcept { return own_variables() + variables * variable_words; }
  [[nodiscard]] std::uint64_t* sizes() const noexcept { return reduced() + variables * variable_words; }
  [[nodiscard]] std::uint64_t* own_record() const noexcept { return sizes() + 2 * variables; }
  [[nodiscard]] std::uint64_t* records() const noexcept { return own_record() + record_words; }
};

/// "float16 gradients into float32 outputs", from an h_types field.
inline std::string types_of(std::uint64_t codes) {
  auto name = [](std::uint64_t c) { return std::string(element_name(static_cast<element_type>(c - 1))); };
  return name(codes & 0xff) + " gradients into " + name(codes >> 8) + " outputs";
}

/// "rank 2", "ranks 1, 2 and 5", "ranks 1, 2, ... (40 in all)": at most 16 listed.
inline std::string rank_list(const std::vector<int>& ranks) {
  const std::size_t listed = std::min<std::size_t>(ranks.size(), 16);
  std::vector<std::size_t> r(ranks.begin(), ranks.begin() + static_cast<std::ptrdiff_t>(listed));
  return std::string(ranks.size() > 1 ? "ranks " : "rank ") + describe_towers(r.data(), r.size(), ranks.size());
}

/// The ranks that disagree with the most common value, and those that hold it.
struct rank_split {
  std::vector<int> odd, common;
};

/// Splits the ranks r in [0, ranks) with considered(r) by value(r): common holds the value most
/// ranks hold (on a tie, the lowest such rank's), odd every other. Built only on an error.
template <class Value, class Considered>
rank_split split_ranks(int ranks, const Value& value, const Considered& considered) {
  int best = -1;
  std::size_t best_count = 0;
  for (int r = 0; r < ranks; ++r) {
    if (!considered(r)) continue;
    std::size_t count = 0;
    for (int q = 0; q < ranks; ++q) count += considered(q) && value(q) == value(r) ? 1 : 0;
    if (count > best_count) best = r, best_count = count;
  }
  rank_split split;
  for (int r = 0; r < ranks; ++r)
    if (considered(r)) (value(r) == value(best) ? split.common : split.odd).push_back(r);
  return split;
}

/// "holds" or "hold" after a rank_list of these ranks.
inline const char* verb_s(const std::vector<int>& ranks, const char* one, const char* many) {
  return ranks.size() > 1 ? many : one;
}

inline double bits_to_double(std::uint64_t u) noexcept {
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}
inline std::uint64_t double_to_bits(double d) noexcept {
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

/// The divisor: every rank's weight sum (h_weight_sum) from the gathered headers, added in rank
/// order: the same value on every rank.
inline double weight_sum_of(const std::uint64_t* all, int ranks) noexcept {
  double sum = 0;
  for (int r = 0; r < ranks; ++r) sum += bits_to_double(all[static_cast<std::size_t>(r) * header_words + h_weight_sum]);
  return sum;
}

/// Throws the error every rank agrees on from every rank's header (all, rank order), if any:
/// variable counts, element types (among the ranks that read a gradient), the options every rank
/// passes alike, and the divisor, weight_sum, against the accumulator's largest value. The
/// messages begin with caller. Allocates nothing unless ranks disagree (then every rank throws).
inline void agree_on_headers(const char* caller, const std::uint64_t* all, int ranks, double weight_sum,
                             double accumulator_max) {
  auto field = [&](int r, header_field f) { return all[static_cast<std::size_t>(r) * header_words + f]; };
  auto every_rank = [](int) { return true; };
  auto split_on = [&](header_field f) {
    for (int r = 1; r < ranks; ++r)
      if (field(r, f) != field(0, f)) return split_ranks(ranks, [&](int q) { return field(q, f); }, every_rank);
    return rank_split{};
  };
  if (const rank_split d = split_on(h_variables); !d.odd.empty())
    throw tower_error(std::string(caller) + ": " + rank_list(d.odd) + " " + verb_s(d.odd, "holds", "hold") + " " +
                      std::to_string(field(d.odd.front(), h_variables)) + " variables but " + rank_list(d.common) +
                      " " + verb_s(d.common, "holds", "hold") + " " +
                      std::to_string(field(d.common.front(), h_variables)) +
                      "; every rank must list the same variables in the same order");
  struct named {
    header_field f;
    const char* what;
  };
  {
    // Among the ranks that read a gradient (a rank whose variables are all skipped reads none).
    auto reads = [&](int r) { return field(r, h_types) != 0; };
    bool differ = false;
    for (int r = 0, first = -1; r < ranks && !differ; ++r)
      if (reads(r)) {
        if (first < 0) first = r;
        differ = field(r, h_types) != field(first, h_types);
      }
    const rank_split d = differ ? split_ranks(ranks, [&](int r) { return field(r, h_types); }, reads) : rank_split{};
    if (!d.odd.empty())
      throw option_error(std::string(caller) + ": " + rank_list(d.odd) + " " + verb_s(d.odd, "passes ", "pass ") +
                         types_of(field(d.odd.front(), h_types)) + " but " + rank_list(d.common) + " " +
                         verb_s(d.common, "passes ", "pass ") + types_of(field(d.common.front(), h_types)) +
                         "; every rank must pass the same element types");
  }
  for (const named& n : {named{h_squares, "whether squares outputs are passed"},
                         named{h_policy, "options.compute.on_nonfinite, statistics or accumulate"},
                         named{h_range_begin, "options.compute.range"}, named{h_range_end, "options.compute.range"},
                         named{h_fusion_bytes, "options.exchange.fusion_bytes"},
                         named{h_scale, "options.compute.scale"},
                         named{h_per_variable, "whether options.compute.per_variable is passed"},
                         named{h_exchange, "options.exchange.method"},
                         named{h_compression, "options.exchange.compression"},
                         named{h_output, "options.exchange.output"}})
    if (const rank_split d = split_on(n.f); !d.odd.empty())
      throw option_error(std::string(caller) + ": " + rank_list(d.odd) + " " + verb_s(d.odd, "passes", "pass") +
                         " a different " + std::string(n.what) + " than " + rank_list(d.common) +
                         "; every rank must pass the same");
  if (!gradavg::detail::usable_weight_sum(weight_sum, accumulator_max))
    throw weight_error(std::string(caller) + ": options.compute.weights sum to " +
                       gradavg::detail::describe_number(weight_sum) +
                       " over the towers of every rank; that sum must be positive and finite (a normal number in "
                       "the accumulator type); one rank's may be 0");
}

/// How the ranks' words about one variable disagree, in the order they are looked for.
enum class disagreement : unsigned char { none, identity, presence, dimensions };

/// The first variable whose words disagree, and how (disagreement::none: every variable agrees).
inline std::pair<std::size_t, disagreement> first_disagreement(const std::uint64_t* reduced, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t* w = reduced + i * variable_words;
    const std::uint64_t id_max = w[v_identity], id_min = ~w[v_identity_min];
    if (id_max != 0 && w[v_identity_min] != 0 && id_max != id_min) return {i, disagreement::identity};
    const std::uint64_t st_max = w[v_state], st_min = ~w[v_state_min];
    if (st_max != st_min || st_max == partial) return {i, disagreement::presence};
    if (st_max == present_everywhere && w[v_shape] != ~w[v_shape_min]) return {i, disagreement::dimensions};
  }
  return {count, disagreement::none};
}

/// Throws the error of kind `how` (first_disagreement) about variable i, named `name`, from every
/// rank's record of it (all: ranks records of record_words each), the same on every rank.
[[noreturn]] inline void throw_variable_disagreement(const std::string& name, std::size_t i, disagreement how,
                                                     const std::uint64_t* all, int ranks) {
  auto rec = [&](int r) { return all + static_cast<std::size_t>(r) * record_words; };
  auto shape_of = [&](int r) {
    shape t{};
    t.rank = rec(r)[r_rank_dims];
    for (std::size_t d = 0; d < t.rank; ++d) t.dims[d] = static_cast<std::int64_t>(rec(r)[r_rank_dims + 1 + d]);
    t.order = static_cast<storage_order>(rec(r)[r_rank_dims + 1 + shape::max_rank]);
    return t;
  };
  if (how == disagreement::identity) {
    const rank_split d = split_ranks(
        ranks, [&](int r) { return rec(r)[r_identity]; }, [](int) { return true; });
    throw variable_mismatch_error(name + ": " + rank_list(d.odd) + " " + verb_s(d.odd, "has", "have") +
                                      " a different variable at this position than " + rank_list(d.common) +
                                      "; every rank must list "
                                      "the same variables in the same order",
                                  i);
  }
  if (how == disagreement::presence) {
    std::string missing, holding;
    std::size_t total = 0, total_present = 0;
    for (int r = 0; r < ranks; ++r) {
      const std::uint64_t* x = rec(r);
      total += x[r_towers];
      total_present += x[r_present];
      if (x[r_present] == x[r_towers]) {
        holding += (holding.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r);
        continue;
      }
      std::size_t absent = x[r_towers] - x[r_present];
      std::size_t shown = std::min<std::size_t>(absent, r_missing_listed - r_missing);
      std::vector<std::size_t> ks(x + r_missing, x + r_missing + shown);
      missing += (missing.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " (tower" +
                 (absent > 1 ? "s " : " ") + describe_towers(ks.data(), shown, absent) + " of " +
                 std::to_string(x[r_towers]) + ")";
    }
    throw missing_gradient_error(name + ": gradient missing on " + missing + " but present on " +
                                     (holding.empty() ? std::string("the other towers") : holding) + " (" +
                                     std::to_string(total_present) + " of " + std::to_string(total) +
                                     " towers in all); a gradient must be present on every tower of every rank or on none",
                                 i);
  }
  const rank_split d = split_ranks(
      ranks, [&](int r) { return rec(r)[r_shape]; }, [&](int r) { return rec(r)[r_state] == present_everywhere; });
  throw shape_error(name + ": gradient has shape " + describe_shape(shape_of(d.odd.front())) + " on " +
                        rank_list(d.odd) + " but shape " + describe_shape(shape_of(d.common.front())) + " on " +
                        rank_list(d.common),
                    i);
}

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
