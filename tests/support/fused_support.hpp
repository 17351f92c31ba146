// Test helpers for the fused training step (test_fused.cpp, test_half.cpp): a call of
// average_gradients_into with every report requested, and the checks of its outputs, statistics
// and non-finite handling against fused_reference.hpp.
#pragma once

#include <gradavg/gradavg.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "fused_reference.hpp"

namespace gradavg_test {

constexpr double nan_value = std::numeric_limits<double>::quiet_NaN();
constexpr double inf_value = std::numeric_limits<double>::infinity();

/// What per_variable entries hold before a call: a variable the call must not write keeps it.
inline const gradavg::variable_statistics untouched_entry{true, -7.0, -9.0};

inline bool same_double_bits(double a, double b) {
  return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b);
}

inline bool is_untouched(const gradavg::variable_statistics& v) {
  return v.nonfinite == untouched_entry.nonfinite &&
         same_double_bits(v.sum_mean_squared, untouched_entry.sum_mean_squared) &&
         same_double_bits(v.sum_mean_of_squares, untouched_entry.sum_mean_of_squares);
}

/// The outputs and reports of one average_gradients_into call.
template <class O>
struct fused_run {
  std::vector<std::vector<O>> means, squares;
  std::vector<gradavg::variable_statistics> per_variable;
  gradavg::summary summary;
};

template <class O>
inline const O sentinel_value = O(-1234.5f);

/// Runs average_gradients_into on w with opts (per_variable pointed at the run's own entries,
/// filled with untouched_entry; outputs filled with the sentinel). squares: pass squares outputs.
template <class O = void, class S>
auto run_into(const fused_towers<S>& w, gradavg::options opts, bool squares = true) {
  using Out = std::conditional_t<std::is_void_v<O>, S, O>;
  fused_run<Out> r;
  r.means = w.template outputs<Out>(sentinel_value<Out>);
  r.squares = w.template outputs<Out>(sentinel_value<Out>);
  r.per_variable.assign(w.variables(), untouched_entry);
  opts.compute.per_variable = r.per_variable;
  if (squares)
    r.summary = gradavg::average_gradients_into(w.tg, r.means, r.squares, opts);
  else
    r.summary = gradavg::average_gradients_into(w.tg, r.means, opts);
  return r;
}

/// Requires two runs to agree bit for bit: outputs, per-variable results and the summary.
template <class O>
void require_same_bits(const fused_run<O>& a, const fused_run<O>& b) {
  CHECK(same_bits_all(a.means, b.means));
  CHECK(same_bits_all(a.squares, b.squares));
  REQUIRE(a.per_variable.size() == b.per_variable.size());
  for (std::size_t i = 0; i < a.per_variable.size(); ++i) {
    INFO("per_variable[" << i << "]");
    CHECK(a.per_variable[i].nonfinite == b.per_variable[i].nonfinite);
    CHECK(same_double_bits(a.per_variable[i].sum_mean_squared, b.per_variable[i].sum_mean_squared));
    CHECK(same_double_bits(a.per_variable[i].sum_mean_of_squares, b.per_variable[i].sum_mean_of_squares));
  }
  CHECK(a.summary.averaged == b.summary.averaged);
  CHECK(a.summary.skipped == b.summary.skipped);
  CHECK(a.summary.nonfinite_variables == b.summary.nonfinite_variables);
  CHECK(same_double_bits(a.summary.sum_mean_squared, b.summary.sum_mean_squared));
  CHECK(same_double_bits(a.summary.sum_mean_of_squares, b.summary.sum_mean_of_squares));
  CHECK(a.summary.towers == b.summary.towers);
}

/// Requires the outputs of every variable with elements in its expectation's range to match it
/// within tol; elements outside it hold the sentinel. Skipped variables' outputs stay empty.
template <class O>
void require_outputs_match(const std::vector<std::vector<O>>& got, const std::vector<fused_expectation>& want,
                           bool squares, double tol) {
  for (std::size_t i = 0; i < want.size(); ++i) {
    const auto& g = got[i];
    const auto& e = want[i];
    const std::size_t bad = gradavg_test::first_fused_mismatch(g.data(), e, squares, tol);
    INFO("variable " << i << (squares ? " squares" : " means") << ": first mismatch at element " << bad << " of ["
                     << e.begin << ", " << e.end << ")"
                     << (bad < e.end ? ": got " + gradavg_test::show(g[bad]) + ", want " +
                                           std::to_string(squares ? e.square[bad - e.begin] : e.mean[bad - e.begin])
                                     : std::string()));
    CHECK(bad == e.end);
    std::size_t outside = 0;
    const O sentinel = sentinel_value<O>;
    for (std::size_t j = 0; j < g.size(); ++j)
      if ((j < e.begin || j >= e.end) && std::memcmp(&g[j], &sentinel, sizeof(O)) != 0) ++outside;
    CHECK(outside == 0);
  }
}

/// Requires a statistic to be within bound of its reference.
inline void require_within(double got, double want, double bound, const char* what) {
  INFO(what << ": got " << got << ", want " << want << " within " << bound);
  CHECK(std::abs(got - want) <= bound);
}

/// Requires r's per-variable statistics and summary sums (options.compute.statistics) to match the
/// reference of every variable with elements in range; skipped and out-of-range variables keep
/// untouched entries. Variables listed in zeroed count as all-zero (policy zero).
template <class O>
void require_statistics_match(const fused_run<O>& r, const std::vector<fused_expectation>& want, double tol,
                              const std::vector<bool>& absent, const std::vector<std::size_t>& zeroed = {}) {
  double m2 = 0, msq = 0, m2_bound = 0, msq_bound = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("per_variable[" << i << "]");
    const bool in_range = !absent[i] && want[i].end > want[i].begin;
    if (!in_range) {
      CHECK(is_untouched(r.per_variable[i]));
      continue;
    }
    if (std::find(zeroed.begin(), zeroed.end(), i) != zeroed.end()) {
      CHECK(same_double_bits(r.per_variable[i].sum_mean_squared, 0.0));
      CHECK(same_double_bits(r.per_variable[i].sum_mean_of_squares, 0.0));
      continue;
    }
    const auto b = gradavg_test::statistics_error(want[i], tol);
    require_within(r.per_variable[i].sum_mean_squared, want[i].sum_mean_squared, b.mean_squared, "sum_mean_squared");
    require_within(r.per_variable[i].sum_mean_of_squares, want[i].sum_mean_of_squares, b.mean_of_squares,
                   "sum_mean_of_squares");
    m2 += want[i].sum_mean_squared;
    msq += want[i].sum_mean_of_squares;
    m2_bound += b.mean_squared;
    msq_bound += b.mean_of_squares;
  }
  const double u = std::numeric_limits<double>::epsilon();
  const double variables = static_cast<double>(want.size());
  require_within(r.summary.sum_mean_squared, m2, m2_bound + variables * u * m2, "summary.sum_mean_squared");
  require_within(r.summary.sum_mean_of_squares, msq, msq_bound + variables * u * msq, "summary.sum_mean_of_squares");
}

/// Weights of uneven batches: tower k holds 32, 32, ..., with a short last batch, and a tower
/// with no samples at all where there are enough towers.
inline std::vector<double> uneven_weights(std::size_t towers) {
  std::vector<double> w(towers, 32.0);
  if (towers >= 2) w.back() = 7.0;
  if (towers >= 3) w[1] = 0.0;
  if (towers >= 4) w[2] = 0.25;
  return w;
}


/// One non-finite input: value at element `element` of variable `variable` on tower `tower`.
struct poison {
  std::size_t tower, variable, element;
  double value;
};

/// Requires the run with p applied to report exactly p's variable and to hold what policy gives:
/// report: the poisoned element's mean and square are what IEEE arithmetic gives (a NaN as the
/// default quiet NaN of O), every other element is bitwise clean's; zero: every output element of
/// that variable is +0.
template <class O>
void require_poison_handled(const fused_run<O>& clean, const fused_run<O>& got, const poison& p,
                            gradavg::nonfinite_policy policy, const std::vector<bool>& absent, bool weight_zero = false) {
  INFO("tower " << p.tower << ", variable " << p.variable << ", element " << p.element << ", value " << p.value
                << (policy == gradavg::nonfinite_policy::zero ? ", policy zero" : ", policy report"));
  CHECK(got.summary.nonfinite_variables == 1);
  CHECK(got.summary.nonfinite());
  for (std::size_t i = 0; i < absent.size(); ++i) {
    INFO("variable " << i);
    if (absent[i]) {
      CHECK(is_untouched(got.per_variable[i]));
      continue;
    }
    CHECK(got.per_variable[i].nonfinite == (i == p.variable));
    if (i != p.variable) {
      CHECK(same_bits_all(got.means[i], clean.means[i]));
      CHECK(same_bits_all(got.squares[i], clean.squares[i]));
      CHECK(same_double_bits(got.per_variable[i].sum_mean_squared, clean.per_variable[i].sum_mean_squared));
      continue;
    }
    std::size_t wrong = 0;
    const O quiet_nan = std::numeric_limits<O>::quiet_NaN();
    for (std::size_t j = 0; j < got.means[i].size(); ++j) {
      const double m = gradavg_test::as_double(got.means[i][j]), q = gradavg_test::as_double(got.squares[i][j]);
      bool ok;
      if (policy == gradavg::nonfinite_policy::zero)
        ok = same_double_bits(m, 0.0) && same_double_bits(q, 0.0);
      else if (j != p.element)
        ok = got.means[i][j] == clean.means[i][j] && got.squares[i][j] == clean.squares[i][j];
      else if (std::isnan(p.value) || weight_zero)  // 0 * Inf is NaN: the default quiet NaN of O
        ok = std::memcmp(&got.means[i][j], &quiet_nan, sizeof(O)) == 0 &&
             std::memcmp(&got.squares[i][j], &quiet_nan, sizeof(O)) == 0;
      else
        ok = m == p.value && q == inf_value;
      if (!ok && wrong++ == 0) UNSCOPED_INFO("first wrong element " << j << ": mean " << m << ", square " << q);
    }
    CHECK(wrong == 0);
    if (policy == gradavg::nonfinite_policy::zero) {
      CHECK(same_double_bits(got.per_variable[i].sum_mean_squared, 0.0));
      CHECK(same_double_bits(got.per_variable[i].sum_mean_of_squares, 0.0));
    } else {
      CHECK_FALSE(std::isfinite(got.per_variable[i].sum_mean_of_squares));
      CHECK_FALSE(std::isfinite(got.summary.sum_mean_of_squares));
    }
  }
  if (policy == gradavg::nonfinite_policy::zero) {
    // The summary holds the clean variables' sums and the zeros.
    double m2 = 0, msq = 0;
    for (std::size_t i = 0; i < absent.size(); ++i)
      if (!absent[i] && i != p.variable) {
        m2 += clean.per_variable[i].sum_mean_squared;
        msq += clean.per_variable[i].sum_mean_of_squares;
      }
    CHECK(got.summary.sum_mean_squared == Approx(m2).epsilon(1e-12));
    CHECK(got.summary.sum_mean_of_squares == Approx(msq).epsilon(1e-12));
  }
}

/// Runs w with p applied (and removed again afterwards).
template <class O = void, class S>
auto run_poisoned(fused_towers<S>& w, const poison& p, const gradavg::options& opts) {
  S& x = w.data[p.tower][p.variable][p.element];
  const S saved = x;
  x = static_cast<S>(p.value);
  auto r = run_into<O>(w, opts);
  x = saved;
  return r;
}

/// Requires every output and statistic of w under opts to be bitwise the serial run's with 2, 3
/// and 8 threads started for the call and on a thread_pool (threads left unset and given), and
/// with streaming stores; the serial run itself against the reference.
template <class O = void, class S>
void require_same_for_every_thread_count(const fused_towers<S>& w, gradavg::options opts, double tol) {
  opts.run.threads = 1;
  const auto serial = run_into<O>(w, opts);
  const auto want = w.expect(opts.compute.weights, opts.compute.scale);
  require_outputs_match(serial.means, want, false, tol);
  require_outputs_match(serial.squares, want, true, tol);
  require_statistics_match(serial, want, tol, w.absent);
  gradavg::thread_pool pool(3);
  for (std::size_t threads : {2, 3, 8}) {
    INFO("threads = " << threads);
    opts.run.threads = threads;
    opts.run.pool = nullptr;
    require_same_bits(serial, run_into<O>(w, opts));
    opts.run.pool = &pool;
    require_same_bits(serial, run_into<O>(w, opts));
  }
  {
    INFO("the pool's own concurrency");
    opts.run.threads = gradavg::default_threads;
    opts.run.pool = &pool;
    require_same_bits(serial, run_into<O>(w, opts));
  }
  opts.run.pool = nullptr;
  opts.run.stores = gradavg::store_policy::streaming;
  for (std::size_t threads : {1, 3}) {
    INFO("streaming stores, threads = " << threads);
    opts.run.threads = threads;
    require_same_bits(serial, run_into<O>(w, opts));
  }
}


}  // namespace gradavg_test
