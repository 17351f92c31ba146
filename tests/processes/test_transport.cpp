// The seam between a call across processes and its transport (detail/processes/exchange.hpp):
// a second transport, written in one file (support/thread_transport.hpp), runs the same call with threads as ranks. It
// moves bytes through shared memory behind a barrier, nothing else: the agreement, the data path
// and the owner_sum exchange are the library's, unchanged. Checked: the means and squares against
// the independent double reference, and bit for bit against the one-process call over the same
// towers where the towers add in the same order (one tower per rank, or any number on rank 0 and
// one on every other), the statistics too, for every bucket size; errors on one rank reach every
// rank, with nothing written.
#include <gradavg/gradavg.hpp>

#include <Eigen/Dense>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"
#include "thread_transport.hpp"

namespace {

using namespace gradavg_test;

/// Rank r averages towers[r] into means[r], no squares, default options.
template <class S>
std::vector<rank_result<S>> means_on_ranks(const std::vector<towers_of<S>>& towers,
                                           const std::vector<std::vector<vector_of<S>>>& means) {
  std::vector<rank_result<S>> start(towers.size());
  for (std::size_t r = 0; r < start.size(); ++r) start[r].means = means[r];
  return run_ranks<S>(static_cast<int>(towers.size()), std::move(start), [&](int r, auto& wire, auto& work, auto& mine) {
    return processes::average_into(wire, work, towers[static_cast<std::size_t>(r)], mine.means,
                                   gradavg::detail::no_squares, thread_options{}, nullptr, nullptr);
  });
}

/// A value's bits (floats and doubles).
template <class S>
std::uint64_t bits_of(S x) {
  return std::bit_cast<std::conditional_t<sizeof(S) == 8, std::uint64_t, std::uint32_t>>(x);
}

template <class S>
void check_one_process_bits(int ranks, std::size_t towers_on_rank0) {
  const auto towers = random_ranks<S>(ranks, [&](int r) { return r == 0 ? towers_on_rank0 : std::size_t{1}; });
  towers_of<S> flat;
  for (const auto& rank : towers) flat.insert(flat.end(), rank.begin(), rank.end());
  thread_options opts;
  opts.compute.statistics = true;
  auto one_means = sentinel_outputs<S>(), one_squares = sentinel_outputs<S>();
  const gradavg::summary one = gradavg::average_gradients_into(flat, one_means, one_squares, opts.local());

  // The independent reference first: the one-process call is right.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<const S*> gs;
    for (const auto& tower : flat) gs.push_back(tower[i].first.data());
    const expectation<S> e(gs, sizes[i]);
    require_matches(one_means[i].data(), e, flat.size(), false, "w" + std::to_string(i));
    require_matches(one_squares[i].data(), e, flat.size(), true, "w" + std::to_string(i));
  }
  // 4 elements a bucket with squares (buckets splitting every variable), a few variables a
  // bucket, automatic.
  for (std::size_t fusion : {2 * sizeof(S) * 4, std::size_t{3000}, std::size_t{0}}) {
    INFO("ranks " << ranks << ", towers on rank 0 " << towers_on_rank0 << ", fusion_bytes " << fusion);
    opts.exchange.fusion_bytes = fusion;
    const auto results = average_on_ranks<S>(towers, sentinel_outputs<S>(), [&](int) { return opts; });
    for (const auto& r : results) {
      REQUIRE_FALSE(r.failure);
      CHECK(same_outputs(r.means, one_means));
      CHECK(same_outputs(r.squares, one_squares));
      CHECK(r.report.towers == flat.size());
      CHECK(r.report.averaged == sizes.size());
      CHECK(bits_of(r.report.sum_mean_squared) == bits_of(one.sum_mean_squared));
      CHECK(bits_of(r.report.sum_mean_of_squares) == bits_of(one.sum_mean_of_squares));
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("a transport of threads: one process's bits, the statistics too, for every bucket size", "", float,
                   double) {
  for (int ranks : {2, 3, 4}) {
    check_one_process_bits<TestType>(ranks, 1);
    check_one_process_bits<TestType>(ranks, 3);
  }
}

TEST_CASE("a transport of threads: weights, scale, a NaN zeroed, per-variable reports: one process's bits") {
  auto towers = random_ranks<float>(3, [](int) { return std::size_t{1}; });
  towers[1][0][2].first[5] = std::numeric_limits<float>::quiet_NaN();  // variable #2 on rank 1
  towers_of<float> flat;
  for (const auto& rank : towers) flat.insert(flat.end(), rank.begin(), rank.end());
  const std::vector<double> weights = {0.5, 2.0, 1.25};
  std::vector<std::vector<gradavg::variable_statistics>> reports(4, std::vector<gradavg::variable_statistics>(sizes.size()));
  auto options_for = [&](std::span<const double> w, std::vector<gradavg::variable_statistics>& report) {
    thread_options o;
    o.compute.weights = w;
    o.compute.scale = 0.75;
    o.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
    o.compute.statistics = true;
    o.compute.per_variable = report;
    o.exchange.fusion_bytes = 256;  // buckets splitting variable #3
    return o;
  };
  auto one_means = sentinel_outputs<float>(), one_squares = sentinel_outputs<float>();
  const gradavg::summary one =
      gradavg::average_gradients_into(flat, one_means, one_squares, options_for(weights, reports[3]).local());
  REQUIRE(one.nonfinite_variables == 1);
  CHECK(one_means[2].isZero());  // the independent fact: a zeroed variable is zeros
  const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int r) {
    return options_for(std::span<const double>(weights).subspan(static_cast<std::size_t>(r), 1),
                       reports[static_cast<std::size_t>(r)]);
  });
  for (std::size_t r = 0; r < 3; ++r) {
    REQUIRE_FALSE(results[r].failure);
    CHECK(same_outputs(results[r].means, one_means));
    CHECK(same_outputs(results[r].squares, one_squares));
    CHECK(results[r].report.nonfinite_variables == 1);
    CHECK(bits_of(results[r].report.sum_mean_squared) == bits_of(one.sum_mean_squared));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      INFO("rank " << r << ", variable " << i);
      CHECK(reports[r][i].nonfinite == (i == 2));
      CHECK(bits_of(reports[r][i].sum_mean_squared) == bits_of(reports[3][i].sum_mean_squared));
      CHECK(bits_of(reports[r][i].sum_mean_of_squares) == bits_of(reports[3][i].sum_mean_of_squares));
    }
  }
}

TEST_CASE("a transport of threads: one rank's bad output is its own error there, remote_error elsewhere, "
          "nothing written") {
  const auto towers = random_ranks<float>(3, [](int) { return std::size_t{1}; });
  std::vector<std::vector<vector_of<float>>> means(3, sentinel_outputs<float>());
  means[1][4] = vector_of<float>::Constant(32, sentinel<float>);  // variable #4 holds 33 elements
  const auto results = means_on_ranks<float>(towers, means);
  const std::string own = failure_of<gradavg::error>(results[1]);
  CHECK(contains(own, "w4"));
  for (int r : {0, 2}) {
    const std::string remote = failure_of<gradavg::remote_error>(results[static_cast<std::size_t>(r)]);
    CHECK(contains(remote, "gradavg::threads: rank 1 failed its own checks"));
    CHECK(contains(remote, "variable #4"));
  }
  for (std::size_t r = 0; r < 3; ++r) CHECK(same_outputs(results[r].means, means[r]));
}

TEST_CASE("a transport of threads: a different variable count on one rank is a tower_error on every rank") {
  auto towers = random_ranks<double>(3, [](int) { return std::size_t{1}; });
  towers[2][0].pop_back();
  std::vector<std::vector<vector_of<double>>> means(3, sentinel_outputs<double>());
  means[2].pop_back();
  const auto results = means_on_ranks<double>(towers, means);
  for (const auto& r : results) {
    const std::string message = failure_of<gradavg::tower_error>(r);
    CHECK(contains(message, "gradavg::threads: rank 2 holds 5 variables but ranks 0 and 1 hold 6"));
  }
  for (std::size_t r = 0; r < 3; ++r) CHECK(same_outputs(results[r].means, means[r]));
}
