// gradavg internals: one call across processes, over any transport (exchange.hpp) — the local
// checks and the agreement collectives, then the data path (data_path.hpp); the file comment of
// <gradavg/mpi.hpp> describes them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "agreement.hpp"
#include "data_path.hpp"
#include "exchange.hpp"
#include "../into.hpp"
#include "../isa.hpp"
#include "../../errors.hpp"
#include "../../plan.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// One call: this rank's checks and the agreement with every other rank, then the data path it
/// derives from (the same template parameters).
template <transport Transport, class TG, class Means, class Squares, class S, class O>
struct call : data_path<Transport, TG, Means, Squares, S, O> {
  using base = data_path<Transport, TG, Means, Squares, S, O>;
  using typename base::Buf;
  using base::with_squares;
  using base::wire;
  using base::tg;
  using base::means;
  using base::squares;
  using base::opts;
  using base::local;
  using base::work;
  using base::rank;
  using base::ranks;
  using base::towers;
  using base::variables;
  using base::prepare;
  using base::total_weight;
  using base::words;
  using base::trace;

  plan* planned = nullptr;  // the caller's plan, or null

  /// Whether a rank's plan holds, in increasing order: collective 1 takes the minimum over the
  /// ranks, the state of them all.
  enum class plan_state : std::uint64_t {
    /// It does not hold (or there is none): every collective runs.
    lapsed,
    /// It holds, but the headers are gathered again: weights are passed, or a value that may
    /// change from step to step (step_value) differs from the agreed one.
    headers_again,
    /// It holds: no agreement collective.
    holds,
  };
  plan_state plan_here = plan_state::lapsed;  // this rank's (local_checks)

  // ---- Agreement. ----

  /// A plan's agreed words, in order: [communicator, ranks, rank, variables], this rank's header
  /// as sent, every rank's header, the reduced per-variable words, this rank's own per-variable
  /// words; the *_at functions say where each part begins (work.words' own: word_layout).
  static constexpr std::size_t agreed_prefix = 4;
  std::size_t variable_word_count() const noexcept { return variables * variable_words; }
  std::size_t agreed_headers_at() const noexcept { return agreed_prefix + header_words; }
  std::size_t agreed_reduced_at() const noexcept {
    return agreed_headers_at() + static_cast<std::size_t>(ranks) * header_words;
  }
  std::size_t agreed_own_at() const noexcept { return agreed_reduced_at() + variable_word_count(); }
  std::size_t agreed_words() const noexcept { return agreed_own_at() + variable_word_count(); }

  /// Header fields that may change from step to step without a new agreement on the variables:
  /// gathered again (collective 2) when they differ from the agreed ones.
  static constexpr bool step_value(std::size_t f) noexcept {
    return f == h_weight_sum || f == h_weighted_towers || f == h_scale || f == h_range_begin ||
           f == h_range_end;
  }

  /// This rank's plan_state: lapsed unless its buffers are the ones it proved (matches_plan) and
  /// its header, but for the step values, the one it sent when every rank agreed on this
  /// communicator; then headers_again where weights are passed or a step value differs, else holds.
  plan_state plan_state_here(std::uint64_t* header) {
    using gradavg::detail::plan_access;
    if (planned == nullptr ||
        !gradavg::detail::matches_plan<S, O>(*planned, &gradavg::shared_detail::signature_of<TG, Means, Squares>, tg, means,
                                             squares, local))
      return plan_state::lapsed;
    if (plan_access::averaged(*planned) == 0) header[h_types] = 0;  // reads no gradient (local_checks)
    const std::vector<std::uint64_t>& agreed = plan_access::agreed(*planned);
    if (agreed.size() != agreed_words() || agreed[0] != wire.identity() ||
        agreed[1] != static_cast<std::uint64_t>(ranks) || agreed[2] != static_cast<std::uint64_t>(rank) ||
        agreed[3] != variables)
      return plan_state::lapsed;
    bool step_values_differ = false;
    for (std::size_t f = 0; f < header_words; ++f)
      if (header[f] != agreed[agreed_prefix + f]) {
        if (!step_value(f)) return plan_state::lapsed;
        step_values_differ = true;
      }
    return step_values_differ || !opts.compute.weights.empty() ? plan_state::headers_again : plan_state::holds;
  }

  /// After every rank agreed: the plan keeps it (its room was reserved by local_checks).
  void keep_agreement(const std::uint64_t* header) noexcept {
    std::vector<std::uint64_t>& agreed = gradavg::detail::plan_access::agreed(*planned);
    agreed.resize(agreed_words());
    agreed[0] = wire.identity();
    agreed[1] = static_cast<std::uint64_t>(ranks);
    agreed[2] = static_cast<std::uint64_t>(rank);
    agreed[3] = variables;
    const word_layout w = words();
    const std::size_t vw = variable_word_count();
    std::copy(header, header + header_words, agreed.data() + agreed_prefix);
    std::copy(w.headers(), w.own_variables(), agreed.data() + agreed_headers_at());
    std::copy(w.reduced(), w.reduced() + vw, agreed.data() + agreed_reduced_at());
    std::copy(w.own_variables(), w.own_variables() + vw, agreed.data() + agreed_own_at());
  }

  /// Where the agreed words of a plan that holds go back in work.words: this rank's own
  /// per-variable words before collective 1 (collective 3 needs them if another rank's plan does
  /// not hold), and after it, when every rank's holds, the headers and the reduced words the data
  /// path reads.
  void restore_own_words() noexcept {
    const std::uint64_t* agreed = gradavg::detail::plan_access::agreed(*planned).data();
    std::copy(agreed + agreed_own_at(), agreed + agreed_words(), words().own_variables());
  }
  void restore_agreement() noexcept {
    const std::uint64_t* agreed = gradavg::detail::plan_access::agreed(*planned).data();
    std::copy(agreed + agreed_headers_at(), agreed + agreed_reduced_at(), words().headers());
    std::copy(agreed + agreed_reduced_at(), agreed + agreed_own_at(), words().reduced());
  }

  /// This rank's header words (what every rank must pass alike), before any check: a rank whose
  /// checks fail still takes part in the agreement with them. h_variables: 0 until counted.
  void fill_header(std::uint64_t* header) const {
    header[h_towers] = std::ranges::size(tg);
    header[h_variables] = 0;
    header[h_squares] = with_squares;
    header[h_policy] = static_cast<std::uint64_t>(opts.compute.on_nonfinite) | (opts.compute.statistics ? 16u : 0u) |
                       (static_cast<std::uint64_t>(opts.compute.accumulate) << 8);
    header[h_range_begin] = opts.compute.range.begin;
    header[h_range_end] = opts.compute.range.end;
    header[h_fusion_bytes] = opts.exchange.fusion_bytes;
    header[h_types] = type_code<S>() | type_code<O>() << 8;
    header[h_scale] = double_to_bits(opts.compute.scale);
    header[h_per_variable] = opts.compute.per_variable.empty() ? 0 : 1;
    header[h_exchange] = wire.method_code();
    header[h_compression] = static_cast<std::uint64_t>(opts.exchange.compression);
    header[h_output] = static_cast<std::uint64_t>(opts.exchange.output);
    header[h_weight_sum] = double_to_bits(gradavg::detail::weight_sum(opts.compute.weights, std::ranges::size(tg)));
    header[h_weighted_towers] =
        opts.compute.weights.empty() ? std::ranges::size(tg) : gradavg::detail::positive_weights(opts.compute.weights);
  }

  /// Variable i's words (word_layout::own_variable): its presence state over this rank's
  /// towers, fingerprints of its identity (tower 0's variable) and of its shape (dims: of its
  /// present gradients; null when none), each with its complement for the minimum.
  template <class V>
  void put_variable_words(std::size_t i, std::uint64_t state, const V& variable, const shape* dims) noexcept {
    std::uint64_t* w = words().own_variable(i);
    const std::uint64_t id = identity_fingerprint(variable);
    const std::uint64_t sh = dims != nullptr ? shape_fingerprint(*dims) : 0;
    w[v_state] = state;
    w[v_state_min] = ~state;
    w[v_identity] = id;
    w[v_identity_min] = id == 0 ? 0 : ~id;
    w[v_shape] = sh;
    w[v_shape_min] = sh == 0 ? 0 : ~sh;
  }

  /// Every variable's words read from the towers, for a call whose checks stopped at a gradient
  /// missing on some towers (validate_into fills them otherwise). Returns whether any gradient is
  /// present.
  bool fill_variable_words() {
    bool any_present = false;
    for (std::size_t i = 0; i < variables; ++i) {
      std::size_t present = 0;
      shape s{};
      for (std::size_t k = 0; k < towers; ++k) {
        const auto g = gradavg::detail::read_gradient(tg, k, i);
        if (g.present && present++ == 0) s = g.dims;
      }
      any_present = any_present || present != 0;
      const std::uint64_t state = present == 0 ? absent_everywhere : present == towers ? present_everywhere : partial;
      gradavg::detail::with_entry(tg, 0, i, [&](const auto& e) {
        put_variable_words(i, state, gradavg::entry_traits<std::remove_cvref_t<decltype(e)>>::variable(e),
                           present != 0 ? &s : nullptr);
      });
    }
    return any_present;
  }

  /// The checks of a call whose plan does not hold: every check of the one-process call
  /// (validate_into, its options' and the weights'), the per-variable words, this rank's tables
  /// and buffers (prepare()), and the proof kept in the plan where there is one. A gradient
  /// missing on some towers is decided with every rank's presence (the same error on every rank).
  void check_unplanned(std::uint64_t* header) {
    gradavg::detail::layout_proof* const proof = planned != nullptr ? gradavg::detail::proving_into(*planned) : nullptr;
    bool proved = true;
    gradavg::detail::validated v;
    gradavg::detail::check_scratch scratch;  // holds the layout until prepare() has read it
    bool any_present = false;
    auto seen = [&](std::size_t i, const auto& variable, const shape* dims) {
      put_variable_words(i, dims != nullptr ? present_everywhere : absent_everywhere, variable, dims);
      any_present = any_present || dims != nullptr;
    };
    try {
      v = gradavg::detail::validate_into<TG, Means, Squares, S, O>(tg, means, squares, local, scratch, proof, seen);
    } catch (const missing_gradient_error&) {
      proved = false;
    }
    gradavg::detail::validate_options(local, towers, variables, gradavg::detail::accumulator_max<S>(local), true);
    if (proved) gradavg::detail::check_weights_apart(tg, v.layout, variables, towers, sizeof(O), local);
    if (planned != nullptr && proved) {
      gradavg::detail::keep_proof<S, O>(*planned, &gradavg::shared_detail::signature_of<TG, Means, Squares>, tg, v,
                                        opts.check.aliasing);
      gradavg::detail::plan_access::agreed(*planned).reserve(agreed_words());  // keep_agreement's room
    }
    if (!proved) any_present = fill_variable_words();
    // A rank that reads no gradient moves no data: its element types (run-time ones are only
    // known from a gradient) are not compared; the presence check decides.
    if (!any_present) header[h_types] = 0;
    prepare(proved ? &v.layout : nullptr);
  }

  /// This rank's header, per-variable words (presence, fingerprints) and, when they pass, its
  /// tables and buffers (prepare()). work.words (word_layout) is sized here, so that no
  /// collective of the call needs an allocation. The failure, if any: this rank's own error, with
  /// the variable it names in *failed_variable (error::npos when none).
  std::exception_ptr local_checks(std::exception_ptr prior, std::uint64_t* header, std::size_t* failed_variable) {
    *failed_variable = error::npos;
    fill_header(header);
    if (prior) return prior;
    try {
      towers = std::ranges::size(tg);
      variables = towers == 0 ? 0 : std::ranges::size(gradavg::detail::at(tg, 0));
      header[h_variables] = variables;
      work.words.resize(word_layout::size(static_cast<std::size_t>(ranks), variables));
      check_fusion_bytes(Transport::caller, "", opts.exchange.fusion_bytes, sizeof(Buf));
      gradavg::shared_detail::require_named(opts.exchange.compression, compression::int8,
                                            "options.exchange.compression");
      gradavg::shared_detail::require_named(opts.exchange.output, output_mode::sharded, "options.exchange.output");
      if (opts.exchange.output == output_mode::sharded && opts.compute.statistics)
        throw option_error(std::string(Transport::caller) +
                           ": options.compute.statistics needs every mean, and options.exchange.output is sharded "
                           "(each rank receives its shard's only); compute the statistics over the shards, or "
                           "replicate the output");
      wire.check_options();
      plan_here = plan_state_here(header);
      if (plan_here == plan_state::lapsed) {
        check_unplanned(header);
        return nullptr;
      }
      gradavg::detail::validate_options(local, towers, variables, gradavg::detail::accumulator_max<S>(local), true);
      restore_own_words();
      const auto proved_table = gradavg::detail::plan_access::proof(*planned).table();
      gradavg::detail::check_weights_apart(tg, proved_table, variables, towers, sizeof(O), local);
      prepare(&proved_table);
      return nullptr;
    } catch (const error& e) {
      *failed_variable = e.variable_index();
      return std::current_exception();
    } catch (...) {
      return std::current_exception();
    }
  }

  /// Throws the error every rank agrees on from the gathered headers, if any (agreement.hpp).
  void agree_on_headers(const std::uint64_t* all) const {
    processes::agree_on_headers(Transport::caller, all, ranks, total_weight(all),
                                gradavg::detail::accumulator_max<S>(local));
  }

  /// Gathers every rank's record of variable i and throws the error of kind `how`.
  [[noreturn]] void throw_variable_error(std::size_t i, disagreement how) {
    // This rank's record, then every rank's, in the space local_checks reserved: the gather
    // allocates nothing, and an exception from tensor_traits here is rethrown only after it.
    std::uint64_t* const mine = words().own_record();
    std::uint64_t* const all = words().records();
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
    const std::uint64_t* own = words().own_variable(i);
    mine[r_state] = own[v_state];
    mine[r_present] = present;
    mine[r_towers] = towers;
    mine[r_identity] = own[v_identity];
    mine[r_shape] = own[v_shape];
    mine[r_rank_dims] = s.rank;
    for (std::size_t d = 0; d < s.rank; ++d) mine[r_rank_dims + 1 + d] = static_cast<std::uint64_t>(s.dims[d]);
    mine[r_rank_dims + 1 + shape::max_rank] = static_cast<std::uint64_t>(s.order);
    wire.gather_words(mine, all, record_words);
    if (reading) std::rethrow_exception(reading);
    throw_variable_disagreement(describe_variable_at(tg, i), i, how, all, ranks);
  }

  /// The call, in phases: local (validation, tables, buffers: everything that can throw before
  /// the data moves), then four collectives every rank enters whatever happened before each:
  ///   1. two words, minimum: the lowest rank whose local phase failed (and its variable), and
  ///      whether every rank's plan holds; on the stack, so that a failed allocation cannot keep a
  ///      rank out of it;
  ///   2. the headers (gathered): options, counts and element types agree;
  ///   3. the per-variable words (maximum): presence, shapes, identities agree;
  ///   4. after the data path, one word: the lowest rank whose kernel (executor) threw.
  /// When every rank's plan holds, 3 is what they agreed when the plans were proved, and so is 2
  /// unless a rank passes weights (their sums change from step to step) or changed a step value
  /// (step_value). Between 1 and 4 nothing allocates or calls tensor_traits unless every rank
  /// throws after the same collective.
  summary operator()(std::exception_ptr prior) {
    std::uint64_t header[header_words];
    std::size_t failed_variable = error::npos;
    trace.begin_call(opts.run.timeline, rank);
    const std::uint64_t checks_began = trace.start();
    const std::exception_ptr own = local_checks(prior, header, &failed_variable);
    trace.phase("checks", checks_began);
    const std::uint64_t agreement_began = trace.start();
    // Collective 1: (rank << 32 | variable) of the lowest rank that failed, else all ones; and the
    // lowest plan_state.
    constexpr std::uint64_t none = ~std::uint64_t{0};
    std::uint64_t first[2] = {
        own ? (static_cast<std::uint64_t>(rank) << 32 | std::min<std::uint64_t>(failed_variable, 0xffffffffu)) : none,
        static_cast<std::uint64_t>(own ? plan_state::lapsed : plan_here)};
    wire.min_words(first, 2);
    const std::uint64_t first_failure = first[0];
    if (own) std::rethrow_exception(own);
    if (first_failure != none) {
      const std::uint64_t var = first_failure & 0xffffffffu;
      const std::size_t variable = var == 0xffffffffu ? error::npos : static_cast<std::size_t>(var);
      throw remote_error(std::string(Transport::caller) + ": rank " + std::to_string(first_failure >> 32) +
                             " failed its own checks before any data moved (" +
                             (variable == error::npos ? std::string("see the error thrown there")
                                                      : "about variable #" + std::to_string(variable) +
                                                            "; see the error thrown there") +
                             "); nothing was averaged or written on any rank",
                         variable);
    }
    const auto plans = static_cast<plan_state>(first[1]);
    if (plans != plan_state::lapsed) {
      // Every rank's plan holds: the agreement on the variables stands; the headers are gathered
      // again on every rank when one rank needs it.
      restore_agreement();
      if (plans == plan_state::headers_again) {
        wire.gather_words(header, words().headers(), header_words);
        agree_on_headers(words().headers());
        keep_agreement(header);
      }
      trace.phase("agreement", agreement_began);
      this->log_what = "call (plan holds)";
      return gradavg::detail::with_accumulator<S>(local, [&]<class Acc>() { return this->template run<Acc>(); });
    }
    // Collective 2: every rank's header. After it, every rank holds the same variable count
    // (or throws).
    wire.gather_words(header, words().headers(), header_words);
    agree_on_headers(words().headers());
    // Collective 3: per-variable presence and fingerprints, maximum and minimum over ranks.
    const std::size_t vw = variables * variable_words;
    if (vw != 0) wire.max_words(words().own_variables(), words().reduced(), vw);
    if (const auto [i, how] = first_disagreement(words().reduced(), variables); how != disagreement::none)
      throw_variable_error(i, how);
    if (planned != nullptr && gradavg::detail::plan_access::ready(*planned)) {
      keep_agreement(header);
      this->log_at = log_level::info;
      this->log_what = "plan proved";
    }
    trace.phase("agreement", agreement_began);
    return gradavg::detail::with_accumulator<S>(local, [&]<class Acc>() { return this->template run<Acc>(); });
  }
};

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
