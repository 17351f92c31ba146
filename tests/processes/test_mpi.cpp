// gradavg::mpi under mpiexec (ctest runs it with 2, 3 and 4 ranks, each with a timeout: a hang
// fails). Every rank regenerates every rank's towers from a seed, so each can compute the
// references itself: the independent double reference of reference.hpp (tolerance of a sum over
// all towers: 2 (T+1) eps relative to the mean magnitude, plus 2^-10 for 16-bit outputs), and the
// one-process gradavg call over all towers, whose means the cross-process means equal bit for bit
// with one tower per rank and unit weights (the same additions in the same order).
// Results are compared bit for bit across ranks (a hash of every output, gathered), across bucket
// sizes, and between the two APIs. Every failure is provoked on one rank only: every rank throws,
// none hangs, no output changes.
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "compression_reference.hpp"
#include "counted_tensor.hpp"
#include "mpi_support.hpp"
#include "reference.hpp"
#include "support.hpp"
#include "x87_check.hpp"

namespace {

using namespace gradavg_test;
using half = Eigen::half;
using bfloat16 = Eigen::bfloat16;

const mpi_session session;  // mpi_support.hpp

/// Agreement collectives of the calls under count (the MPI profiling interface: these wrap the
/// library's MPI_Allreduce and MPI_Allgather for the whole program).
bool counting = false;
int allreduce_calls = 0, allgather_calls = 0;

}  // namespace

extern "C" int MPI_Allreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  allreduce_calls += counting ? 1 : 0;
  return PMPI_Allreduce(send, receive, count, type, op, comm);
}

extern "C" int MPI_Allgather(const void* send, int send_count, MPI_Datatype send_type, void* receive,
                             int receive_count, MPI_Datatype receive_type, MPI_Comm comm) {
  allgather_calls += counting ? 1 : 0;
  return PMPI_Allgather(send, send_count, send_type, receive, receive_count, receive_type, comm);
}

namespace {

/// Runs f and returns (MPI_Allreduce calls, MPI_Allgather calls) made while it ran.
template <class F>
std::pair<int, int> collectives_of(F&& f) {
  allreduce_calls = allgather_calls = 0;
  counting = true;
  try {
    f();
  } catch (...) {
    counting = false;
    throw;
  }
  counting = false;
  return {allreduce_calls, allgather_calls};
}


template <class S>
using entry = std::pair<const std::vector<S>*, std::string>;  // null: gradient absent
template <class S>
using towers_t = std::vector<std::vector<entry<S>>>;

/// Every rank's towers, regenerated identically on every rank: variable i has sizes[i] elements,
/// absent[i] means absent on every tower; rank r holds towers_of[r] towers.
template <class S>
struct world {
  std::vector<std::size_t> sizes;
  std::vector<bool> absent;
  std::vector<std::size_t> towers_of;
  std::vector<std::vector<std::vector<S>>> data;  // [global tower][variable]

  world(std::vector<std::size_t> sizes_, std::vector<bool> absent_, std::vector<std::size_t> towers_of_, std::uint32_t seed)
      : sizes(std::move(sizes_)), absent(std::move(absent_)), towers_of(std::move(towers_of_)) {
    const std::size_t total = std::accumulate(towers_of.begin(), towers_of.end(), std::size_t{0});
    for (std::size_t k = 0; k < total; ++k) {
      data.emplace_back();
      for (std::size_t i = 0; i < sizes.size(); ++i)
        data.back().push_back(random_values<S>(sizes[i], seed * 7919u + static_cast<std::uint32_t>(k * 1000 + i)));
    }
  }

  std::size_t first_tower(std::size_t r) const {
    return std::accumulate(towers_of.begin(), towers_of.begin() + static_cast<std::ptrdiff_t>(r), std::size_t{0});
  }
  std::size_t total_towers() const { return data.size(); }

  /// Towers [first, first + count) as entries.
  towers_t<S> towers(std::size_t first, std::size_t count) const {
    towers_t<S> t(count);
    for (std::size_t k = 0; k < count; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i)
        t[k].emplace_back(absent[i] ? nullptr : &data[first + k][i], std::string("v").append(std::to_string(i)));
    return t;
  }
  towers_t<S> local() const {
    const std::size_t r = static_cast<std::size_t>(world_rank());
    return towers(first_tower(r), towers_of[r]);
  }
  towers_t<S> all() const { return towers(0, total_towers()); }

  /// Outputs filled with the sentinel (skipped variables' outputs must keep it).
  template <class O = S>
  std::vector<std::vector<O>> outputs() const {
    std::vector<std::vector<O>> out;
    for (std::size_t n : sizes) out.emplace_back(n, O(-1234.5f));
    return out;
  }

  /// The double reference's means or squares of variable i over all towers.
  std::vector<double> expected(std::size_t i, bool squares) const {
    std::vector<const S*> ptrs;
    for (const auto& t : data) ptrs.push_back(t[i].data());
    const reference<S> ref(ptrs, sizes[i]);
    return squares ? ref.square : ref.mean;
  }
  std::vector<double> scale_of(std::size_t i, bool squares) const {
    std::vector<const S*> ptrs;
    for (const auto& t : data) ptrs.push_back(t[i].data());
    return magnitude<S>(ptrs, sizes[i], squares);
  }
};

/// Tower counts per rank: the same count everywhere, or uneven (1, 2, 3, 1, ...).
std::vector<std::size_t> layout(bool uneven, std::size_t same = 1) {
  std::vector<std::size_t> t(static_cast<std::size_t>(world_size()), same);
  if (uneven)
    for (std::size_t r = 0; r < t.size(); ++r) t[r] = 1 + r % 3;
  return t;
}

/// Requires outputs within the sum-over-all-towers tolerance of the double reference (16-bit
/// outputs: within an ulp of their type as well), and the skipped ones untouched; the first
/// `variables` only when given.
template <class S, class O>
void require_reference(const world<S>& w, const std::vector<std::vector<O>>& out, bool squares,
                       std::size_t variables = std::numeric_limits<std::size_t>::max()) {
  for (std::size_t i = 0; i < std::min(w.sizes.size(), variables); ++i) {
    if (w.absent[i]) {
      for (O x : out[i]) CHECK(x == O(-1234.5f));
      continue;
    }
    const auto want = w.expected(i, squares);
    const auto scale = w.scale_of(i, squares);
    const double t = (std::is_same_v<S, double> ? tolerance<double>(w.total_towers()) : tolerance<float>(w.total_towers())) +
                     (std::is_same_v<O, half>       ? std::ldexp(1.0, -10)
                      : std::is_same_v<O, bfloat16> ? std::ldexp(1.0, -7)
                                                    : 0.0);
    std::size_t bad = want.size();
    for (std::size_t j = 0; j < want.size() && bad == want.size(); ++j)
      if (!(std::abs(static_cast<double>(out[i][j]) - want[j]) <= t * scale[j] + 1e-30)) bad = j;
    INFO("variable " << i << " element " << bad << (squares ? " (squares)" : " (means)"));
    CHECK(bad == want.size());
  }
}

using exchange = gradavg::mpi::exchange_method;

template <class S>
void check_against_references(bool uneven, bool squares, std::size_t fusion_bytes,
                              exchange how = exchange::point_to_point) {
  const world<S> w({1, 7, 33, 1000, 5, 4097, 2}, {false, false, true, false, false, false, true}, layout(uneven), 11);
  const auto local = w.local();
  auto means = w.outputs();
  auto sq = w.outputs();
  gradavg::mpi::options opts;
  opts.exchange.fusion_bytes = fusion_bytes;
  opts.exchange.method = how;
  gradavg::summary s;
  if (squares) s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, means, sq, opts);
  else s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, means, opts);
  gradavg_test::check_x87_after("gradavg::mpi::average_gradients_into with skipped variables");
  CHECK(s.averaged == 5);
  CHECK(s.skipped == 2);
  CHECK(s.towers == w.total_towers());
  require_reference(w, means, false);
  if (squares) require_reference(w, sq, true);
  CHECK(same_on_every_rank(hash_of(means)));
  if (squares) CHECK(same_on_every_rank(hash_of(sq)));

  // The one-process call over all towers: the means and squares bit for bit with one tower per
  // rank (the same additions in the same order; each square rounded before it is added, in one
  // process as across ranks).
  const auto all = w.all();
  auto one_means = w.outputs();
  auto one_sq = w.outputs();
  if (squares) gradavg::average_gradients_into(all, one_means, one_sq);
  else gradavg::average_gradients_into(all, one_means);
  if (!uneven) CHECK(hash_of(means) == hash_of(one_means));
  if (!uneven && squares) CHECK(hash_of(sq) == hash_of(one_sq));

  // Any bucket size and either exchange give the same bits: each element is summed the same way
  // in every bucket (defaults: automatic buckets, the collectives).
  auto other = w.outputs();
  auto other_sq = w.outputs();
  gradavg::mpi::options defaults;
  if (squares) gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, other, other_sq, defaults);
  else gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, other, defaults);
  CHECK(hash_of(other) == hash_of(means));
  if (squares) CHECK(hash_of(other_sq) == hash_of(sq));
}

TEST_CASE("float: means and squares against the references, even and uneven towers, buckets splitting variables") {
  // 4 * 7 + 4 = 32 bytes: buckets of 4 elements with squares, 8 without, splitting variables at
  // odd offsets; 4097-element variable over hundreds of buckets.
  for (bool uneven : {false, true})
    for (bool squares : {false, true})
      for (std::size_t bytes : {std::size_t{32}, std::size_t{4 * 1001}, std::size_t{12}})
        for (exchange how : {exchange::point_to_point, exchange::collectives}) {
          INFO("uneven " << uneven << " squares " << squares << " fusion_bytes " << bytes << " collectives "
                         << (how == exchange::collectives));
          check_against_references<float>(uneven, squares, bytes, how);
        }
}

TEST_CASE("double: means and squares against the references") {
  for (bool uneven : {false, true})
    for (bool squares : {false, true}) {
      check_against_references<double>(uneven, squares, 8 * 37);
      check_against_references<double>(uneven, squares, 8 * 37, exchange::collectives);
    }
}

TEST_CASE("compressed exchange over MPI: the documented format's bits, the same on every rank, either method") {
  // One tower per rank. The reference, from the format's definition (gradavg::compression): each
  // rank's sums rounded to the format, summed in rank order in float, rounded again, divided;
  // float16 rounds blocks of 256 values of a bucket (one bucket here: automatic buckets) with a
  // power-of-two scale that brings the block's largest magnitude into [2^14, 2^15).
  const world<float> w({1, 7, 33, 1000, 5, 4097, 2}, {false, false, true, false, false, false, true}, layout(false), 23);
  for (auto format : {gradavg::compression::bfloat16, gradavg::compression::float16}) {
    std::vector<float> sum;
    for (std::size_t k = 0; k < w.total_towers(); ++k) {
      std::vector<float> x;
      for (std::size_t i = 0; i < w.sizes.size(); ++i)
        if (!w.absent[i]) x.insert(x.end(), w.data[k][i].begin(), w.data[k][i].end());
      x = round_part(x, format);
      if (sum.empty()) sum = x; else for (std::size_t j = 0; j < x.size(); ++j) sum[j] += x[j];
    }
    sum = round_part(sum, format);
    for (exchange how : {exchange::point_to_point, exchange::collectives}) {
      INFO("format " << static_cast<int>(format) << ", collectives " << (how == exchange::collectives));
      auto means = w.outputs();
      gradavg::mpi::options opts;
      opts.exchange.compression = format;
      opts.exchange.method = how;
      const gradavg::summary s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), means, opts);
      CHECK(s.averaged == 5);
      std::size_t at = 0, bad = 0;
      for (std::size_t i = 0; i < w.sizes.size(); ++i) {
        if (w.absent[i]) {
          CHECK(means[i][0] == -1234.5f);
          continue;
        }
        for (float x : means[i]) bad += std::bit_cast<std::uint32_t>(x) != std::bit_cast<std::uint32_t>(sum[at++] / float(w.total_towers())) ? 1 : 0;
      }
      CHECK(bad == 0);
      CHECK(same_on_every_rank(hash_of(means)));
    }
  }
}

TEST_CASE("sharded output over MPI: each rank's shard holds the replicated means, gather_shards completes them") {
  // Buckets of 4 KiB: many buckets, each a run of every rank's shard; absent variables hold no
  // element of the flat range (and no parameter of the gather: a null slot).
  const world<float> w({1, 7, 33, 1000, 5, 4097, 2}, {false, false, true, false, false, false, true}, layout(true), 31);
  auto replicated = w.outputs();
  gradavg::mpi::options opts;
  opts.exchange.fusion_bytes = 4096;
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), replicated, opts);
  require_reference(w, replicated, false);
  for (exchange how : {exchange::point_to_point, exchange::collectives})
    for (auto format : {gradavg::compression::none, gradavg::compression::bfloat16}) {
      INFO("collectives " << (how == exchange::collectives) << ", gather's compression " << static_cast<int>(format));
      auto sharded = w.outputs();
      opts.exchange.method = how;
      opts.exchange.output = gradavg::output_mode::sharded;
      opts.exchange.compression = gradavg::compression::none;
      const gradavg::summary s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), sharded, opts);
      const std::size_t total = 1 + 7 + 1000 + 5 + 4097;
      const auto p = static_cast<std::size_t>(world_size()), r = static_cast<std::size_t>(world_rank());
      CHECK(s.shard.begin == total * r / p);
      CHECK(s.shard.end == total * (r + 1) / p);
      std::size_t at = 0, bad = 0;
      std::vector<std::vector<float>*> parameters;
      for (std::size_t i = 0; i < w.sizes.size(); ++i) {
        parameters.push_back(w.absent[i] ? nullptr : &sharded[i]);
        if (w.absent[i]) {
          bad += sharded[i][0] != -1234.5f ? 1 : 0;
          continue;
        }
        for (std::size_t j = 0; j < w.sizes[i]; ++j, ++at) {
          const float want = at >= s.shard.begin && at < s.shard.end ? replicated[i][j] : -1234.5f;
          bad += std::bit_cast<std::uint32_t>(sharded[i][j]) != std::bit_cast<std::uint32_t>(want) ? 1 : 0;
        }
      }
      CHECK(bad == 0);
      gradavg::mpi::options gather;
      gather.exchange.method = how;
      gather.exchange.compression = format;
      gather.exchange.fusion_bytes = 4096;
      gradavg::mpi::gather_shards(MPI_COMM_WORLD, parameters, gather);
      CHECK(same_on_every_rank(hash_of(sharded)));
      std::size_t off = 0;
      for (std::size_t i = 0; i < w.sizes.size(); ++i)
        for (std::size_t j = 0; j < (w.absent[i] ? 1 : w.sizes[i]); ++j) {
          const float want = w.absent[i] ? -1234.5f
                             : format == gradavg::compression::none ? replicated[i][j]
                                                                     : static_cast<float>(bfloat16(replicated[i][j]));
          off += std::bit_cast<std::uint32_t>(sharded[i][j]) != std::bit_cast<std::uint32_t>(want) ? 1 : 0;
        }
      CHECK(off == 0);
    }
}

TEMPLATE_TEST_CASE("16-bit gradients into 16-bit and into float outputs", "", half, bfloat16) {
  using S = TestType;
  const world<S> w({3, 129, 1000}, {false, false, false}, layout(true), 5);
  const auto local = w.local();
  auto means = w.outputs();
  auto sq = w.outputs();
  gradavg::mpi::options opts;
  opts.exchange.fusion_bytes = 4 * 53;
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, means, sq, opts);
  require_reference(w, means, false);
  require_reference(w, sq, true);
  CHECK(same_on_every_rank(hash_of(means)));

  auto wide = w.template outputs<float>();
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, wide, opts);
  require_reference(w, wide, false);
  CHECK(same_on_every_rank(hash_of(wide)));

  const world<S> one({3, 129, 1000}, {false, false, false}, layout(false), 6);
  auto m1 = one.outputs();
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, one.local(), m1, opts);
  auto m1_ref = one.outputs();
  gradavg::average_gradients_into(one.all(), m1_ref);
  CHECK(hash_of(m1) == hash_of(m1_ref));
}

TEST_CASE("threads inside each rank (options.run.threads = 2) give the same bits and the same non-finite report") {
  // Buckets large enough to be split between threads (at least 1 MiB of traffic per chunk), a
  // NaN in a variable that two chunks share.
  world<float> w({300'000, 5, 400'000}, {false, false, false}, layout(true), 17);
  const std::size_t last = w.total_towers() - 1;
  w.data[last][2][200'000] = std::numeric_limits<float>::quiet_NaN();
  const auto local = w.local();
  gradavg::mpi::options opts;
  opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
  opts.compute.statistics = true;
  auto one = w.outputs();
  auto one_sq = w.outputs();
  const auto s1 = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, one, one_sq, opts);
  opts.run.threads = 2;
  auto two = w.outputs();
  auto two_sq = w.outputs();
  const auto s2 = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, two, two_sq, opts);
  CHECK(hash_of(one) == hash_of(two));
  CHECK(hash_of(one_sq) == hash_of(two_sq));
  CHECK(s1.nonfinite_variables == 1);
  CHECK(s2.nonfinite_variables == 1);
  CHECK(std::isnan(two[2][200'000]));
  CHECK(std::isnan(s2.sum_mean_squared));
  require_reference(w, two, false, 2);  // variable 2 holds the NaN
}

TEMPLATE_TEST_CASE("store_policy::streaming: the same bits as ordinary stores, NaNs included", "", float, double) {
  // Sizes around packet widths and buckets that start mid-variable: unaligned heads, packets and
  // tails of the unpacking loop. A NaN and an infinity in the packet part of variable 2.
  world<TestType> w({1, 15, 1000, 33, 4097}, {false, false, false, true, false}, layout(true), 21);
  w.data[0][2][100] = std::numeric_limits<TestType>::quiet_NaN();
  w.data[w.total_towers() - 1][2][300] = std::numeric_limits<TestType>::infinity();
  const auto local = w.local();
  for (std::size_t fusion_bytes : {std::size_t{8 * 37}, std::size_t{0}}) {
    INFO("fusion_bytes " << fusion_bytes);
    gradavg::mpi::options opts;
    opts.exchange.fusion_bytes = fusion_bytes;
    auto plain = w.template outputs<TestType>();
    auto plain_sq = w.template outputs<TestType>();
    gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, plain, plain_sq, opts);
    opts.run.stores = gradavg::store_policy::streaming;
    auto streamed = w.template outputs<TestType>();
    auto streamed_sq = w.template outputs<TestType>();
    gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, streamed, streamed_sq, opts);
    CHECK(hash_of(streamed) == hash_of(plain));
    CHECK(hash_of(streamed_sq) == hash_of(plain_sq));
    CHECK(std::isnan(streamed[2][100]));
    CHECK(std::isinf(streamed[2][300]));
    for (TestType x : streamed[3]) CHECK(x == TestType(-1234.5f));  // skipped: untouched
    require_reference(w, streamed, false, 2);
  }
}

TEST_CASE("in place into tower 0's gradients") {
  world<float> w({17, 300, 64}, {false, false, false}, layout(true, 2), 3);
  const auto expect = w.expected(1, false);
  const auto scale = w.scale_of(1, false);
  const std::size_t first = w.first_tower(static_cast<std::size_t>(world_rank()));
  towers_t<float> local = w.local();
  std::vector<std::vector<float>*> means;
  for (std::size_t i = 0; i < w.sizes.size(); ++i) means.push_back(&w.data[first][i]);
  auto copy = w.outputs();
  gradavg::mpi::options opts;
  opts.exchange.fusion_bytes = 4 * 13;
  // The expected bits: the same call into separate outputs, on an untouched copy of the towers.
  const world<float> fresh({17, 300, 64}, {false, false, false}, layout(true, 2), 3);
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, fresh.local(), copy, opts);
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, means, opts);
  for (std::size_t i = 0; i < w.sizes.size(); ++i) CHECK(same_bits(w.data[first][i].data(), copy[i].data(), w.sizes[i]));
  CHECK(std::abs(w.data[first][1][5] - expect[5]) <= tolerance<float>(w.total_towers()) * scale[5]);
}

TEST_CASE("zero variables, and no elements in the range") {
  const world<float> w({}, {}, layout(true), 1);
  std::vector<std::vector<float>> none;
  const auto s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), none);
  CHECK(s.averaged == 0);
  CHECK(s.skipped == 0);
  CHECK(s.towers == w.total_towers());

  const world<float> v({5, 6}, {false, false}, layout(true), 2);
  auto out = v.outputs();
  gradavg::mpi::options opts;
  opts.compute.range = {3, 3};
  const auto r = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, v.local(), out, opts);
  CHECK(r.averaged == 0);
  for (const auto& o : out)
    for (float x : o) CHECK(x == -1234.5f);
}

TEST_CASE("a partial range writes exactly the elements of one process's call with that range") {
  const world<float> w({10, 1, 25, 7}, {false, true, false, false}, layout(false), 9);
  auto out = w.outputs();
  auto want = w.outputs();
  gradavg::mpi::options opts;
  opts.compute.range = {4, 29};
  opts.exchange.fusion_bytes = 4 * 5;
  const auto s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), out, opts);
  gradavg::options one;
  one.compute.range = opts.compute.range;
  const auto s1 = gradavg::average_gradients_into(w.all(), want, one);
  CHECK(hash_of(out) == hash_of(want));
  CHECK(s.averaged == s1.averaged);
}

TEST_CASE("weights, scale, non-finite detection and statistics: the one-process meaning over all towers") {
  world<float> w({50, 7, 300}, {false, false, false}, layout(true), 21);
  const std::size_t rank = static_cast<std::size_t>(world_rank());
  const std::size_t total = w.total_towers();
  std::vector<double> all_weights(total);
  // Towers 2 and 5 (ranks 1 and 2, each beside a tower of positive weight) weigh 0: they hold no
  // sample of the noise estimate.
  for (std::size_t k = 0; k < total; ++k) all_weights[k] = k == 2 || k == 5 ? 0.0 : 0.5 + static_cast<double>(k % 4);
  const auto weighted = static_cast<std::size_t>(std::count_if(all_weights.begin(), all_weights.end(),
                                                               [](double x) { return x > 0; }));
  const std::size_t first = w.first_tower(rank);
  const std::vector<double> mine(all_weights.begin() + static_cast<std::ptrdiff_t>(first),
                                 all_weights.begin() + static_cast<std::ptrdiff_t>(first + w.towers_of[rank]));
  // A NaN on the last rank's last tower, variable 1.
  w.data[total - 1][1][3] = std::numeric_limits<float>::quiet_NaN();

  for (auto policy : {gradavg::nonfinite_policy::report, gradavg::nonfinite_policy::zero}) {
    auto means = w.outputs();
    auto sq = w.outputs();
    std::vector<gradavg::variable_statistics> per(3);
    gradavg::mpi::options opts;
    opts.compute.weights = mine;
    opts.compute.scale = 0.25;
    opts.compute.on_nonfinite = policy;
    opts.compute.statistics = true;
    opts.compute.per_variable = per;
    opts.exchange.fusion_bytes = 8 * 11;
    const auto s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), means, sq, opts);

    auto m1 = w.outputs();
    auto q1 = w.outputs();
    std::vector<gradavg::variable_statistics> per1(3);
    gradavg::options one;
    one.compute.weights = all_weights;
    one.compute.scale = 0.25;
    one.compute.on_nonfinite = policy;
    one.compute.statistics = true;
    one.compute.per_variable = per1;
    const auto s1 = gradavg::average_gradients_into(w.all(), m1, q1, one);

    CHECK(s.nonfinite_variables == 1);
    CHECK(s.nonfinite_variables == s1.nonfinite_variables);
    CHECK(per[1].nonfinite);
    CHECK_FALSE(per[0].nonfinite);
    CHECK(s.towers == total);
    CHECK(s.weighted_towers == weighted);
    CHECK(s1.weighted_towers == weighted);
    const double tol = 4 * tolerance<float>(total);
    for (std::size_t i : {std::size_t{0}, std::size_t{2}}) {
      for (std::size_t j = 0; j < w.sizes[i]; ++j) {
        CHECK(std::abs(means[i][j] - m1[i][j]) <= tol * (std::abs(m1[i][j]) + 0.25f));
        CHECK(std::abs(sq[i][j] - q1[i][j]) <= tol * (std::abs(q1[i][j]) + 0.0625f));
      }
      CHECK(per[i].sum_mean_squared == Approx(per1[i].sum_mean_squared).epsilon(1e-5));
      CHECK(per[i].sum_mean_of_squares == Approx(per1[i].sum_mean_of_squares).epsilon(1e-5));
    }
    if (policy == gradavg::nonfinite_policy::zero) {
      for (float x : means[1]) CHECK((x == 0 && !std::signbit(x)));
      CHECK(s.sum_mean_squared == Approx(s1.sum_mean_squared).epsilon(1e-5));
      CHECK(s.global_norm() > 0);
    } else {
      CHECK(std::isnan(means[1][3]));
      CHECK(std::isnan(s.sum_mean_squared));
    }
    CHECK(same_on_every_rank(hash_of(means) ^ hash_of(sq)));
  }
}

/// One process's bits across processes: every quantity of a call over w's towers spread over
/// the ranks (rank 0 any tower count, every other rank one tower: the same additions in the same
/// order) against the one-process call over all of them, bit for bit — the means, the squares,
/// every per-variable sum and the summary's sums — for each fusion size (the same bits for
/// every bucket size).
template <class S>
void check_statistics_bits(const world<S>& w, gradavg::mpi::options opts) {
  const std::size_t variables = w.sizes.size();
  gradavg::options one = opts.local();
  auto m1 = w.outputs(), q1 = w.outputs();
  std::vector<gradavg::variable_statistics> per1(variables);
  one.compute.per_variable = per1;
  std::vector<double> all_weights;
  if (!opts.compute.weights.empty()) {
    // Every rank's weights, gathered in rank order (each rank passes its own towers' weights).
    all_weights.resize(w.total_towers());
    std::vector<int> counts, displs;
    for (std::size_t r = 0; r < w.towers_of.size(); ++r) {
      counts.push_back(static_cast<int>(w.towers_of[r]));
      displs.push_back(static_cast<int>(w.first_tower(r)));
    }
    MPI_Allgatherv(opts.compute.weights.data(), static_cast<int>(opts.compute.weights.size()), MPI_DOUBLE,
                   all_weights.data(), counts.data(), displs.data(), MPI_DOUBLE, MPI_COMM_WORLD);
    one.compute.weights = all_weights;
  }
  const gradavg::summary s1 = gradavg::average_gradients_into(w.all(), m1, q1, one);
  for (std::size_t fusion_bytes : {std::size_t{8 * 37}, std::size_t{64} << 10, std::size_t{1} << 20,
                                   std::size_t{16} << 20}) {
    INFO("fusion_bytes " << fusion_bytes);
    auto m = w.outputs(), q = w.outputs();
    std::vector<gradavg::variable_statistics> per(variables);
    opts.compute.per_variable = per;
    opts.exchange.fusion_bytes = fusion_bytes;
    const gradavg::summary s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), m, q, opts);
    CHECK(hash_of(m) == hash_of(m1));
    CHECK(hash_of(q) == hash_of(q1));
    CHECK(std::bit_cast<std::uint64_t>(s.sum_mean_squared) == std::bit_cast<std::uint64_t>(s1.sum_mean_squared));
    CHECK(std::bit_cast<std::uint64_t>(s.sum_mean_of_squares) ==
          std::bit_cast<std::uint64_t>(s1.sum_mean_of_squares));
    CHECK(s.nonfinite_variables == s1.nonfinite_variables);
    if (std::isfinite(s1.sum_mean_squared)) CHECK(s.global_norm() == s1.global_norm());
    for (std::size_t i = 0; i < variables; ++i) {
      INFO("variable " << i);
      CHECK(std::bit_cast<std::uint64_t>(per[i].sum_mean_squared) ==
            std::bit_cast<std::uint64_t>(per1[i].sum_mean_squared));
      CHECK(std::bit_cast<std::uint64_t>(per[i].sum_mean_of_squares) ==
            std::bit_cast<std::uint64_t>(per1[i].sum_mean_of_squares));
      CHECK(per[i].nonfinite == per1[i].nonfinite);
    }
  }
}

/// Sizes of 60 variables: around the statistics' blocks (8, 16), a segment (1,024 floats, 512
/// doubles) and more, with one large enough that the segments grow past the split granularity.
std::vector<std::size_t> statistics_sizes() {
  std::vector<std::size_t> sizes;
  for (std::size_t i = 0; i < 60; ++i) sizes.push_back(1 + (i * i * 37) % 3000);
  sizes[7] = 16;
  sizes[8] = 8;
  sizes[9] = 1;
  sizes[30] = 400'000;
  return sizes;
}

TEMPLATE_TEST_CASE("statistics across processes are one process's bits where the towers' order can match", "",
                   float, double, half, bfloat16) {
  const std::size_t ranks = static_cast<std::size_t>(world_size());
  std::vector<std::size_t> towers(ranks, 1);
  const auto sizes = statistics_sizes();
  std::vector<bool> absent(sizes.size(), false);
  absent[3] = absent[41] = true;
  for (std::size_t rank0 : {1u, 3u}) {
    INFO("rank 0 holds " << rank0 << " towers, every other rank one");
    towers[0] = rank0;
    const world<TestType> w(sizes, absent, towers, 61);
    gradavg::mpi::options opts;
    opts.compute.statistics = true;
    check_statistics_bits(w, opts);
    // The fused step: weights, a scale, detection, and a range that begins and ends mid-variable.
    const std::size_t rank = static_cast<std::size_t>(world_rank());
    std::vector<double> weights(w.towers_of[rank]);
    for (std::size_t k = 0; k < weights.size(); ++k) weights[k] = 0.5 + static_cast<double>((w.first_tower(rank) + k) % 3);
    opts.compute.weights = weights;
    opts.compute.scale = 0.125;
    opts.compute.on_nonfinite = gradavg::nonfinite_policy::report;
    check_statistics_bits(w, opts);
    opts.compute.range = {1000, 420'000};
    check_statistics_bits(w, opts);
  }
  // A non-finite input zeroed by the policy: the same zeros and the same sums without it.
  towers[0] = 1;
  world<TestType> w(sizes, absent, towers, 67);
  w.data[w.total_towers() - 1][30][123'456] = std::numeric_limits<TestType>::infinity();
  gradavg::mpi::options zero;
  zero.compute.statistics = true;
  zero.compute.on_nonfinite = gradavg::nonfinite_policy::zero;
  check_statistics_bits(w, zero);
}

TEST_CASE("the allocating API: the same bits as average_gradients_into, skipped variables listed") {
  const world<double> w({9, 4, 100}, {false, true, false}, layout(true), 4);
  const auto r = gradavg::mpi::average_gradients(MPI_COMM_WORLD, w.local(), gradavg::include_square);
  gradavg_test::check_x87_after("gradavg::mpi::average_gradients with a skipped variable");
  REQUIRE(r.gradients.size() == 2);
  REQUIRE(r.squares.size() == 2);
  REQUIRE(r.skipped.size() == 1);
  CHECK(r.skipped[0].index == 1);
  CHECK(r.skipped[0].variable == "v1");
  CHECK(r.gradients[1].second == "v2");
  auto means = w.outputs();
  auto sq = w.outputs();
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), means, sq);
  CHECK(same_bits(r.gradients[0].first.data(), means[0].data(), 9));
  CHECK(same_bits(r.gradients[1].first.data(), means[2].data(), 100));
  CHECK(same_bits(r.squares[1].first.data(), sq[2].data(), 100));
}

// ---- Failures on one rank only. ----

/// "rank 0", "ranks 0 and 2", "ranks 0, 2 and 3": every rank but rank 1, as messages list them.
std::string all_but_rank_1() {
  std::string list = world_size() > 2 ? "ranks 0" : "rank 0";
  for (int r = 2; r < world_size(); ++r) list += (r + 1 == world_size() ? " and " : ", ") + std::to_string(r);
  return list;
}

/// Runs the call on every rank with the local towers of `local` and requires every rank to throw
/// E (the failing rank F when given), outputs untouched. Returns this rank's message.
template <class E, class F = E>
std::string every_rank_throws(const towers_t<float>& local, std::vector<std::vector<float>>& out, int failing,
                              const gradavg::mpi::options& opts = {}) {
  const auto before = hash_of(out);
  std::string message;
  if (world_rank() == failing)
    message = exception_of<F>([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, opts); }).what();
  else
    message = exception_of<E>([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, opts); }).what();
  CHECK(hash_of(out) == before);
  // Everyone is still in step: a collective after the error completes.
  CHECK(same_on_every_rank(42));
  return message;
}

TEST_CASE("weights: one rank's may sum to 0 (its towers count for nothing); 0 over every rank: weight_error") {
  const world<float> w({40, 3}, {false, false}, layout(true), 13);
  const std::size_t rank = static_cast<std::size_t>(world_rank());
  const std::size_t total = w.total_towers();
  const std::size_t first1 = w.first_tower(1), end1 = first1 + w.towers_of[1];
  std::vector<double> all(total);  // every tower of rank 1 weighs 0
  for (std::size_t k = 0; k < total; ++k) all[k] = k >= first1 && k < end1 ? 0.0 : 1.0 + static_cast<double>(k % 3);
  const std::vector<double> mine(all.begin() + static_cast<std::ptrdiff_t>(w.first_tower(rank)),
                                 all.begin() + static_cast<std::ptrdiff_t>(w.first_tower(rank) + w.towers_of[rank]));
  gradavg::mpi::options opts;
  opts.compute.weights = mine;
  auto out = w.outputs();
  const auto s = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, w.local(), out, opts);
  CHECK(s.towers == total);
  CHECK(s.weighted_towers == total - w.towers_of[1]);
  // The weighted mean in double over the towers of positive weight, summed here.
  const double weight_sum = std::accumulate(all.begin(), all.end(), 0.0);
  for (std::size_t i = 0; i < w.sizes.size(); ++i)
    for (std::size_t j = 0; j < w.sizes[i]; ++j) {
      double want = 0;
      for (std::size_t k = 0; k < total; ++k) want += all[k] * static_cast<double>(w.data[k][i][j]);
      want /= weight_sum;
      CHECK(std::abs(out[i][j] - want) <= 4 * tolerance<float>(total) * (std::abs(want) + 1));
    }
  CHECK(same_on_every_rank(hash_of(out)));

  const std::vector<double> zeros(w.towers_of[rank], 0.0);
  gradavg::mpi::options none;
  none.compute.weights = zeros;
  const std::string m = every_rank_throws<gradavg::weight_error>(w.local(), out, 0, none);
  CHECK(contains(m, "options.compute.weights sum to 0 over the towers of every rank"));
}

// ---- Plans across processes. ----

/// New values in the same buffers, as a training loop's backward pass writes them.
template <class S>
void next_step(world<S>& w, int step) {
  for (std::size_t k = 0; k < w.data.size(); ++k)
    for (std::size_t i = 0; i < w.data[k].size(); ++i)
      for (std::size_t j = 0; j < w.data[k][i].size(); ++j)
        w.data[k][i][j] = static_cast<S>(static_cast<float>((j * 13 + k * 7 + i + static_cast<std::size_t>(step) * 3) % 29) / 29.0f - 0.5f);
}

TEST_CASE("with a plan, each step after the first runs no agreement collective, and gives the bits of a call without") {
  world<float> w({1, 7, 33, 1000, 5, 4097, 2}, {false, false, true, false, false, false, true}, layout(true), 31);
  const std::size_t rank = static_cast<std::size_t>(world_rank());
  const auto local = w.local();
  auto means = w.outputs(), sq = w.outputs();
  std::vector<double> weights(w.towers_of[rank], 1.5);
  gradavg::plan step;
  for (int s = 0; s < 5; ++s) {
    INFO("step " << s);
    next_step(w, s);
    gradavg::mpi::options opts;
    opts.exchange.fusion_bytes = 4 * 500;  // several buckets
    if (s >= 3) {  // weights from step 3 on: their sums are gathered every step
      weights[0] = 1.0 + s;
      opts.compute.weights = weights;
    }
    gradavg::summary planned;
    const auto counts =
        collectives_of([&] { planned = gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, means, sq, opts); });
    // Collective 1 and collective 4 every step; collectives 2 and 3 on the first, and the
    // headers gathered again (collective 2) on every step that passes weights.
    if (s == 0 || s == 3) {
      CHECK(counts == std::pair<int, int>{s == 0 ? 3 : 2, 1});
    } else {
      CHECK(counts == std::pair<int, int>{2, s > 3 ? 1 : 0});
    }
    auto other = w.outputs(), other_sq = w.outputs();
    const auto plain = gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, other, other_sq, opts);
    CHECK(hash_of(means) == hash_of(other));
    CHECK(hash_of(sq) == hash_of(other_sq));
    CHECK(planned.averaged == plain.averaged);
    CHECK(planned.skipped == plain.skipped);
    CHECK(planned.towers == w.total_towers());
    if (s < 3) {
      require_reference(w, means, false);
      require_reference(w, sq, true);
    }
    CHECK(same_on_every_rank(hash_of(means) ^ hash_of(sq)));
  }
  CHECK(step.proofs() == 1);
}

TEST_CASE("with plans, one rank's changed buffer makes every rank agree again, and the results follow it") {
  world<float> w({3, 40, 9}, {false, false, false}, layout(false, 2), 32);
  auto local = w.local();
  auto means = w.outputs();
  gradavg::plan step;
  gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, means);
  const int last = world_size() - 1;
  std::vector<float> moved(40, 0.25f);
  // Every rank's copy of the world learns the values; the last rank reads them from a new buffer.
  w.data[w.first_tower(static_cast<std::size_t>(last)) + 1][1] = moved;
  if (world_rank() == last) local[1][1].first = &moved;
  const auto counts = collectives_of([&] { gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, means); });
  CHECK(counts == std::pair<int, int>{3, 1});
  require_reference(w, means, false);
  CHECK(same_on_every_rank(hash_of(means)));
  CHECK(step.proofs() == (world_rank() == last ? 2u : 1u));
  const auto again = collectives_of([&] { gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, means); });
  CHECK(again == std::pair<int, int>{2, 0});
}

TEST_CASE("with plans, a gradient gone on one rank: missing_gradient_error on every rank, nothing written, no hang") {
  const world<float> w({5, 6, 7}, {false, false, false}, layout(true), 33);
  auto local = w.local();
  auto out = w.outputs();
  gradavg::plan step;
  gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, out);
  gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, out);
  const auto kept = hash_of(out);
  const int last = world_size() - 1;
  // Absent on one tower of the last rank, then on all of them (the other ranks' plans hold: their
  // own presence is still compared with the last rank's).
  for (const bool every_tower : {false, true}) {
    if (world_rank() == last)
      for (std::size_t k = 0; k < (every_tower ? local.size() : 1); ++k) local[k][1].first = nullptr;
    try {
      gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, out);
      FAIL("did not throw");
    } catch (const gradavg::missing_gradient_error& e) {
      CHECK(contains(e.what(), "variable #1 'v1'"));
    }
    CHECK(hash_of(out) == kept);
  }
  // Back in place: every rank agrees again, and the plans hold from then on.
  if (world_rank() == last)
    for (std::size_t k = 0; k < local.size(); ++k)
      local[k][1].first = &w.data[w.first_tower(static_cast<std::size_t>(last)) + k][1];
  CHECK(collectives_of([&] { gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, out); }) ==
        std::pair<int, int>{3, 1});
  CHECK(collectives_of([&] { gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, out); }) ==
        std::pair<int, int>{2, 0});
  require_reference(w, out, false);
}

TEST_CASE("with plans: a rank without one means every collective; a new scale, or weights on one rank, the headers") {
  const world<double> w({17, 300}, {false, false}, layout(true), 34);
  const auto local = w.local();
  auto out = w.outputs();
  gradavg::plan step;
  const bool with_plan = world_rank() != 0;
  auto call = [&](const gradavg::mpi::options& opts) {
    return collectives_of([&] {
      if (with_plan) gradavg::mpi::average_gradients_into(step, MPI_COMM_WORLD, local, out, opts);
      else gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, opts);
    });
  };
  for (int s = 0; s < 3; ++s) CHECK(call({}) == std::pair<int, int>{3, 1});
  require_reference(w, out, false);
  // Every rank with a plan now. A new scale on every rank: the headers are gathered again that
  // step (the agreement on the variables stands), and agreed from then on.
  gradavg::plan all_ranks;
  const std::vector<double> unit(w.towers_of[static_cast<std::size_t>(world_rank())], 1.0);
  auto planned = [&](double scale, bool weights_on_rank_0) {
    gradavg::mpi::options opts;
    opts.compute.scale = scale;
    if (weights_on_rank_0 && world_rank() == 0) opts.compute.weights = unit;
    return collectives_of([&] { gradavg::mpi::average_gradients_into(all_ranks, MPI_COMM_WORLD, local, out, opts); });
  };
  CHECK(planned(1.0, false) == std::pair<int, int>{3, 1});
  CHECK(planned(1.0, false) == std::pair<int, int>{2, 0});
  CHECK(planned(0.5, false) == std::pair<int, int>{2, 1});
  CHECK(planned(0.5, false) == std::pair<int, int>{2, 0});
  for (std::size_t i = 0; i < w.sizes.size(); ++i) {
    const auto want = w.expected(i, false);
    for (std::size_t j = 0; j < want.size(); ++j) CHECK(out[i][j] == Approx(0.5 * want[j]).margin(1e-12));
  }
  // Weights on rank 0 only (unit weights: the same means): every rank gathers the headers with it.
  for (int s = 0; s < 2; ++s) CHECK(planned(0.5, true) == std::pair<int, int>{2, 1});
  for (std::size_t i = 0; i < w.sizes.size(); ++i) {
    const auto want = w.expected(i, false);
    for (std::size_t j = 0; j < want.size(); ++j) CHECK(out[i][j] == Approx(0.5 * want[j]).margin(1e-12));
  }
  CHECK(all_ranks.proofs() == 1);
}

TEST_CASE("one read of each gradient per call: its checks give the agreement its presence and shape") {
  // Rank r's tower k holds r * T + k + i in every element of variable i: every sum is exact, so
  // each mean is the exact mean rounded once.
  const std::size_t towers = 3, variables = 5, n = 7;
  const auto rank = static_cast<std::size_t>(world_rank()), ranks = static_cast<std::size_t>(world_size());
  std::size_t reads = 0;
  std::vector<std::vector<gradavg_test::counted_vector>> grads(towers);
  std::vector<std::vector<std::pair<const gradavg_test::counted_vector*, std::string>>> tg(towers);
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i)
      grads[k].push_back({std::vector<float>(n, static_cast<float>(rank * towers + k + i)), &reads});
  for (std::size_t k = 0; k < towers; ++k)
    for (std::size_t i = 0; i < variables; ++i) tg[k].push_back({&grads[k][i], "v" + std::to_string(i)});
  std::vector<std::vector<float>> means(variables, std::vector<float>(n, -1.0f));

  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, means);
  CHECK(reads == towers * variables);
  const double all = static_cast<double>(ranks * towers);
  for (std::size_t i = 0; i < variables; ++i) {
    const double want = (all - 1) / 2 + static_cast<double>(i);
    for (float x : means[i]) CHECK(x == static_cast<float>(want));
  }
}

TEST_CASE("a gradient missing on one tower of the last rank: missing_gradient_error on every rank") {
  const world<float> w({5, 6, 7}, {false, false, false}, layout(true), 8);
  const int last = world_size() - 1;
  auto local = w.local();
  if (world_rank() == last) local[0][1].first = nullptr;
  auto out = w.outputs();
  const std::string m = every_rank_throws<gradavg::missing_gradient_error>(local, out, last);
  CHECK(contains(m, "variable #1 'v1'"));
  CHECK(contains(m, "rank " + std::to_string(last) + " (tower 0 of"));
}

TEST_CASE("a gradient absent on every tower of one rank only: missing_gradient_error on every rank") {
  const world<float> w({5, 6, 7}, {false, false, false}, layout(true), 8);
  auto local = w.local();
  if (world_rank() == 1)
    for (auto& t : local) t[2].first = nullptr;
  auto out = w.outputs();
  const std::string m = every_rank_throws<gradavg::missing_gradient_error>(local, out, 1);
  CHECK(contains(m, "variable #2 'v2'"));
  CHECK(contains(m, "rank 1 (tower"));
}

TEST_CASE("a different shape on one rank: shape_error on every rank naming it") {
  world<float> w({5, 6, 7}, {false, false, false}, layout(true), 8);
  std::vector<float> longer(9, 1.0f);
  auto local = w.local();
  if (world_rank() == 1)
    for (auto& t : local) t[1].first = &longer;
  auto out = w.outputs();
  if (world_rank() == 1) out[1].resize(9, -1234.5f);
  const std::string m = every_rank_throws<gradavg::shape_error>(local, out, 1);
  CHECK(contains(m, "variable #1 'v1'"));
  CHECK(contains(m, "[9] on rank 1 but shape [6] on " + all_but_rank_1()));
}

TEST_CASE("a different variable count on one rank: tower_error on every rank naming it") {
  const world<float> w({5, 6, 7}, {false, false, false}, layout(true), 8);
  auto local = w.local();
  auto out = w.outputs();
  if (world_rank() == 1) {
    for (auto& t : local) t.pop_back();
    out.pop_back();
  }
  const std::string m = every_rank_throws<gradavg::tower_error>(local, out, 1);
  CHECK(contains(m, "rank 1 holds 2 variables but " + all_but_rank_1() + (world_size() > 2 ? " hold 3" : " holds 3")));
}

TEST_CASE("a different variable order on one rank: variable_mismatch_error on every rank") {
  const world<float> w({5, 5, 7}, {false, false, false}, layout(true), 8);
  auto local = w.local();
  if (world_rank() == 1)
    for (auto& t : local) std::swap(t[0], t[1]);
  auto out = w.outputs();
  const std::string m = every_rank_throws<gradavg::variable_mismatch_error>(local, out, 1);
  CHECK(contains(m, "variable #0"));
  CHECK(contains(m, "rank 1 has a different variable at this position than " +
                    all_but_rank_1()));
}

TEST_CASE("a local validation error on one rank: its own error there, remote_error naming it elsewhere") {
  const world<float> w({5, 6, 7}, {false, false, false}, layout(true), 8);
  const auto local = w.local();
  auto out = w.outputs();
  const int last = world_size() - 1;
  if (world_rank() == last) out[2].resize(3);  // the means output of variable 2 has the wrong size
  const std::string m = every_rank_throws<gradavg::remote_error, gradavg::output_error>(local, out, last);
  if (world_rank() == last) {
    CHECK(contains(m, "variable #2 'v2'"));
  } else {
    CHECK(contains(m, "rank " + std::to_string(last)));
    CHECK(contains(m, "variable #2"));
  }
}

/// An executor whose parallel_for throws without running a task (the contract allows it).
struct failing_executor : gradavg::executor {
  std::size_t concurrency() const noexcept override { return 2; }
  void parallel_for(std::size_t, gradavg::task_ref) override { throw std::runtime_error("the executor is down"); }
};

TEST_CASE("an exception from one rank's executor while averaging: its own there, remote_error elsewhere, no hang") {
  // Variable 1 fills each bucket with enough bytes for two chunks, so the failing rank's kernel
  // goes through its executor, after validation, with buckets in flight on every rank.
  const world<float> w({5, 600000, 7}, {false, false, false}, layout(true), 9);
  const auto local = w.local();
  const int failing = world_size() - 1;
  const exchange how = GENERATE(exchange::point_to_point, exchange::collectives);
  // And with a compressed exchange: the failing rank's zeros are encoded like any contribution.
  const auto format = GENERATE(gradavg::compression::none, gradavg::compression::float16, gradavg::compression::int8);
  // And with sharded output: no gather, the owners keep the sums.
  const auto output = GENERATE(gradavg::output_mode::replicated, gradavg::output_mode::sharded);
  INFO("collectives " << (how == exchange::collectives) << ", compression " << static_cast<int>(format) << ", output "
                      << static_cast<int>(output));
  failing_executor down;
  gradavg::mpi::workspace work;
  gradavg::mpi::options opts;
  opts.exchange.method = how;
  opts.exchange.compression = format;
  opts.exchange.output = output;
  // Three buckets, the first of two chunks: the failure comes first; sharded, each rank's slot of
  // a bucket as large (a slot is 1 / P of its bucket).
  opts.exchange.fusion_bytes = std::size_t{1} << 20;
  if (output == gradavg::output_mode::sharded) opts.exchange.fusion_bytes *= static_cast<std::size_t>(world_size());
  opts.exchange.work = &work;
  if (world_rank() == failing) {
    opts.run.threads = 2;
    opts.run.pool = &down;
  }
  auto out = w.outputs();
  auto call = [&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, opts); };
  if (world_rank() == failing) {
    CHECK(std::string(exception_of<std::runtime_error>(call).what()) == "the executor is down");
  } else {
    const std::string m = exception_of<gradavg::remote_error>(call).what();
    CHECK(contains(m, "rank " + std::to_string(failing) + " failed while averaging"));
    CHECK(contains(m, "partly written"));
  }
  CHECK(same_on_every_rank(42));  // every rank left the call in step

  // The same workspace afterwards: the right results.
  opts.run.pool = nullptr;
  opts.run.threads = 1;
  auto again = w.outputs();
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, again, opts);
  if (output == gradavg::output_mode::sharded) {
    gradavg::mpi::options gather;
    gather.exchange.method = how;
    gradavg::mpi::gather_shards(MPI_COMM_WORLD, again, gather);  // every rank's shard, raw
  }
  if (format == gradavg::compression::none) require_reference(w, again, false);
  CHECK(same_on_every_rank(hash_of(again)));
}

TEST_CASE("options that differ on one rank: option_error on every rank; bad weights there: its own error") {
  const world<float> w({5, 6}, {false, false}, layout(true), 8);
  const auto local = w.local();
  auto out = w.outputs();
  gradavg::mpi::options opts;
  if (world_rank() == 1) opts.compute.scale = 2;
  const std::string m = every_rank_throws<gradavg::option_error>(local, out, 1, opts);
  CHECK(contains(m, "rank 1 passes a different options.compute.scale than rank"));

  gradavg::mpi::options how;
  if (world_rank() == 1) how.exchange.method = gradavg::mpi::exchange_method::point_to_point;
  CHECK(contains(every_rank_throws<gradavg::option_error>(local, out, 1, how),
                 "rank 1 passes a different options.exchange.method than rank"));

  // Rank 0 the odd one out: named as such where the others agree (3 ranks or more).
  gradavg::mpi::options odd_first;
  if (world_rank() == 0) odd_first.compute.scale = 2;
  const std::string first = every_rank_throws<gradavg::option_error>(local, out, 0, odd_first);
  CHECK(contains(first, world_size() > 2 ? "rank 0 passes a different options.compute.scale than ranks 1"
                                         : "rank 1 passes a different options.compute.scale than rank 0"));

  gradavg::mpi::options bad;
  std::vector<double> weights(w.towers_of[static_cast<std::size_t>(world_rank())] + 1, 1.0);
  if (world_rank() == 0) bad.compute.weights = weights;  // one too many
  every_rank_throws<gradavg::remote_error, gradavg::weight_error>(local, out, 0, bad);
}

TEST_CASE("an option that is none of its enumeration's values, weights in an output: that rank's error, remote_error elsewhere") {
  const world<double> w({5, 6}, {false, false}, layout(true), 8);
  const auto local = w.local();
  const std::size_t rank = static_cast<std::size_t>(world_rank());
  auto out = w.outputs();
  const auto before = hash_of(out);
  // Rank 1 alone passes a value no enumerator has (each rank's own check, before the agreement).
  auto one_rank_throws = [&]<class E>(const gradavg::mpi::options& opts, const char* names) {
    if (rank == 1)
      CHECK(contains(exception_of<E>([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, opts); }).what(),
                     names));
    else
      CHECK(contains(exception_of<gradavg::remote_error>(
                         [&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, opts); })
                         .what(),
                     "rank 1"));
    CHECK(hash_of(out) == before);
    CHECK(same_on_every_rank(11));
  };
  gradavg::mpi::options method;
  if (rank == 1) method.exchange.method = static_cast<gradavg::mpi::exchange_method>(2);
  one_rank_throws.operator()<gradavg::option_error>(method, "options.exchange.method holds 2");
  gradavg::mpi::options policy;
  if (rank == 1) policy.compute.on_nonfinite = static_cast<gradavg::nonfinite_policy>(9);
  one_rank_throws.operator()<gradavg::option_error>(policy, "options.compute.on_nonfinite holds 9");
  // Rank 1's weights are the first elements of its own means output of variable 1.
  std::fill(out[1].begin(), out[1].end(), 1.0);
  const auto filled = hash_of(out);
  gradavg::mpi::options inside;
  if (rank == 1) inside.compute.weights = std::span<const double>(out[1].data(), w.towers_of[1]);
  if (rank == 1)
    CHECK(contains(exception_of<gradavg::aliasing_error>(
                       [&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, inside); })
                       .what(),
                   "variable #1 'v1': the means output overlaps options.compute.weights"));
  else
    exception_of<gradavg::remote_error>([&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, local, out, inside); });
  CHECK(hash_of(out) == filled);
  CHECK(same_on_every_rank(12));
}

TEST_CASE("the allocating API: a rank whose own call is invalid throws its error, every other rank remote_error") {
  const world<float> w({5, 6}, {false, false}, layout(true), 8);
  const auto local = w.local();
  gradavg::mpi::options opts;
  if (world_rank() == 1) opts.compute.range = {0, 3};  // a range is for average_gradients_into only
  if (world_rank() == 1) {
    const auto e = exception_of<gradavg::option_error>([&] { gradavg::mpi::average_gradients(MPI_COMM_WORLD, local, opts); });
    CHECK(contains(e.what(), "options.compute.range"));
  } else {
    const auto e = exception_of<gradavg::remote_error>([&] { gradavg::mpi::average_gradients(MPI_COMM_WORLD, local, opts); });
    CHECK(contains(e.what(), "rank 1"));
  }
  CHECK(same_on_every_rank(7));
}

}  // namespace
