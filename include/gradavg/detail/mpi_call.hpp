// gradavg internals: one gradavg::mpi call — the local checks, the agreement collectives, the
// buckets' fill, exchange and unpack (the file comment of <gradavg/mpi.hpp> describes them).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../average.hpp"
#include "mpi_support.hpp"

namespace gradavg {
namespace mpi {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace mpi_detail {

/// One call: TG the towers, Means/Squares the output ranges (Squares = nullptr_t: none), S and O
/// the element types the gradients are read as and the outputs written as (value_types, or the
/// run-time types this rank found), Buf the fusion buffer's element type.
template <class TG, class Means, class Squares, class S, class O>
struct call {
  using Buf = gradavg::detail::accumulator_t<S>;
  using V = gradavg::detail::variable_t<TG>;
  static constexpr bool with_squares = !std::is_same_v<Squares, std::nullptr_t>;

  MPI_Comm comm;
  const TG& tg;
  Means& means;
  Squares* squares;
  const mpi::options& opts;
  workspace_detail::buffers& work;
  plan* planned = nullptr;  // the caller's plan, or null
  // This rank's plan (local_checks): 0 it does not hold (or there is none), 1 it holds but the
  // headers must be gathered again (weights passed, or a value that may change from step to step
  // differs from the agreed one), 2 it holds. Collective 1 takes the minimum over the ranks.
  std::uint64_t plan_state = 0;
  int rank = 0, ranks = 1;
  std::size_t towers = 0, variables = 0;
  // The first MPI call of the data path that returned an error: thrown after the last collective
  // (throwing at once would leave the other ranks waiting for this rank's messages).
  const char* failed_mpi_call = nullptr;
  int failed_mpi_code = MPI_SUCCESS;
  void note(int rc, const char* function) noexcept {
    if (rc != MPI_SUCCESS && failed_mpi_call == nullptr) failed_mpi_call = function, failed_mpi_code = rc;
  }

  // ---- Agreement. ----

  /// A plan's agreed words, in order: [communicator, ranks, rank, variables], this rank's header
  /// as sent, every rank's header, the reduced per-variable words, this rank's own per-variable
  /// words; the *_at functions say where each part begins (work.words' own layout: local_checks).
  static constexpr std::size_t agreed_prefix = 4;
  std::size_t variable_word_count() const noexcept { return variables * variable_words; }
  std::size_t agreed_headers_at() const noexcept { return agreed_prefix + header_words; }
  std::size_t agreed_reduced_at() const noexcept {
    return agreed_headers_at() + static_cast<std::size_t>(ranks) * header_words;
  }
  std::size_t agreed_own_at() const noexcept { return agreed_reduced_at() + variable_word_count(); }
  std::size_t agreed_words() const noexcept { return agreed_own_at() + variable_word_count(); }
  std::uint64_t comm_bits() const noexcept {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &comm, std::min(sizeof comm, sizeof bits));
    return bits;
  }

  /// Header fields that may change from step to step without a new agreement on the variables:
  /// gathered again (collective 2) when they differ from the agreed ones.
  static constexpr bool step_value(std::size_t f) noexcept {
    return f == h_weight_sum || f == h_weighted_towers || f == h_scale || f == h_samples || f == h_range_begin ||
           f == h_range_end;
  }

  /// This rank's plan_state: 0 unless its buffers are the ones it proved (matches_plan) and its
  /// header, but for the step values, the one it sent when every rank agreed on this
  /// communicator; then 1 where weights are passed or a step value differs, else 2.
  std::uint64_t plan_state_here(std::uint64_t* header) {
    using gradavg::detail::plan_access;
    if (planned == nullptr ||
        !gradavg::detail::matches_plan<S, O>(*planned, &plan_detail::signature_of<TG, Means, Squares>, tg, means,
                                             squares, opts))
      return 0;
    if (plan_access::averaged(*planned) == 0) header[h_types] = 0;  // reads no gradient (local_checks)
    const std::vector<std::uint64_t>& agreed = plan_access::agreed(*planned);
    if (agreed.size() != agreed_words() || agreed[0] != comm_bits() || agreed[1] != static_cast<std::uint64_t>(ranks) ||
        agreed[2] != static_cast<std::uint64_t>(rank) || agreed[3] != variables)
      return 0;
    bool step_values_differ = false;
    for (std::size_t f = 0; f < header_words; ++f)
      if (header[f] != agreed[agreed_prefix + f]) {
        if (!step_value(f)) return 0;
        step_values_differ = true;
      }
    return step_values_differ || !opts.weights.empty() ? 1 : 2;
  }

  /// After every rank agreed: the plan keeps it (its room was reserved by local_checks).
  void keep_agreement(const std::uint64_t* header) noexcept {
    std::vector<std::uint64_t>& agreed = gradavg::detail::plan_access::agreed(*planned);
    agreed.resize(agreed_words());
    agreed[0] = comm_bits();
    agreed[1] = static_cast<std::uint64_t>(ranks);
    agreed[2] = static_cast<std::uint64_t>(rank);
    agreed[3] = variables;
    const std::size_t headers = static_cast<std::size_t>(ranks) * header_words, vw = variable_word_count();
    const std::uint64_t* own = work.words.data() + headers;
    std::copy(header, header + header_words, agreed.data() + agreed_prefix);
    std::copy(work.words.data(), work.words.data() + headers, agreed.data() + agreed_headers_at());
    std::copy(own + vw, own + 2 * vw, agreed.data() + agreed_reduced_at());
    std::copy(own, own + vw, agreed.data() + agreed_own_at());
  }

  /// Where the agreed words of a plan that holds go back in work.words: this rank's own
  /// per-variable words before collective 1 (collective 3 needs them if another rank's plan does
  /// not hold), and after it, when every rank's holds, the headers and the reduced words the data
  /// path reads.
  void restore_own_words() noexcept {
    const std::uint64_t* agreed = gradavg::detail::plan_access::agreed(*planned).data();
    std::copy(agreed + agreed_own_at(), agreed + agreed_words(),
              work.words.data() + static_cast<std::size_t>(ranks) * header_words);
  }
  void restore_agreement() noexcept {
    const std::uint64_t* agreed = gradavg::detail::plan_access::agreed(*planned).data();
    const std::size_t headers = static_cast<std::size_t>(ranks) * header_words;
    std::copy(agreed + agreed_headers_at(), agreed + agreed_reduced_at(), work.words.data());
    std::copy(agreed + agreed_reduced_at(), agreed + agreed_own_at(),
              work.words.data() + headers + variable_word_count());
  }

  /// This rank's header, per-variable words (presence, fingerprints) and, when they pass, its
  /// tables and buffers (prepare()). work.words: [header of every rank (P * header_words)]
  /// [variable words (V * variable_words)] [their reduction] [sizes, offsets (2V)]
  /// [error records (P + 1) * record_words]: sized here, so that no collective of the call needs
  /// an allocation. The failure, if any: this rank's own error, with the variable it names in
  /// *failed_variable (error::npos when none).
  std::exception_ptr local_checks(std::exception_ptr prior, std::uint64_t* header, std::size_t* failed_variable) {
    *failed_variable = error::npos;
    header[h_towers] = std::ranges::size(tg);
    header[h_variables] = 0;
    header[h_squares] = with_squares;
    header[h_policy] = static_cast<std::uint64_t>(opts.on_nonfinite) | (opts.statistics ? 16u : 0u) |
                       (static_cast<std::uint64_t>(opts.accumulate) << 8);
    header[h_range_begin] = opts.range.begin;
    header[h_range_end] = opts.range.end;
    header[h_fusion_bytes] = opts.fusion_bytes;
    header[h_types] = type_code<S>() | type_code<O>() << 8;
    header[h_scale] = double_to_bits(opts.scale);
    header[h_samples] = double_to_bits(opts.samples_per_tower);
    header[h_per_variable] = opts.per_variable.empty() ? 0 : 1;
    header[h_exchange] = static_cast<std::uint64_t>(opts.exchange);
    double weight_sum = static_cast<double>(std::ranges::size(tg));
    if (!opts.weights.empty()) {
      weight_sum = 0;
      for (double w : opts.weights) weight_sum += w;
    }
    header[h_weight_sum] = double_to_bits(weight_sum);
    header[h_weighted_towers] =
        opts.weights.empty() ? std::ranges::size(tg) : gradavg::detail::positive_weights(opts.weights);
    std::exception_ptr failure = prior;
    if (!failure) {
      try {
        towers = std::ranges::size(tg);
        variables = towers == 0 ? 0 : std::ranges::size(gradavg::detail::at(tg, 0));
        header[h_variables] = variables;
        const std::size_t P = static_cast<std::size_t>(ranks);
        work.words.resize(P * header_words + variables * (2 * variable_words + 2) + (P + 1) * record_words);
        if (opts.fusion_bytes != 0 && (opts.fusion_bytes < sizeof(Buf) * 2 || opts.fusion_bytes > (std::size_t{1} << 30)))
          throw option_error("gradavg::mpi: options.fusion_bytes is " + std::to_string(opts.fusion_bytes) +
                             "; it must hold two elements and be at most 1 GiB (or be 0: automatic)");
        if (planned != nullptr) gradavg::detail::check_no_layout_with(*planned, opts);
        plan_state = plan_state_here(header);
        if (plan_state != 0) {
          gradavg::detail::validate_options(opts, towers, variables, gradavg::detail::accumulator_max<S>(opts), true);
          restore_own_words();
          prepare();
          return failure;
        }
        gradavg::options proving;  // with a plan: opts, the checks' layout kept in the plan
        if (planned != nullptr) proving = gradavg::detail::proving_into(*planned, opts);
        bool proved = true;
        gradavg::detail::validated v;
        try {
          gradavg::detail::check_scratch scratch;
          const gradavg::options& checked = opts;
          v = gradavg::detail::validate_into<TG, Means, Squares, S, O>(tg, means, squares,
                                                                      planned != nullptr ? proving : checked, scratch);
        } catch (const missing_gradient_error&) {
          // Decided with every rank's presence below (the same error on every rank).
          proved = false;
        }
        gradavg::detail::validate_options(opts, towers, variables, gradavg::detail::accumulator_max<S>(opts), true);
        if (planned != nullptr && proved) {
          gradavg::detail::keep_proof<S, O>(*planned, &plan_detail::signature_of<TG, Means, Squares>, tg, v,
                                            opts.aliasing);
          gradavg::detail::plan_access::agreed(*planned).reserve(agreed_words());  // keep_agreement's room
        }
        std::uint64_t* w = work.words.data() + ranks * header_words;
        bool any_present = false;
        for (std::size_t i = 0; i < variables; ++i, w += variable_words) {
          std::size_t present = 0;
          shape s{};
          for (std::size_t k = 0; k < towers; ++k) {
            const auto g = gradavg::detail::read_gradient(tg, k, i);
            if (g.present && present++ == 0) s = g.dims;
          }
          any_present = any_present || present != 0;
          const std::uint64_t state = present == 0 ? absent_everywhere : present == towers ? present_everywhere : partial;
          const std::uint64_t id = gradavg::detail::with_entry(tg, 0, i, [](const auto& e) {
            return identity_fingerprint(gradavg::entry_traits<std::remove_cvref_t<decltype(e)>>::variable(e));
          });
          const std::uint64_t sh = present ? shape_fingerprint(s) : 0;
          w[v_state] = state;
          w[v_state_min] = ~state;
          w[v_identity] = id;
          w[v_identity_min] = id == 0 ? 0 : ~id;
          w[v_shape] = sh;
          w[v_shape_min] = sh == 0 ? 0 : ~sh;
        }
        // A rank that reads no gradient moves no data: its element types (run-time ones are only
        // known from a gradient) are not compared; the presence check decides.
        if (!any_present) header[h_types] = 0;
        prepare();
      } catch (const error& e) {
        failure = std::current_exception();
        *failed_variable = e.variable_index();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    return failure;
  }

  /// The divisor: every rank's weight sum from the gathered headers, added in rank order (the same
  /// value on every rank, checked in agreement and used by the data path).
  double total_weight(const std::uint64_t* all) const noexcept {
    double sum = 0;
    for (int r = 0; r < ranks; ++r)
      sum += bits_to_double(all[static_cast<std::size_t>(r) * header_words + h_weight_sum]);
    return sum;
  }

  /// Throws the error every rank agrees on from the gathered headers, if any. Allocates nothing
  /// unless ranks disagree (then every rank throws).
  void agree_on_headers(const std::uint64_t* all) const {
    auto field = [&](int r, header_field f) { return all[static_cast<std::size_t>(r) * header_words + f]; };
    auto every_rank = [](int) { return true; };
    auto split_on = [&](header_field f) {
      for (int r = 1; r < ranks; ++r)
        if (field(r, f) != field(0, f)) return split_ranks(ranks, [&](int q) { return field(q, f); }, every_rank);
      return rank_split{};
    };
    if (const rank_split d = split_on(h_variables); !d.odd.empty())
      throw tower_error("gradavg::mpi: " + rank_list(d.odd) + " " + verb_s(d.odd, "holds", "hold") + " " +
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
        throw option_error("gradavg::mpi: " + rank_list(d.odd) + " " + verb_s(d.odd, "passes ", "pass ") +
                           types_of(field(d.odd.front(), h_types)) + " but " + rank_list(d.common) + " " +
                           verb_s(d.common, "passes ", "pass ") + types_of(field(d.common.front(), h_types)) +
                           "; every rank must pass the same element types");
    }
    for (const named& n : {named{h_squares, "whether squares outputs are passed"},
                           named{h_policy, "options.on_nonfinite, statistics or accumulate"},
                           named{h_range_begin, "options.range"}, named{h_range_end, "options.range"},
                           named{h_fusion_bytes, "options.fusion_bytes"}, named{h_scale, "options.scale"},
                           named{h_samples, "options.samples_per_tower"},
                           named{h_per_variable, "whether options.per_variable is passed"},
                           named{h_exchange, "options.exchange"}})
      if (const rank_split d = split_on(n.f); !d.odd.empty())
        throw option_error("gradavg::mpi: " + rank_list(d.odd) + " " + verb_s(d.odd, "passes", "pass") +
                           " a different " + std::string(n.what) + " than " + rank_list(d.common) +
                           "; every rank must pass the same");
    const double weight_sum = total_weight(all);
    if (!gradavg::detail::usable_weight_sum(weight_sum, gradavg::detail::accumulator_max<S>(opts)))
      throw weight_error("gradavg::mpi: options.weights sum to " + gradavg::detail::describe_number(weight_sum) +
                         " over the towers of every rank; that sum must be positive and finite (a normal number in "
                         "the accumulator type); one rank's may be 0");
  }

  /// The first variable whose words disagree, and how: 0 none, 1 identity, 2 presence, 3 shape.
  static std::pair<std::size_t, int> first_disagreement(const std::uint64_t* reduced, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t* w = reduced + i * variable_words;
      const std::uint64_t id_max = w[v_identity], id_min = ~w[v_identity_min];
      if (id_max != 0 && w[v_identity_min] != 0 && id_max != id_min) return {i, 1};
      const std::uint64_t st_max = w[v_state], st_min = ~w[v_state_min];
      if (st_max != st_min || st_max == partial) return {i, 2};
      if (st_max == present_everywhere && w[v_shape] != ~w[v_shape_min]) return {i, 3};
    }
    return {count, 0};
  }

  /// Gathers every rank's record of variable i and throws the error of kind `how`.
  [[noreturn]] void throw_variable_error(std::size_t i, int how) {
    // This rank's record, then every rank's, in the space local_checks reserved: the gather
    // allocates nothing, and an exception from tensor_traits here is rethrown only after it.
    std::uint64_t* const mine = work.words.data() + static_cast<std::size_t>(ranks) * header_words +
                                variables * (2 * variable_words + 2);
    std::uint64_t* const all = mine + record_words;
    std::fill(mine, mine + record_words, std::uint64_t{0});
    std::size_t present = 0, listed = 0;
    shape s{};
    std::exception_ptr reading;
    try {
      for (std::size_t k = 0; k < towers; ++k) {
        const auto g = gradavg::detail::read_gradient(tg, k, i);
        if (g.present) {
          if (present++ == 0) s = g.dims;
        } else if (listed < r_missing_listed - r_missing) {
          mine[r_missing + listed++] = k;
        }
      }
    } catch (...) {
      reading = std::current_exception();
    }
    const std::uint64_t* own = work.words.data() + ranks * header_words + i * variable_words;
    mine[r_state] = own[v_state];
    mine[r_present] = present;
    mine[r_towers] = towers;
    mine[r_identity] = own[v_identity];
    mine[r_shape] = own[v_shape];
    mine[r_rank_dims] = s.rank;
    for (std::size_t d = 0; d < s.rank; ++d) mine[r_rank_dims + 1 + d] = static_cast<std::uint64_t>(s.dims[d]);
    mine[r_rank_dims + 1 + shape::max_rank] = static_cast<std::uint64_t>(s.order);
    check(MPI_Allgather(mine, record_words, MPI_UINT64_T, all, record_words, MPI_UINT64_T, comm), "MPI_Allgather");
    if (reading) std::rethrow_exception(reading);
    auto rec = [&](int r) { return all + static_cast<std::size_t>(r) * record_words; };
    auto shape_of = [&](int r) {
      shape t{};
      t.rank = rec(r)[r_rank_dims];
      for (std::size_t d = 0; d < t.rank; ++d) t.dims[d] = static_cast<std::int64_t>(rec(r)[r_rank_dims + 1 + d]);
      t.order = static_cast<storage_order>(rec(r)[r_rank_dims + 1 + shape::max_rank]);
      return t;
    };
    const std::string name = describe_variable_at(tg, i);
    if (how == 1) {
      const rank_split d = split_ranks(
          ranks, [&](int r) { return rec(r)[r_identity]; }, [](int) { return true; });
      throw variable_mismatch_error(name + ": " + rank_list(d.odd) + " " + verb_s(d.odd, "has", "have") +
                                        " a different variable at this position than " + rank_list(d.common) +
                                        "; every rank must list "
                                        "the same variables in the same order",
                                    i);
    }
    if (how == 2) {
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

  // ---- The data path. ----

  /// The towers of one variable from element `offset` on, for the kernel's tower_reader.
  struct piece_towers {
    const void* const* towers;
    std::size_t offset;
    static const S* first_element(const void* context, std::size_t k) {
      const auto* self = static_cast<const piece_towers*>(context);
      return static_cast<const S*>(self->towers[k]) + self->offset;
    }
  };

  struct bucket_set {
    Buf* local = nullptr;  // the fusion buffer, then the gathered sums
    Buf* recv = nullptr;   // the other ranks' contributions to this rank's slice, in rank order
    MPI_Request* requests = nullptr;  // 2 (P - 1): a receive and a send per other rank
    int* counts = nullptr;            // 4 P: exchange_method::collectives' counts and displacements
    int pending = 0;                  // requests in use
  };

  // ---- Preparation: every table and buffer the data path uses, before any collective. ----

  /// Each variable's element count and first flat element, in work.words (prepare()).
  std::uint64_t* sizes = nullptr;
  /// Bucket geometry and the buffers behind it (prepare()).
  std::size_t total = 0;            // elements of the variables present on every local tower
  std::size_t range_begin = 0, range_end = 0;
  std::size_t bucket_elements = 0, buckets = 0;
  bool stream_outputs = false;  // options.stores decided for this rank's data (prepare())
  bucket_set set[3] = {};

  bool squares_in_buffer() const noexcept { return with_squares || opts.statistics; }
  bool detect() const noexcept { return opts.on_nonfinite != nonfinite_policy::ignore; }

  /// This rank's tables (tower pointers, outputs, sizes and offsets, per-variable sums) and fusion
  /// buffers, from its own towers: a variable present on every local tower is taken as averaged
  /// (agreement throws before the data path where that is not so on every rank). Every
  /// tensor_traits call and every allocation of the call after validation happens here, before
  /// the first collective, so that a failure here reaches every rank through it.
  void prepare() {
    work.towers.resize(variables * towers);
    work.outputs.resize(2 * variables);
    work.sums.resize(3 * variables);
    sizes = work.words.data() + ranks * header_words + 2 * variables * variable_words;
    total = 0;
    for (std::size_t i = 0; i < variables; ++i) {
      std::size_t size = 0;
      bool everywhere = towers != 0;
      for (std::size_t k = 0; k < towers && everywhere; ++k) {
        const auto g = gradavg::detail::read_gradient<TG, S>(tg, k, i);
        everywhere = g.present;
        work.towers[i * towers + k] = g.data;
        size = g.dims.size();
      }
      if (everywhere) {
        work.outputs[2 * i] = gradavg::detail::read_output<Means, O>(means, i).data;
        if constexpr (with_squares)
          work.outputs[2 * i + 1] = gradavg::detail::read_output<Squares, O>(*squares, i).data;
        else work.outputs[2 * i + 1] = nullptr;
      } else {
        size = 0;
      }
      sizes[2 * i] = size;
      sizes[2 * i + 1] = total;
      total += size;
      work.sums[3 * i] = work.sums[3 * i + 1] = work.sums[3 * i + 2] = 0;
    }
    range_begin = std::min(opts.range.begin, total);
    range_end = std::min(opts.range.end, total);
    buckets = 0;
    // The rank's reads of its towers and writes of its outputs decide the stores (options.stores).
    stream_outputs = gradavg::detail::streams(
        opts, (range_end - std::min(range_begin, range_end)) * (towers * sizeof(S) + (with_squares ? 2 : 1) * sizeof(O)));
    if (range_begin >= range_end) return;

    // Buckets: E elements each (means and squares), a flag per variable touching it behind them.
    const std::size_t per_element = sizeof(Buf) * (squares_in_buffer() ? 2 : 1);
    const std::size_t fusion_bytes = opts.fusion_bytes != 0 ? opts.fusion_bytes : mpi::automatic_fusion_bytes(ranks);
    bucket_elements = std::max<std::size_t>(1, fusion_bytes / per_element);
    const std::size_t n = range_end - range_begin;
    buckets = (n + bucket_elements - 1) / bucket_elements;
    // Most variables one bucket can touch: bounded by its elements and by the variable count.
    const std::size_t max_flags = detect() ? std::min(variables, bucket_elements) + 1 : 0;
    const std::size_t max_len = std::min(bucket_elements, n) * (squares_in_buffer() ? 2 : 1) + max_flags;
    const std::size_t max_slice = (max_len + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    const std::size_t sets = std::min<std::size_t>(3, buckets);
    const std::size_t set_elements = max_len + max_slice * static_cast<std::size_t>(ranks);
    work.buffers.resize(sets * set_elements * sizeof(Buf));  // new[]: aligned for any Buf
    Buf* base = reinterpret_cast<Buf*>(work.buffers.data());
    const std::size_t P = static_cast<std::size_t>(ranks);
    work.requests.assign(sets * 2 * P, MPI_REQUEST_NULL);
    work.counts.resize(opts.exchange == mpi::exchange_method::collectives ? sets * 4 * P : 0);
    for (std::size_t s = 0; s < sets; ++s)
      set[s] = {base + s * set_elements, base + s * set_elements + max_len, work.requests.data() + s * 2 * P,
                work.counts.empty() ? nullptr : work.counts.data() + s * 4 * P, 0};
  }

  // ---- The data path, after agreement: tables and buffers only, no tensor_traits call and no
  // allocation. Its one source of exceptions, the executor (user code) running the kernel, is
  // answered by zeros in this rank's place and the last collective. ----

  /// One bucket: its flat element range and its buffer's layout.
  struct bucket_shape {
    std::size_t begin, end;       // flat
    std::size_t first_variable;   // the first variable with an element in it
    std::size_t flags;            // variables with an element in it (detect)
    std::size_t len;              // Buf elements in the buffer
  };
  static constexpr std::size_t piece_elements = std::size_t{1} << 16;  // between progress calls

  /// Set by run(): the global weight sum (the divisor), the fused parameters, the first variable
  /// shape_of_bucket looks at, and the sums over the finished variables.
  double weight_sum = 0;
  bool fused = false;
  gradavg::detail::fused_params<Buf> params{};
  std::size_t walk_variable = 0;
  double everything_mean_squared = 0, everything_mean_of_squares = 0;
  std::size_t nonfinite_variables = 0;

  bool zero_nonfinite() const noexcept { return opts.on_nonfinite == nonfinite_policy::zero; }
  std::size_t element_bytes() const noexcept { return sizeof(Buf) * (squares_in_buffer() ? 2 : 1); }
  std::size_t set_count() const noexcept { return std::min<std::size_t>(3, buckets); }
  /// options.exchange: MPI_Ialltoallv and MPI_Iallgatherv (counts and displacements in bytes, in
  /// bucket_set::counts), or point-to-point messages (tags exchange_tag and gather_tag on comm).
  bool collectives() const noexcept { return opts.exchange == mpi::exchange_method::collectives; }
  /// Variable i's element count and first flat element (prepare()'s table).
  std::size_t size_of(std::size_t i) const noexcept { return static_cast<std::size_t>(sizes[2 * i]); }
  std::size_t offset_of(std::size_t i) const noexcept { return static_cast<std::size_t>(sizes[2 * i + 1]); }
  std::size_t slice_begin(std::size_t len, int r) const noexcept {
    return len * static_cast<std::size_t>(r) / static_cast<std::size_t>(ranks);
  }
  static int bytes_of(std::size_t elements) noexcept { return static_cast<int>(elements * sizeof(Buf)); }

  /// Bucket b (buckets are shaped in order: walk_variable only moves forward).
  bucket_shape shape_of_bucket(std::size_t b) {
    bucket_shape sh;
    sh.begin = range_begin + b * bucket_elements;
    sh.end = std::min(range_end, sh.begin + bucket_elements);
    while (walk_variable < variables && offset_of(walk_variable) + size_of(walk_variable) <= sh.begin) ++walk_variable;
    sh.first_variable = walk_variable;
    std::size_t v = walk_variable, flags = 0;
    for (; v < variables && offset_of(v) < sh.end; ++v) flags += size_of(v) != 0 ? 1 : 0;
    sh.flags = detect() ? flags : 0;
    const std::size_t elements = sh.end - sh.begin;
    sh.len = elements * (squares_in_buffer() ? 2 : 1) + sh.flags;
    return sh;
  }

  /// Progress of outstanding nonblocking collectives while the kernel runs (MPI libraries
  /// without a progress thread move data only inside MPI calls).
  void progress() {
    for (std::size_t s = 0; s < set_count(); ++s) {
      int done = 0;
      if (set[s].pending != 0)
        note(MPI_Testall(set[s].pending, set[s].requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    }
  }

  /// Sums elements [lo, hi) of a bucket into its buffer; with_progress: between pieces, let MPI
  /// move the buckets in flight (only on the calling thread: MPI may be initialised for it alone).
  void fill_range(const bucket_shape& sh, Buf* buffer, std::size_t lo, std::size_t hi, bool with_progress) {
    const std::size_t elements = sh.end - sh.begin;
    Buf* sums = buffer;
    Buf* sq = squares_in_buffer() ? buffer + elements : nullptr;
    Buf* flags = buffer + elements * (squares_in_buffer() ? 2 : 1);
    const bool prefetch = gradavg::detail::prefetch_pays(elements, towers * sizeof(S) + element_bytes());
    std::size_t flag = 0;  // the flag of variable i: its position among the bucket's variables
    for (std::size_t i = sh.first_variable; i < variables && offset_of(i) < hi; ++i) {
      const std::size_t size = size_of(i);
      if (size == 0) continue;
      if (offset_of(i) + size <= lo) {
        ++flag;
        continue;
      }
      const std::size_t begin = std::max(offset_of(i), lo) - offset_of(i);
      const std::size_t end = std::min(offset_of(i) + size, hi) - offset_of(i);
      bool nonfinite = false;
      const void* const* tp = work.towers.data() + i * towers;
      for (std::size_t p = begin; p < end; p += piece_elements) {
        const std::size_t q = std::min(end, p + piece_elements);
        const std::size_t at = offset_of(i) + p - sh.begin;
        const piece_towers from{tp, p};
        const gradavg::detail::tower_reader<S> tower_data{&from, &piece_towers::first_element};
        const auto piece = gradavg::detail::reduce_range<S, Buf, Buf>(
            tower_data, towers, 0, q - p, sums + at, sq ? sq + at : nullptr, false, prefetch, Buf(1),
            fused ? &params : nullptr);
        nonfinite = nonfinite || (fused && piece.nonfinite);
        if (with_progress) progress();
      }
      // A variable split between chunks has its flag set by any of them (never cleared).
      if (detect() && nonfinite) std::atomic_ref<Buf>(flags[flag]).store(Buf(1), std::memory_order_relaxed);
      ++flag;
    }
  }

  /// options.threads / pool: the bucket split into chunks (the sums do not depend on the split).
  void fill(const bucket_shape& sh, Buf* buffer) {
    const std::size_t elements = sh.end - sh.begin;
    std::fill(buffer + elements * (squares_in_buffer() ? 2 : 1), buffer + sh.len, Buf(0));  // the flags
    const std::size_t chunks =
        gradavg::detail::chunk_count(elements, towers * sizeof(S) + element_bytes(), opts);
    if (chunks <= 1) {
      fill_range(sh, buffer, sh.begin, sh.end, true);
      return;
    }
    auto chunk = [&](std::size_t c) {
      fill_range(sh, buffer, sh.begin + elements * c / chunks, sh.begin + elements * (c + 1) / chunks, false);
    };
    gradavg::detail::run_chunks(chunks, chunk, opts);
  }

  /// Waits for the bucket's requests in flight.
  void wait_all(bucket_set& bs) {
    if (bs.pending != 0) note(MPI_Waitall(bs.pending, bs.requests, MPI_STATUSES_IGNORE), "MPI_Waitall");
    bs.pending = 0;
  }

  /// Sends every other rank its slice of the bucket; receives theirs of this rank's slice.
  void start_exchange(const bucket_shape& sh, bucket_set& bs) {
    const std::size_t mine = slice_begin(sh.len, rank + 1) - slice_begin(sh.len, rank);
    bs.pending = 0;
    if (collectives()) {
      // Nothing to or from this rank itself; the others' contributions in rank order in recv.
      int* send_counts = bs.counts;
      int* send_displs = bs.counts + ranks;
      int* recv_counts = bs.counts + 2 * ranks;
      int* recv_displs = bs.counts + 3 * ranks;
      for (int r = 0; r < ranks; ++r) {
        const std::size_t first = slice_begin(sh.len, r);
        send_counts[r] = r == rank ? 0 : bytes_of(slice_begin(sh.len, r + 1) - first);
        send_displs[r] = bytes_of(first);
        recv_counts[r] = r == rank ? 0 : bytes_of(mine);
        recv_displs[r] = r == rank ? 0 : bytes_of(static_cast<std::size_t>(r < rank ? r : r - 1) * mine);
      }
      note(MPI_Ialltoallv(bs.local, send_counts, send_displs, MPI_BYTE, bs.recv, recv_counts, recv_displs,
                          MPI_BYTE, comm, &bs.requests[bs.pending++]),
           "MPI_Ialltoallv");
      return;
    }
    for (int r = 0, slot = 0; r < ranks; ++r) {
      if (r == rank) continue;
      note(MPI_Irecv(bs.recv + static_cast<std::size_t>(slot++) * mine, bytes_of(mine), MPI_BYTE, r, exchange_tag,
                     comm, &bs.requests[bs.pending++]),
           "MPI_Irecv");
    }
    for (int r = 0; r < ranks; ++r) {
      if (r == rank) continue;
      const std::size_t first = slice_begin(sh.len, r);
      note(MPI_Isend(bs.local + first, bytes_of(slice_begin(sh.len, r + 1) - first), MPI_BYTE, r, exchange_tag,
                     comm, &bs.requests[bs.pending++]),
           "MPI_Isend");
    }
  }

  /// Waits for the contributions, sums them in rank order into this rank's slice of the buffer
  /// (its own contribution is there already), and starts sending the sum to every other rank
  /// and receiving theirs.
  void reduce_and_gather(const bucket_shape& sh, bucket_set& bs) {
    wait_all(bs);
    const std::size_t first = slice_begin(sh.len, rank);
    const std::size_t mine = slice_begin(sh.len, rank + 1) - first;
    Buf* out = bs.local + first;
    // The contribution of another rank r, in recv.
    auto from = [&](int r) { return bs.recv + static_cast<std::size_t>(r < rank ? r : r - 1) * mine; };
    constexpr std::size_t block = 512;  // elements summed over every rank at a time (in L1)
    Buf own[block];                      // this rank's contribution, kept aside while out is rewritten
    for (std::size_t j0 = 0; j0 < mine; j0 += block) {
      const std::size_t n = std::min(block, mine - j0);
      Buf* o = out + j0;
      if (rank != 0) {
        std::copy(o, o + n, own);
        const Buf* in = from(0) + j0;
        std::copy(in, in + n, o);
      }
      for (int r = 1; r < ranks; ++r) {
        const Buf* in = r == rank ? own : from(r) + j0;
        for (std::size_t j = 0; j < n; ++j) o[j] += in[j];
      }
    }
    if (collectives()) {
      int* counts = bs.counts;
      int* displs = bs.counts + ranks;
      for (int r = 0; r < ranks; ++r) {
        counts[r] = bytes_of(slice_begin(sh.len, r + 1) - slice_begin(sh.len, r));
        displs[r] = bytes_of(slice_begin(sh.len, r));
      }
      note(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, bs.local, counts, displs, MPI_BYTE, comm,
                           &bs.requests[bs.pending++]),
           "MPI_Iallgatherv");
      return;
    }
    for (int r = 0; r < ranks; ++r) {
      if (r == rank) continue;
      const std::size_t at = slice_begin(sh.len, r);
      note(MPI_Irecv(bs.local + at, bytes_of(slice_begin(sh.len, r + 1) - at), MPI_BYTE, r, gather_tag, comm,
                     &bs.requests[bs.pending++]),
           "MPI_Irecv");
    }
    for (int r = 0; r < ranks; ++r)
      if (r != rank)
        note(MPI_Isend(out, bytes_of(mine), MPI_BYTE, r, gather_tag, comm, &bs.requests[bs.pending++]), "MPI_Isend");
  }

  /// A variable whose last element in the range has been written: zeroed when the policy says,
  /// reported.
  void finish_variable(std::size_t i) {
    double* acc = work.sums.data() + 3 * i;
    const bool nonfinite = acc[2] != 0;
    if (zero_nonfinite() && nonfinite) {
      const std::size_t begin = std::max(offset_of(i), range_begin) - offset_of(i);
      const std::size_t end = std::min(offset_of(i) + size_of(i), range_end) - offset_of(i);
      O* m = static_cast<O*>(work.outputs[2 * i]);
      std::fill(m + begin, m + end, O(0));
      if (O* q = static_cast<O*>(work.outputs[2 * i + 1])) std::fill(q + begin, q + end, O(0));
      acc[0] = acc[1] = 0;
    }
    if (!opts.per_variable.empty()) {
      variable_statistics& out = opts.per_variable[i];
      if (detect()) out.nonfinite = nonfinite;
      if (opts.statistics) {
        out.sum_mean_squared = acc[0];
        out.sum_mean_of_squares = acc[1];
      }
    }
    everything_mean_squared += acc[0];
    everything_mean_of_squares += acc[1];
    nonfinite_variables += nonfinite ? 1 : 0;
  }

  /// Divides a gathered bucket into the outputs, adds its statistics, finishes the variables
  /// whose last element it holds.
  template <class Acc>
  void unpack(const bucket_shape& sh, bucket_set& bs) {
    wait_all(bs);
    const Acc divisor = static_cast<Acc>(weight_sum);
    bool streamed = false;  // non-temporal stores made: fenced before the outputs are read
    const std::size_t elements = sh.end - sh.begin;
    const Buf* sums = bs.local;
    const Buf* sq = bs.local + elements;
    const Buf* flags = bs.local + elements * (squares_in_buffer() ? 2 : 1);
    std::size_t flag = 0;
    for (std::size_t i = sh.first_variable; i < variables && offset_of(i) < sh.end; ++i) {
      const std::size_t size = size_of(i);
      if (size == 0) continue;
      const std::size_t begin = std::max(offset_of(i), sh.begin) - offset_of(i);
      const std::size_t end = std::min(offset_of(i) + size, sh.end) - offset_of(i);
      const std::size_t at = offset_of(i) + begin - sh.begin;
      O* m = static_cast<O*>(work.outputs[2 * i]) + begin;
      O* q = work.outputs[2 * i + 1] ? static_cast<O*>(work.outputs[2 * i + 1]) + begin : nullptr;
      double* acc = work.sums.data() + 3 * i;
      const std::size_t len = end - begin;
      // Branch-free loops the compiler vectorises; a NaN result is the default quiet NaN.
      constexpr Acc nan = std::numeric_limits<Acc>::quiet_NaN();
      auto divide_into = [&](const Buf* from, O* to) {
        if constexpr (std::is_same_v<Buf, Acc> && std::is_same_v<O, Acc>) {
          if (stream_outputs) {
            // The same quotients, stored around the caches.
            gradavg::detail::stream_quotients<Acc>(from, to, len, divisor);
            streamed = true;
            return;
          }
        }
        for (std::size_t j = 0; j < len; ++j) {
          const Acc x = static_cast<Acc>(from[j]) / divisor;
          to[j] = static_cast<O>(x == x ? x : nan);
        }
      };
      divide_into(sums + at, m);
      if (q) divide_into(sq + at, q);
      if (opts.statistics) {
        // From the values in Acc, before any rounding to O; one running sum per variable in
        // element order, carried across buckets: the same bits whatever the bucket size.
        double mean_squared = acc[0], mean_of_squares = acc[1];
        for (std::size_t j = 0; j < len; ++j) {
          const double mean = static_cast<double>(static_cast<Acc>(sums[at + j]) / divisor);
          const double square = static_cast<double>(static_cast<Acc>(sq[at + j]) / divisor);
          mean_squared += mean * mean;
          mean_of_squares += square;
        }
        acc[0] = mean_squared;
        acc[1] = mean_of_squares;
      }
      if (detect() && flags[flag++] != Buf(0)) acc[2] = 1;
      if (offset_of(i) + size <= sh.end || sh.end == range_end) finish_variable(i);
    }
    if (streamed) gradavg::detail::streaming_fence();
    progress();
  }

  /// The data path: every bucket filled, exchanged, gathered and unpacked, three in flight.
  template <class Acc>
  summary run() {
    const std::uint64_t* headers = work.words.data();
    std::size_t total_towers = 0, weighted_towers = 0;
    for (int r = 0; r < ranks; ++r) {
      total_towers += headers[static_cast<std::size_t>(r) * header_words + h_towers];
      weighted_towers += headers[static_cast<std::size_t>(r) * header_words + h_weighted_towers];
    }
    weight_sum = total_weight(headers);
    const std::uint64_t* reduced = work.words.data() + ranks * header_words + variables * variable_words;
    std::size_t averaged = 0;
    for (std::size_t i = 0; i < variables; ++i)
      averaged += reduced[i * variable_words + v_state] == present_everywhere ? 1 : 0;

    summary result;
    result.skipped = variables - averaged;
    result.towers = total_towers;
    result.weighted_towers = weighted_towers;
    result.statistics = opts.statistics;
    result.total_samples = opts.samples_per_tower * static_cast<double>(total_towers);
    const bool whole = range_begin == 0 && range_end == total;
    result.averaged = averaged;
    if (!whole) {
      result.averaged = 0;
      for (std::size_t i = 0; i < variables; ++i)
        result.averaged += size_of(i) != 0 && range_begin < range_end && offset_of(i) < range_end &&
                                   offset_of(i) + size_of(i) > range_begin
                               ? 1
                               : 0;
    }
    if (range_begin >= range_end) {
      if (opts.statistics) result.sum_mean_squared = result.sum_mean_of_squares = 0;
      return result;
    }
    const double* weights = opts.weights.empty() ? nullptr : opts.weights.data();
    fused = weights != nullptr || opts.scale != 1.0 || detect();
    params = {weights, opts.scale, static_cast<Buf>(opts.scale), detect(), false};
    walk_variable = 0;
    everything_mean_squared = everything_mean_of_squares = 0;
    nonfinite_variables = 0;
    // The pipeline: bucket b filled while b-1 is exchanged and b-2 gathered. After an exception
    // in this rank's kernel its contributions are zeros: the messages every rank waits for flow.
    std::exception_ptr failure;
    bucket_shape shapes[3];
    for (std::size_t b = 0; b < buckets + 2; ++b) {
      if (b < buckets) {
        bucket_set& bs = set[b % 3];
        shapes[b % 3] = shape_of_bucket(b);
        if (!failure) {
          try {
            fill(shapes[b % 3], bs.local);
          } catch (...) {
            failure = std::current_exception();
          }
        }
        if (failure) std::fill(bs.local, bs.local + shapes[b % 3].len, Buf(0));
        start_exchange(shapes[b % 3], bs);
      }
      if (b >= 1 && b - 1 < buckets) {
        bucket_set& bs = set[(b - 1) % 3];
        reduce_and_gather(shapes[(b - 1) % 3], bs);
      }
      if (b >= 2) unpack<Acc>(shapes[(b - 2) % 3], set[(b - 2) % 3]);
    }
    // The last collective: the lowest rank whose kernel failed, if any.
    int failed_rank = failure ? rank : ranks;
    check(MPI_Allreduce(MPI_IN_PLACE, &failed_rank, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
    if (failed_mpi_call != nullptr) check(failed_mpi_code, failed_mpi_call);
    if (failure) std::rethrow_exception(failure);
    if (failed_rank < ranks)
      throw remote_error("gradavg::mpi: rank " + std::to_string(failed_rank) +
                         " failed while averaging (an exception from user code there, after validation: see the "
                         "error thrown there); the outputs of this call are partly written on every rank");
    result.nonfinite_variables = nonfinite_variables;
    if (opts.statistics) {
      result.sum_mean_squared = everything_mean_squared;
      result.sum_mean_of_squares = everything_mean_of_squares;
    }
    return result;
  }

  /// The call, in phases: local (validation, tables, buffers: everything that can throw before
  /// the data moves), then four collectives every rank enters whatever happened before each:
  ///   1. two words, MPI_MIN: the lowest rank whose local phase failed (and its variable), and
  ///      whether every rank's plan holds; on the stack, so that a failed allocation cannot keep a
  ///      rank out of it;
  ///   2. the headers (MPI_Allgather): options, counts and element types agree;
  ///   3. the per-variable words (MPI_Allreduce, MPI_MAX): presence, shapes, identities agree;
  ///   4. after the data path, one word: the lowest rank whose kernel (executor) threw.
  /// When every rank's plan holds, 3 is what they agreed when the plans were proved, and so is 2
  /// unless a rank passes weights (their sums change from step to step) or changed a step value
  /// (step_value). Between 1 and 4 nothing allocates or calls tensor_traits unless every rank
  /// throws after the same collective.
  summary operator()(std::exception_ptr prior) {
    rank = comm_rank(comm);
    ranks = comm_size(comm);
    std::uint64_t header[header_words];
    std::size_t failed_variable = error::npos;
    const std::exception_ptr own = local_checks(prior, header, &failed_variable);
    // Collective 1: (rank << 32 | variable) of the lowest rank that failed, else all ones; and the
    // lowest plan_state.
    constexpr std::uint64_t none = ~std::uint64_t{0};
    std::uint64_t first[2] = {
        own ? (static_cast<std::uint64_t>(rank) << 32 | std::min<std::uint64_t>(failed_variable, 0xffffffffu)) : none,
        own ? 0u : plan_state};
    check(MPI_Allreduce(MPI_IN_PLACE, first, 2, MPI_UINT64_T, MPI_MIN, comm), "MPI_Allreduce");
    const std::uint64_t first_failure = first[0];
    if (own) std::rethrow_exception(own);
    if (first_failure != none) {
      const std::uint64_t var = first_failure & 0xffffffffu;
      const std::size_t variable = var == 0xffffffffu ? error::npos : static_cast<std::size_t>(var);
      throw remote_error("gradavg::mpi: rank " + std::to_string(first_failure >> 32) +
                             " failed its own checks before any data moved (" +
                             (variable == error::npos ? std::string("see the error thrown there")
                                                      : "about variable #" + std::to_string(variable) +
                                                            "; see the error thrown there") +
                             "); nothing was averaged or written on any rank",
                         variable);
    }
    if (first[1] != 0) {
      // Every rank's plan holds: the agreement on the variables stands; the headers are gathered
      // again on every rank when one rank needs it.
      restore_agreement();
      if (first[1] == 1) {
        check(MPI_Allgather(header, header_words, MPI_UINT64_T, work.words.data(), header_words, MPI_UINT64_T, comm),
              "MPI_Allgather");
        agree_on_headers(work.words.data());
        keep_agreement(header);
      }
      return gradavg::detail::with_accumulator<S>(opts, [&]<class Acc>() { return run<Acc>(); });
    }
    // Collective 2: every rank's header. After it, every rank holds the same variable count
    // (or throws).
    const std::size_t header_bytes = static_cast<std::size_t>(ranks) * header_words;
    check(MPI_Allgather(header, header_words, MPI_UINT64_T, work.words.data(), header_words, MPI_UINT64_T, comm),
          "MPI_Allgather");
    agree_on_headers(work.words.data());
    // Collective 3: per-variable presence and fingerprints, maximum and minimum over ranks.
    const std::size_t vw = variables * variable_words;
    std::uint64_t* local = work.words.data() + header_bytes;
    if (vw != 0)
      check(MPI_Allreduce(local, local + vw, static_cast<int>(vw), MPI_UINT64_T, MPI_MAX, comm), "MPI_Allreduce");
    if (const auto [i, how] = first_disagreement(local + vw, variables); how != 0) throw_variable_error(i, how);
    if (planned != nullptr && gradavg::detail::plan_access::ready(*planned)) keep_agreement(header);
    return gradavg::detail::with_accumulator<S>(opts, [&]<class Acc>() { return run<Acc>(); });
  }
};

template <class S, class O, class TG, class Means, class Squares>
summary average_into_typed(MPI_Comm comm, const TG& tg, Means& means, Squares* squares, const mpi::options& opts,
                           std::exception_ptr prior, plan* planned) {
  workspace own;
  workspace_detail::buffers& work = workspace_detail::access::of(opts.work ? *opts.work : own);
  return call<TG, Means, Squares, S, O>{comm, tg, means, squares, opts, work, planned}(prior);
}

template <class TG, class Means, class Squares>
summary average_into(MPI_Comm comm, const TG& tg, Means& means, Squares* squares, const mpi::options& opts,
                     std::exception_ptr prior = nullptr, plan* planned = nullptr) {
  using G = gradavg::detail::gradient_tensor_t<TG>;
  using OT = gradavg::detail::output_tensor_t<Means&>;
  check_communicator(comm);
  static_assert(gradavg::detail::gradients_outlive_reads<TG>, GRADAVG_LIFETIME_MESSAGE_);
  static_assert(dynamic_tensor<G> || gradavg::detail::supported_scalar<tensor_value_t<G>>,
                "gradavg: gradient elements must be float, double, Eigen::half or Eigen::bfloat16");
  static_assert(dynamic_tensor<OT> || gradavg::detail::supported_scalar<tensor_value_t<OT>>,
                "gradavg: output elements must be float, double, Eigen::half or Eigen::bfloat16");
  if constexpr (static_tensor<G> && static_tensor<OT>) {
    using S = tensor_value_t<G>;
    using O = tensor_value_t<OT>;
    static_assert(gradavg::detail::supported_output<S, O>,
                  "gradavg: the means outputs must hold the gradients' element type (or float for 16-bit gradients)");
    return average_into_typed<S, O>(comm, tg, means, squares, opts, prior, planned);
  } else {
    // Run-time element types: this rank's are found first (a failure still takes part in the
    // agreement, as prior), then every rank runs the kernel of its types; the first collective
    // compares them.
    gradavg::detail::call_elements e;
    if (!prior) {
      try {
        const std::size_t variable_count = gradavg::detail::validate_tower_counts(tg);
        e = gradavg::detail::validate_elements(tg, variable_count, &means, squares);
      } catch (...) {
        prior = std::current_exception();
      }
    }
    return gradavg::detail::with_kernel_types<G, OT, true>(e, !prior, [&]<class S, class O>() {
      return average_into_typed<S, O>(comm, tg, means, squares, opts, prior, planned);
    });
  }
}

}  // namespace mpi_detail

GRADAVG_END_ISA_NAMESPACE
}  // namespace mpi
}  // namespace gradavg
