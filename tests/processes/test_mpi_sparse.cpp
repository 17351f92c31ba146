// Row-sparse gradients across processes (gradavg::mpi over row-sparse towers) under mpiexec (ctest:
// 2, 3 and 4 ranks); built with GRADAVG_TEST_C10D, gradavg::c10d over gloo (test_c10d_sparse, 2 and
// 3 processes started by support/launch_ranks.sh). Every rank regenerates every rank's towers from a seed and computes the
// contract's result itself in scalar code: each rank's sums of its densified towers, added in rank
// order (zeros for a rank that lists a row in none of its towers), divided by all ranks' towers.
// Outputs are compared bit for bit with it and across ranks (a hash, gathered); dense and
// coalesced outputs; ranks with 1 to 3 towers, one rank listing no rows; every failure provoked on
// one rank only: every rank throws, none hangs, nothing is written.
#include <gradavg/gradavg.hpp>
#include <gradavg/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// The transport first: libtorch's headers define a CHECK that catch.hpp must replace.
#if defined(GRADAVG_TEST_C10D)
#include "c10d_world.hpp"

namespace gradavg_test {
namespace across = gradavg::c10d;
using world_options = gradavg::c10d::options;
}  // namespace gradavg_test
#else
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include "mpi_support.hpp"

namespace gradavg_test {
namespace across = gradavg::mpi;
using world_options = gradavg::mpi::options;
inline MPI_Comm world() { return MPI_COMM_WORLD; }
inline const mpi_session session;
}  // namespace gradavg_test
#endif

#include "catch.hpp"
#include "support.hpp"

namespace {

using namespace gradavg_test;
using half = Eigen::half;

/// One tower's rows of one variable.
template <class I, class S>
struct rows_of_tower {
  std::vector<I> indices;
  std::vector<S> values;
};

/// Rank r's towers of one variable of `rows` x `length`: (r % 3) + 1 towers listing up to `listed`
/// rows each (repeats allowed), drawn from seed; the last rank lists none when `empty_last`.
template <class I, class S>
std::vector<rows_of_tower<I, S>> towers_of_rank(int r, int ranks, std::int64_t rows, std::size_t length,
                                                std::size_t listed, std::uint32_t seed, bool empty_last) {
  std::mt19937 gen(seed * 1000 + static_cast<std::uint32_t>(r));
  std::uniform_int_distribution<std::int64_t> row(0, rows - 1);
  std::uniform_real_distribution<float> value(-1, 1);
  std::vector<rows_of_tower<I, S>> towers(static_cast<std::size_t>(r % 3 + 1));
  for (auto& t : towers) {
    if (empty_last && r == ranks - 1) continue;
    for (std::size_t n = 0; n < listed; ++n) t.indices.push_back(static_cast<I>(row(gen)));
    for (std::size_t n = 0; n < listed * length; ++n) t.values.push_back(static_cast<S>(value(gen)));
  }
  return towers;
}

/// The contract in scalar code: per rank, the sum in tower order of its densified towers (in the
/// accumulator; a tower's repeated rows added in S first); over ranks, in rank order, with 0 for
/// a rank that lists the row nowhere; divided by every rank's towers; rounded to O.
template <class O, class I, class S>
std::pair<std::vector<O>, std::vector<O>> expected(int ranks, std::int64_t rows, std::size_t length,
                                                   std::size_t listed, std::uint32_t seed, bool empty_last) {
  using A = accumulator_of<S>;
  const std::size_t n = static_cast<std::size_t>(rows) * length;
  std::vector<A> total(n, A(0)), total_sq(n, A(0));
  std::size_t towers = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto mine = towers_of_rank<I, S>(r, ranks, rows, length, listed, seed, empty_last);
    towers += mine.size();
    std::vector<A> sum(n, A(0)), sum_sq(n, A(0));
    for (const auto& t : mine) {
      std::vector<S> dense(n, S(0));
      std::vector<bool> seen(static_cast<std::size_t>(rows), false);
      for (std::size_t p = 0; p < t.indices.size(); ++p) {
        const auto row = static_cast<std::size_t>(t.indices[p]);
        for (std::size_t j = 0; j < length; ++j) {
          S& d = dense[row * length + j];
          d = seen[row] ? static_cast<S>(d + t.values[p * length + j]) : t.values[p * length + j];
        }
        seen[row] = true;
      }
      const bool first_tower = &t == &mine.front();
      for (std::size_t j = 0; j < n; ++j) {
        const A x = static_cast<A>(dense[j]);
        sum[j] = first_tower ? x : sum[j] + x;
        sum_sq[j] = first_tower ? rounded_square(x) : sum_sq[j] + rounded_square(x);
      }
    }
    for (std::size_t j = 0; j < n; ++j) {
      total[j] = r == 0 ? sum[j] : total[j] + sum[j];
      total_sq[j] = r == 0 ? sum_sq[j] : total_sq[j] + sum_sq[j];
    }
  }
  std::pair<std::vector<O>, std::vector<O>> out;
  for (std::size_t j = 0; j < n; ++j) {
    out.first.push_back(static_cast<O>(total[j] / static_cast<A>(towers)));
    out.second.push_back(static_cast<O>(total_sq[j] / static_cast<A>(towers)));
  }
  return out;
}

template <class I, class S>
using tower = std::vector<std::pair<std::optional<gradavg::row_sparse<I, S>>, std::string>>;

/// One variable "emb" of [rows, length], this rank's towers as the call's.
template <class I, class S>
std::vector<tower<I, S>> call_towers(const std::vector<rows_of_tower<I, S>>& mine, std::int64_t rows,
                                     std::size_t length) {
  std::vector<tower<I, S>> tg;
  for (const auto& t : mine)
    tg.push_back({{gradavg::rows_of<I, S>(t.indices, t.values.data(),
                                          gradavg::shape::matrix(rows, static_cast<std::int64_t>(length))),
                   "emb"}});
  return tg;
}

template <class I, class S, class O>
void check_against_contract(std::int64_t rows, std::size_t length, std::size_t listed, std::uint32_t seed,
                            bool empty_last, gradavg::sparse_wire wire) {
  const int rank = world_rank(), ranks = world_size();
  INFO("rank " << rank << " of " << ranks << ", seed " << seed << ", wire " << static_cast<int>(wire));
  world_options opts;
  opts.exchange.sparse = wire;
  if (seed == 2) opts.exchange.fusion_bytes = 40;  // the dense wire in buckets of 10 values
  const auto mine = towers_of_rank<I, S>(rank, ranks, rows, length, listed, seed, empty_last);
  const auto tg = call_towers(mine, rows, length);
  const auto want = expected<O, I, S>(ranks, rows, length, listed, seed, empty_last);
  const std::size_t n = static_cast<std::size_t>(rows) * length;

  std::vector<O> mean(n, O(-3)), square(n, O(-3));
  std::vector<std::vector<O>*> m{&mean}, s{&square};
  const auto report = across::average_gradients_into(world(), tg, m, s, opts);
  CHECK(report.averaged == 1);
  CHECK(same_bits(mean.data(), want.first.data(), n));
  CHECK(same_bits(square.data(), want.second.data(), n));
  CHECK(same_on_every_rank(fnv1a(mean.data(), n * sizeof(O), fnv1a(square.data(), n * sizeof(O)))));

  gradavg::sparse_rows<I, O> coalesced;
  std::vector<gradavg::sparse_rows<I, O>*> c{&coalesced};
  across::average_gradients_into(world(), tg, c, opts);
  std::vector<I> rows_listed;
  for (int r = 0; r < ranks; ++r)
    for (const auto& t : towers_of_rank<I, S>(r, ranks, rows, length, listed, seed, empty_last))
      rows_listed.insert(rows_listed.end(), t.indices.begin(), t.indices.end());
  std::sort(rows_listed.begin(), rows_listed.end());
  rows_listed.erase(std::unique(rows_listed.begin(), rows_listed.end()), rows_listed.end());
  CHECK(coalesced.indices == rows_listed);
  bool rows_match = coalesced.values.size() == rows_listed.size() * length;
  for (std::size_t p = 0; p < coalesced.indices.size() && rows_match; ++p)
    rows_match = same_bits(coalesced.values.data() + p * length,
                           want.first.data() + static_cast<std::size_t>(coalesced.indices[p]) * length, length);
  CHECK(rows_match);
}

}  // namespace

TEST_CASE("mpi row-sparse: the contract's bits on every rank, every type, rows and dense on the wire", "[sparse]") {
  using gradavg::sparse_wire;
  for (sparse_wire wire : {sparse_wire::rows, sparse_wire::dense, sparse_wire::automatic})
    for (std::uint32_t seed : {1u, 2u}) {
      check_against_contract<std::int64_t, float, float>(40, 9, 12, seed, false, wire);
      check_against_contract<std::int32_t, double, double>(25, 70, 8, seed, false, wire);
      check_against_contract<std::int64_t, half, float>(30, 16, 10, seed, false, wire);
      check_against_contract<std::int32_t, half, half>(30, 16, 10, seed, false, wire);
      check_against_contract<std::int64_t, float, float>(50, 5, 7, seed, true, wire);  // the last rank lists none
      check_against_contract<std::int64_t, float, float>(200, 3, 2, seed, false, wire);  // few rows: automatic: rows
    }
}

TEST_CASE("mpi row-sparse: a variable absent everywhere is skipped, one absent on a rank is an error",
          "[sparse]") {
  const int rank = world_rank();
  std::vector<std::int64_t> idx{1};
  std::vector<float> val{2, 3};
  const auto g = gradavg::rows_of<std::int64_t, float>(idx, val.data(), gradavg::shape::matrix(3, 2));
  using slot = std::pair<std::optional<gradavg::row_sparse<std::int64_t, float>>, std::string>;
  std::vector<std::vector<slot>> tg{{{g, "emb"}, {std::nullopt, "pos"}}};
  std::vector<float> out(6, -1), untouched(6, -1);
  std::vector<std::vector<float>*> m{&out, nullptr};
  const auto report = across::average_gradients_into(world(), tg, m);
  CHECK(report.averaged == 1);
  CHECK(report.skipped == 1);
  CHECK(out == std::vector<float>{0, 0, 2, 3, 0, 0});

  std::fill(out.begin(), out.end(), -1.0f);
  if (rank == 1) tg[0][0].first.reset();
  const std::string what = message_of<gradavg::missing_gradient_error>(
      [&] { across::average_gradients_into(world(), tg, m); });
  CHECK(contains(what, "variable #0 'emb': gradient missing on every tower of rank 1 but present on rank"));
  CHECK(out == untouched);
}

TEST_CASE("mpi row-sparse: a failure on one rank: that rank's error, remote_error on the others, nothing written",
          "[sparse]") {
  const int rank = world_rank();
  std::vector<std::int64_t> idx{0, 2};
  std::vector<float> val{1, 2, 3, 4};
  std::vector<float> out(6, -1), untouched(6, -1);
  std::vector<std::vector<float>*> m{&out};
  auto towers_with = [&](const std::vector<std::int64_t>& i, gradavg::shape dense) {
    return std::vector<std::vector<std::pair<gradavg::row_sparse<std::int64_t, float>, std::string>>>{
        {{gradavg::rows_of<std::int64_t, float>(i, val.data(), dense), "emb"}}};
  };
  SECTION("an index past the rows on rank 1") {
    const std::vector<std::int64_t> bad{0, 3};
    const auto tg = towers_with(rank == 1 ? bad : idx, gradavg::shape::matrix(3, 2));
    auto call = [&] { across::average_gradients_into(world(), tg, m); };
    if (rank == 1)
      CHECK(contains(message_of<gradavg::index_error>(call), "index 1 is 3, outside the 3 rows"));
    else
      CHECK(contains(message_of<gradavg::remote_error>(call), "rank 1 failed its own checks"));
  }
  SECTION("another dense shape on rank 1") {
    std::vector<float> wide(9, -1);
    std::vector<std::vector<float>*> mw{rank == 1 ? &wide : &out};
    const auto tg = towers_with(idx, rank == 1 ? gradavg::shape::matrix(3, 3) : gradavg::shape::matrix(3, 2));
    std::vector<float> v3{1, 2, 3, 4, 5, 6};
    auto tg3 = tg;
    if (rank == 1)
      tg3[0][0].first = gradavg::rows_of<std::int64_t, float>(idx, v3.data(), gradavg::shape::matrix(3, 3));
    const std::string what =
        message_of<gradavg::shape_error>([&] { across::average_gradients_into(world(), tg3, mw); });
    CHECK(contains(what, "rank 1 has another dense shape than rank"));
    CHECK(wide == std::vector<float>(9, -1));
  }
  SECTION("ranks that pass another options.exchange.sparse") {
    const auto tg = towers_with(idx, gradavg::shape::matrix(3, 2));
    world_options opts;
    if (rank == 0) opts.exchange.sparse = gradavg::sparse_wire::dense;
    CHECK(contains(message_of<gradavg::option_error>([&] { across::average_gradients_into(world(), tg, m, opts); }),
                   " in options.exchange.sparse"));
  }
  SECTION("options the row-sparse exchange does not take") {
    const auto tg = towers_with(idx, gradavg::shape::matrix(3, 2));
    world_options opts;
    if (rank == 0) opts.compute.scale = 2;
    auto call = [&] { across::average_gradients_into(world(), tg, m, opts); };
    if (rank == 0)
      CHECK(contains(message_of<gradavg::option_error>(call), "averaged plain"));
    else
      CHECK_THROWS_AS(call(), gradavg::remote_error);
  }
  CHECK(out == untouched);
}
