// Sharded output (gradavg::output_mode::sharded) over the transport of threads: each rank's shard
// against a reference written here (the towers summed in rank order, divided; with a lossy format
// the documented roundings of each contribution, summed, never rounded again), the elements
// outside the shard untouched, the shards tiling the range; non-finite detection across shards;
// error feedback; the refusals.
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "compression_reference.hpp"
#include "support.hpp"
#include "thread_transport.hpp"

namespace {

using namespace gradavg_test;
using gradavg::compression;
using gradavg::output_mode;

/// One tower per rank of random values (seeded by rank and variable) times powers of two that
/// change every 50 elements: float16's block scales, and so its bits, depend on where the blocks
/// begin.
template <class S>
std::vector<towers_of<S>> one_tower_per_rank(int ranks) {
  return gradavg_test::one_tower_per_rank<S>(
      ranks, 9100, [](Eigen::Index j, S x) { return std::ldexp(x, static_cast<int>((j / 50) % 9) * 3 - 12); });
}

std::size_t total_elements() {
  std::size_t n = 0;
  for (std::size_t s : sizes) n += s;
  return n;
}

/// Rank r's shard of n elements among p, as documented: [n r / p, n (r + 1) / p).
gradavg::element_range documented_shard(std::size_t n, int p, int r) {
  return {n * static_cast<std::size_t>(r) / static_cast<std::size_t>(p),
          n * static_cast<std::size_t>(r + 1) / static_cast<std::size_t>(p)};
}

/// The flat means a sharded call computes: the values summed in rank order in S (decoded from
/// the format's rounding of runs of `run` elements of each shard, blocks from the run's start),
/// divided by the rank count; with squares when `squares`.
template <class S>
std::vector<S> sharded_reference(const std::vector<std::vector<S>>& values, std::size_t run, compression format,
                                 bool squares) {
  const std::size_t n = values[0].size();
  const int p = static_cast<int>(values.size());
  std::vector<S> out(n);
  for (int owner = 0; owner < p; ++owner) {
    const auto shard = documented_shard(n, p, owner);
    for (std::size_t begin = shard.begin; begin < shard.end; begin += run) {
      const std::size_t end = std::min(shard.end, begin + run);
      std::vector<S> sum(end - begin);
      for (int r = 0; r < p; ++r) {
        std::vector<S> x(values[static_cast<std::size_t>(r)].begin() + static_cast<std::ptrdiff_t>(begin),
                         values[static_cast<std::size_t>(r)].begin() + static_cast<std::ptrdiff_t>(end));
        if (squares)
          for (S& v : x) v = v * v;
        if (format != compression::none) x = round_part(x, format);
        for (std::size_t j = 0; j < x.size(); ++j) sum[j] = r == 0 ? x[j] : sum[j] + x[j];
      }
      for (std::size_t j = 0; j < sum.size(); ++j) out[begin + j] = sum[j] / static_cast<S>(p);
    }
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("sharded output: each rank's shard is the reference's, bit for bit, nothing else is written", "",
                   float, double) {
  using S = TestType;
  const std::size_t n = total_elements();
  for (compression format : {compression::none, compression::bfloat16, compression::float16})
    for (int ranks : {1, 2, 3, 4})
      for (std::size_t bucket : {std::size_t{0}, std::size_t{375}, std::size_t{40}}) {
        INFO("format " << static_cast<int>(format) << ", ranks " << ranks << ", bucket elements " << bucket);
        const auto towers = one_tower_per_rank<S>(ranks);
        const auto values = flat_values(towers);
        // A bucket of `bucket` elements (its means and squares) holds a run of bucket / ranks of
        // every rank's shard; the automatic size holds the whole shard here.
        const std::size_t run = bucket == 0 ? n : std::max<std::size_t>(1, bucket / static_cast<std::size_t>(ranks));
        const auto want_means = sharded_reference(values, run, format, false);
        const auto want_squares = sharded_reference(values, run, format, true);
        const auto results = average_on_ranks<S>(towers, sentinel_outputs<S>(), [&](int) {
          thread_options o;
          o.exchange.output = output_mode::sharded;
          o.exchange.compression = format;
          o.exchange.fusion_bytes = bucket * 2 * sizeof(S);
          return o;
        });
        std::size_t covered = 0;
        for (int r = 0; r < ranks; ++r) {
          const auto& result = results[static_cast<std::size_t>(r)];
          REQUIRE_FALSE(result.failure);
          const auto shard = documented_shard(n, ranks, r);
          CHECK(result.report.shard.begin == shard.begin);
          CHECK(result.report.shard.end == shard.end);
          const auto want = gradavg::shard_of({0, n}, ranks, r);
          CHECK((want.begin == shard.begin && want.end == shard.end));
          CHECK(shard.begin == covered);
          covered = shard.end;
          CHECK(result.report.averaged == sizes.size());
          const auto means = flat(result.means), squares = flat(result.squares);
          std::size_t wrong = 0;
          for (std::size_t j = 0; j < n; ++j) {
            const bool in = j >= shard.begin && j < shard.end;
            const S m = in ? want_means[j] : sentinel<S>, q = in ? want_squares[j] : sentinel<S>;
            wrong += same_bits(&means[j], &m, 1) && same_bits(&squares[j], &q, 1) ? 0 : 1;
          }
          CHECK(wrong == 0);
        }
        CHECK(covered == n);
      }
}

TEST_CASE("sharded output: with no lossy format, the shard holds the replicated call's bits, weights and scale too") {
  const auto towers = one_tower_per_rank<float>(3);
  const std::vector<std::vector<double>> weights = {{0.5}, {2.0}, {1.25}};
  auto run = [&](output_mode output) {
    return average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int r) {
      thread_options o;
      o.exchange.output = output;
      o.exchange.fusion_bytes = 4096;
      o.compute.weights = weights[static_cast<std::size_t>(r)];
      o.compute.scale = 0.25;
      o.compute.range = {5, 4400};
      return o;
    });
  };
  const auto replicated = run(output_mode::replicated), sharded = run(output_mode::sharded);
  for (std::size_t r = 0; r < 3; ++r) {
    REQUIRE_FALSE(sharded[r].failure);
    const auto shard = sharded[r].report.shard;
    CHECK(shard.begin == 5 + 4395 * r / 3);
    CHECK(shard.end == 5 + 4395 * (r + 1) / 3);
    CHECK(replicated[r].report.shard.begin == 5);
    CHECK(replicated[r].report.shard.end == 4400);
    const auto got = flat(sharded[r].means), all = flat(replicated[r].means);
    std::size_t wrong = 0;
    for (std::size_t j = 0; j < got.size(); ++j) {
      const float want = j >= shard.begin && j < shard.end ? all[j] : sentinel<float>;
      wrong += same_bits(&got[j], &want, 1) ? 0 : 1;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("sharded output: fewer elements than ranks, the empty shards write nothing") {
  const auto towers = one_tower_per_rank<float>(4);
  const auto values = flat_values(towers);
  for (compression format : {compression::none, compression::int8}) {
    const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int) {
      thread_options o;
      o.exchange.output = output_mode::sharded;
      o.exchange.compression = format;
      o.compute.range = {5, 8};  // w1's elements 4, 5, 6: shards [5, 5), [5, 6), [6, 7), [7, 8)
      o.compute.on_nonfinite = gradavg::nonfinite_policy::report;
      return o;
    });
    for (std::size_t r = 0; r < 4; ++r) {
      INFO("format " << static_cast<int>(format) << ", rank " << r);
      REQUIRE_FALSE(results[r].failure);
      const auto shard = results[r].report.shard;
      CHECK(shard.begin == 5 + 3 * r / 4);
      CHECK(shard.end == 5 + 3 * (r + 1) / 4);
      const auto got = flat(results[r].means);
      for (std::size_t j = 0; j < got.size(); ++j) {
        if (j < shard.begin || j >= shard.end) {
          CHECK(got[j] == sentinel<float>);
          continue;
        }
        double exact = 0, largest = 0;
        for (const auto& v : values) {
          exact += double(v[j]);
          largest = std::max(largest, std::fabs(double(v[j])));
        }
        // int8: each contribution a block of one value (its own scale): exact but for float's rounding.
        CHECK(std::fabs(double(got[j]) - exact / 4) <= 1e-6 * largest);
      }
    }
  }
}

TEST_CASE("sharded output: a non-finite input in one rank's shard is reported, and zeroed, on every rank") {
  for (compression format : {compression::none, compression::bfloat16, compression::int8}) {
    INFO("format " << static_cast<int>(format));
    auto towers = one_tower_per_rank<float>(3);
    // w3 (4097 elements, flat 308..4404) crosses shards 0 and 1; its element 10 is in rank 0's.
    towers[2][0][3].first[10] = std::numeric_limits<float>::quiet_NaN();
    std::vector<std::vector<gradavg::variable_statistics>> reports(
        3, std::vector<gradavg::variable_statistics>(sizes.size()));
    const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int r) {
      thread_options o;
      o.exchange.output = output_mode::sharded;
      o.exchange.compression = format;
      o.exchange.fusion_bytes = 3000;
      o.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
      o.compute.per_variable = reports[static_cast<std::size_t>(r)];
      return o;
    });
    for (std::size_t r = 0; r < 3; ++r) {
      REQUIRE_FALSE(results[r].failure);
      CHECK(results[r].report.nonfinite_variables == 1);
      for (std::size_t i = 0; i < sizes.size(); ++i) CHECK(reports[r][i].nonfinite == (i == 3));
      const auto shard = results[r].report.shard;
      const auto& w3 = results[r].means[3];
      for (Eigen::Index j = 0; j < w3.size(); ++j) {
        const std::size_t flat_index = 308 + static_cast<std::size_t>(j);
        const bool in = flat_index >= shard.begin && flat_index < shard.end;
        if (in ? w3[j] != 0.0f : w3[j] != sentinel<float>) {
          FAIL_CHECK("rank " << r << ", w3[" << j << "] = " << w3[j]);
          break;
        }
      }
    }
  }
}

TEST_CASE("sharded output: int8 with error feedback, the same seed the same bits, the means of many steps converge") {
  const int ranks = 3, steps = 48;
  const auto towers = one_tower_per_rank<float>(ranks);
  const auto values = flat_values(towers);
  const std::size_t n = values[0].size();
  std::vector<std::vector<float>> residual(ranks, std::vector<float>(n, 0.0f));
  std::vector<double> sum(n, 0.0);
  std::vector<float> first_step;
  for (int k = 0; k < steps; ++k) {
    const auto results = average_on_ranks<float>(towers, sentinel_outputs<float>(), [&](int r) {
      thread_options o;
      o.exchange.output = output_mode::sharded;
      o.exchange.compression = compression::int8;
      o.exchange.seed = static_cast<std::uint64_t>(k);
      o.exchange.fusion_bytes = 3000;
      o.exchange.residual = residual[static_cast<std::size_t>(r)];
      return o;
    });
    std::vector<float> assembled(n);
    for (const auto& result : results) {
      REQUIRE_FALSE(result.failure);
      const auto m = flat(result.means);
      for (std::size_t j = result.report.shard.begin; j < result.report.shard.end; ++j) assembled[j] = m[j];
    }
    if (k == 0) first_step = assembled;
    for (std::size_t j = 0; j < n; ++j) sum[j] += assembled[j];
  }
  double worst = 0, largest = 0, first_worst = 0;
  for (std::size_t j = 0; j < n; ++j) {
    double exact = 0;
    for (const auto& v : values) {
      exact += double(v[j]);
      largest = std::max(largest, std::fabs(double(v[j])));
    }
    worst = std::max(worst, std::fabs(sum[j] / steps - exact / ranks));
    first_worst = std::max(first_worst, std::fabs(double(first_step[j]) - exact / ranks));
  }
  // One step: each contribution within one int8 step (1/127 of the largest); the sum is not
  // encoded again. Many steps: only the last residuals stay out of the sum.
  const double step = largest / 127;
  CHECK(first_worst <= step * 1.001);
  CHECK(worst <= 2 * step / steps + 1e-5);
}

TEST_CASE("sharded output: statistics are refused, every rank passes the same output mode, a named one") {
  const auto towers = one_tower_per_rank<float>(3);
  const auto statistics = average_on_ranks<float>(towers, sentinel_outputs<float>(), [](int) {
    thread_options o;
    o.exchange.output = output_mode::sharded;
    o.compute.statistics = true;
    return o;
  });
  for (const auto& r : statistics) {
    const std::string message = failure_of<gradavg::error>(r);
    CHECK((contains(message, "options.compute.statistics needs every mean") || contains(message, "rank 0 failed")));
    CHECK(r.means[0][0] == sentinel<float>);
  }
  const auto differ = average_on_ranks<float>(towers, sentinel_outputs<float>(), [](int r) {
    thread_options o;
    o.exchange.output = r == 2 ? output_mode::sharded : output_mode::replicated;
    return o;
  });
  for (const auto& r : differ) {
    const std::string message = failure_of<gradavg::option_error>(r);
    CHECK(contains(message, "rank 2 passes a different options.exchange.output than ranks 0 and 1"));
    CHECK(r.means[3][0] == sentinel<float>);
  }
  const auto unnamed = average_on_ranks<float>(towers, sentinel_outputs<float>(), [](int) {
    thread_options o;
    o.exchange.output = static_cast<output_mode>(7);
    return o;
  });
  for (const auto& r : unnamed) CHECK(contains(failure_of<gradavg::error>(r), "options.exchange.output holds 7"));
}

namespace {

/// Every rank's parameters after gather_shards: rank r passes `updated` in its shard and values
/// of its own elsewhere (what it did not update), with options_of(r).
template <class S, class OptionsOf>
std::vector<rank_result<S>> gather_on_ranks(int ranks, const std::vector<S>& updated, const OptionsOf& options_of) {
  std::vector<rank_result<S>> start(static_cast<std::size_t>(ranks));
  const std::size_t n = updated.size();
  for (int r = 0; r < ranks; ++r) {
    const auto shard = documented_shard(n, ranks, r);
    std::size_t at = 0;
    for (std::size_t size : sizes) {
      vector_of<S> v(static_cast<Eigen::Index>(size));
      for (std::size_t j = 0; j < size; ++j, ++at)
        v[static_cast<Eigen::Index>(j)] = at >= shard.begin && at < shard.end ? updated[at] : S(-1000 - r);
      start[static_cast<std::size_t>(r)].means.push_back(v);
    }
  }
  return run_ranks<S>(ranks, std::move(start), [&](int r, auto& wire, auto& work, auto& mine) {
    gradavg::detail::processes::gather_shards(wire, work, mine.means, options_of(r));
    return gradavg::summary{};
  });
}

}  // namespace

TEMPLATE_TEST_CASE("gather of shards: every rank ends with every shard, the owner's bits or the format's on every rank",
                   "", float, double) {
  using S = TestType;
  const std::size_t n = total_elements();
  std::vector<S> updated(n);
  const S* values = random_slice<S>(n, 4242u);
  for (std::size_t j = 0; j < n; ++j) updated[j] = std::ldexp(values[j], static_cast<int>((j / 50) % 9) * 3 - 12);
  for (compression format : {compression::none, compression::bfloat16, compression::float16, compression::int8})
    for (int ranks : {1, 2, 3, 4})
      for (std::size_t bucket : {std::size_t{0}, std::size_t{1000}, std::size_t{40}}) {
        INFO("format " << static_cast<int>(format) << ", ranks " << ranks << ", bucket elements " << bucket);
        const auto results = gather_on_ranks<S>(ranks, updated, [&](int) {
          thread_options o;
          o.exchange.compression = format;
          o.exchange.fusion_bytes = bucket * sizeof(S);
          o.exchange.seed = 11;
          return o;
        });
        // The reference: each shard in runs of bucket / ranks, each run rounded from its start.
        const std::size_t run = bucket == 0 ? n : std::max<std::size_t>(1, bucket / static_cast<std::size_t>(ranks));
        std::vector<S> want = updated;
        if (format == compression::bfloat16 || format == compression::float16)
          for (int owner = 0; owner < ranks; ++owner) {
            const auto shard = documented_shard(n, ranks, owner);
            for (std::size_t begin = shard.begin; begin < shard.end; begin += run) {
              const std::size_t end = std::min(shard.end, begin + run);
              const auto rounded = round_part(std::vector<S>(updated.begin() + static_cast<std::ptrdiff_t>(begin),
                                                             updated.begin() + static_cast<std::ptrdiff_t>(end)),
                                              format);
              std::copy(rounded.begin(), rounded.end(), want.begin() + static_cast<std::ptrdiff_t>(begin));
            }
          }
        const auto first = flat(results[0].means);
        for (const auto& r : results) {
          REQUIRE_FALSE(r.failure);
          const auto got = flat(r.means);
          CHECK(same_bits(got.data(), first.data(), n));  // every rank alike, int8 too
          if (format != compression::int8) CHECK(same_bits(got.data(), want.data(), n));
        }
        if (format == compression::int8) {
          // Each value within one step of its block's largest magnitude (at most the largest).
          double largest = 0;
          for (S x : updated) largest = std::max(largest, std::fabs(double(x)));
          double worst = 0;
          for (std::size_t j = 0; j < n; ++j) worst = std::max(worst, std::fabs(double(first[j]) - double(updated[j])));
          CHECK(worst <= largest / 127 * 1.001);
          CHECK(worst > 0);
        }
      }
}

TEST_CASE("gather of shards: different parameter counts, a residual, or a different format: an error on every rank, "
          "nothing written") {
  const std::size_t n = total_elements();
  std::vector<float> updated(n, 0.5f);
  auto unchanged = [](const rank_result<float>& r, int rank) {
    return r.means[0][0] == 0.5f || r.means[0][0] == float(-1000 - rank);
  };
  // Rank 1 passes one parameter fewer.
  {
    std::vector<rank_result<float>> start(3);
    for (int r = 0; r < 3; ++r)
      for (std::size_t i = 0; i < sizes.size() - (r == 1 ? 1 : 0); ++i)
        start[static_cast<std::size_t>(r)].means.push_back(
            vector_of<float>::Constant(static_cast<Eigen::Index>(sizes[i]), float(r)));
    const auto results = run_ranks<float>(3, std::move(start), [&](int, auto& wire, auto& work, auto& mine) {
      gradavg::detail::processes::gather_shards(wire, work, mine.means, thread_options{});
      return gradavg::summary{};
    });
    for (int r = 0; r < 3; ++r) {
      const auto& result = results[static_cast<std::size_t>(r)];
      CHECK(contains(failure_of<gradavg::shape_error>(result),
                     "gradavg::threads::gather_shards: rank 1 passes a different parameter count than ranks 0 and 2"));
      CHECK((result.means[0].array() == float(r)).all());
      CHECK((result.means[4].array() == float(r)).all());
    }
  }
  // Rank 2 passes a residual; rank 0 another format.
  std::vector<float> residual(n);
  const auto with_residual = gather_on_ranks<float>(3, updated, [&](int r) {
    thread_options o;
    if (r == 2) o.exchange.residual = residual;
    return o;
  });
  for (int r = 0; r < 3; ++r) {
    const auto& result = with_residual[static_cast<std::size_t>(r)];
    CHECK(contains(failure_of<gradavg::error>(result), r == 2 ? "keeps none" : "rank 2 failed its own checks"));
    CHECK(unchanged(result, r));
    CHECK(result.means[5][63] == (r == 2 ? 0.5f : float(-1000 - r)));  // flat 4501: rank 2's shard
  }
  const auto formats = gather_on_ranks<float>(3, updated, [&](int r) {
    thread_options o;
    o.exchange.compression = r == 0 ? compression::bfloat16 : compression::none;
    return o;
  });
  for (int r = 0; r < 3; ++r)
    CHECK(contains(failure_of<gradavg::option_error>(formats[static_cast<std::size_t>(r)]),
                   "rank 0 passes a different options.exchange.compression than ranks 1 and 2"));
}
