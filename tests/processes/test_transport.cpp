// The seam between a call across processes and its transport (detail/processes/exchange.hpp):
// a second transport, written here in one file, runs the same call with threads as ranks. It
// moves bytes through shared memory behind a barrier, nothing else: the agreement, the data path
// and the owner_sum exchange are the library's, unchanged. Checked: the means and squares against
// the independent double reference, and bit for bit against the one-process call over the same
// towers where the towers add in the same order (one tower per rank, or any number on rank 0 and
// one on every other), the statistics too, for every bucket size; errors on one rank reach every
// rank, with nothing written.
#include <gradavg/gradavg.hpp>
#include <gradavg/detail/processes/average.hpp>

#include <Eigen/Dense>

#include <algorithm>
#include <barrier>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <span>
#include <type_traits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"
#include "support.hpp"

namespace {

using namespace gradavg_test;
namespace processes = gradavg::detail::processes;

/// The options a call across processes takes: gradavg::options' groups and the bucket size.
struct thread_options {
  gradavg::compute_options compute = {};
  gradavg::run_options run = {};
  gradavg::check_options check = {};
  struct {
    std::size_t fusion_bytes = 0;
  } exchange;
  [[nodiscard]] gradavg::options local() const noexcept { return {compute, run, check}; }
};

/// What the ranks of one world share: a barrier and, per rank, the buffer it offers in the
/// collective or move under way.
struct thread_world {
  explicit thread_world(int count) : ranks(count), sync(count), offered(static_cast<std::size_t>(count)) {}
  int ranks;
  std::barrier<> sync;
  std::vector<const void*> offered;
};

/// A transport whose ranks are threads of one process. Every operation is blocking and offers a
/// buffer, waits for every rank's, reads what it needs, and waits again (so that no buffer is
/// rewritten while another rank reads it): the ranks enter the same operations in the same order,
/// which is what the call across processes guarantees of its transport.
class thread_transport {
 public:
  using options_type = thread_options;
  static constexpr const char* caller = "gradavg::threads";

  thread_transport(thread_world& world, int rank) : world_(world), rank_(rank) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int ranks() const noexcept { return world_.ranks; }
  [[nodiscard]] std::uint64_t identity() const noexcept { return std::bit_cast<std::uintptr_t>(&world_); }
  [[nodiscard]] std::uint64_t method_code() const noexcept { return 0; }
  void check_options() const noexcept {}
  [[nodiscard]] std::size_t automatic_fusion_bytes() const noexcept { return std::size_t{1} << 20; }

  void min_words(std::uint64_t* words, std::size_t n) {
    reduce(words, words, n, [](std::uint64_t a, std::uint64_t b) { return std::min(a, b); });
  }
  void max_words(const std::uint64_t* in, std::uint64_t* words, std::size_t n) {
    reduce(in, words, n, [](std::uint64_t a, std::uint64_t b) { return std::max(a, b); });
  }
  void gather_words(const std::uint64_t* in, std::uint64_t* words, std::size_t n) {
    exchange(in, [&](int r, const void* theirs) { std::memcpy(words + r * n, theirs, n * sizeof *words); });
  }

  void reserve(std::size_t) noexcept {}
  void scatter(std::size_t, const std::byte* from, std::byte* into, const processes::slice_layout& l) {
    exchange(from, [&](int r, const void* theirs) {
      if (r != rank_)
        std::memcpy(into + l.received_at(r, rank_), static_cast<const std::byte*>(theirs) + l.at(rank_),
                    l.bytes(rank_));
    });
  }
  void gather(std::size_t, std::byte* bytes, const processes::slice_layout& l) {
    exchange(bytes, [&](int r, const void* theirs) {
      if (r != rank_) std::memcpy(bytes + l.at(r), static_cast<const std::byte*>(theirs) + l.at(r), l.bytes(r));
    });
  }
  void wait(std::size_t) noexcept {}
  void test(std::size_t) noexcept {}
  void rethrow_noted() const noexcept {}

 private:
  /// Offers mine, then calls read(r, rank r's offer) for every rank r, in rank order.
  template <class Read>
  void exchange(const void* mine, Read&& read) {
    world_.offered[static_cast<std::size_t>(rank_)] = mine;
    world_.sync.arrive_and_wait();
    for (int r = 0; r < world_.ranks; ++r) read(r, world_.offered[static_cast<std::size_t>(r)]);
    world_.sync.arrive_and_wait();
  }
  template <class Op>
  void reduce(const std::uint64_t* in, std::uint64_t* out, std::size_t n, Op op) {
    std::vector<std::uint64_t> result(in, in + n);
    exchange(in, [&](int, const void* theirs) {
      const auto* w = static_cast<const std::uint64_t*>(theirs);
      for (std::size_t j = 0; j < n; ++j) result[j] = op(result[j], w[j]);
    });
    std::copy(result.begin(), result.end(), out);
  }

  thread_world& world_;
  int rank_;
};

static_assert(processes::transport<thread_transport>);

template <class S>
using vector_of = Eigen::Matrix<S, Eigen::Dynamic, 1>;
template <class S>
using towers_of = std::vector<std::vector<std::pair<vector_of<S>, std::string>>>;

/// What one rank's call left: its outputs, its summary, or its exception.
template <class S>
struct rank_result {
  std::vector<vector_of<S>> means, squares;
  gradavg::summary report;
  std::exception_ptr failure;
};

/// Runs call(r, wire, work, rank r's result) on every rank r of a world of `ranks` threads, each
/// with its transport and its buffers; an exception is kept in the rank's result.
template <class S, class Call>
std::vector<rank_result<S>> run_ranks(int ranks, std::vector<rank_result<S>> results, const Call& call) {
  thread_world world(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      auto& mine = results[static_cast<std::size_t>(r)];
      try {
        thread_transport wire(world, r);
        gradavg::shared_detail::process_buffers work;
        mine.report = call(r, wire, work, mine);
      } catch (...) {
        mine.failure = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return results;
}

/// Rank r averages towers[r] into its means and squares (shaped as outputs) with options_of(r).
template <class S, class OptionsOf>
std::vector<rank_result<S>> average_on_ranks(const std::vector<towers_of<S>>& towers,
                                             const std::vector<vector_of<S>>& outputs, const OptionsOf& options_of) {
  std::vector<rank_result<S>> start(towers.size());
  for (auto& r : start) r.means = r.squares = outputs;
  return run_ranks<S>(static_cast<int>(towers.size()), std::move(start), [&](int r, auto& wire, auto& work, auto& mine) {
    return processes::average_into(wire, work, towers[static_cast<std::size_t>(r)], mine.means, &mine.squares,
                                   options_of(r), nullptr, nullptr);
  });
}

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

const std::vector<std::size_t> sizes = {1, 7, 300, 4097, 33, 64};

/// Rank r holds towers_on(r) towers of random values (seeded by rank and tower).
template <class S>
std::vector<towers_of<S>> random_ranks(int ranks, const std::function<std::size_t(int)>& towers_on) {
  std::vector<towers_of<S>> all(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    for (std::size_t k = 0; k < towers_on(r); ++k) {
      auto& tower = all[static_cast<std::size_t>(r)].emplace_back();
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const S* values = random_slice<S>(sizes[i], static_cast<std::uint32_t>(1000 * r + 10 * k + i));
        tower.emplace_back(Eigen::Map<const vector_of<S>>(values, static_cast<Eigen::Index>(sizes[i])),
                           "w" + std::to_string(i));
      }
    }
  return all;
}

template <class S>
std::vector<vector_of<S>> sentinel_outputs() {
  std::vector<vector_of<S>> out;
  for (std::size_t n : sizes) out.push_back(vector_of<S>::Constant(static_cast<Eigen::Index>(n), sentinel<S>));
  return out;
}

template <class S>
bool same_outputs(const std::vector<vector_of<S>>& a, const std::vector<vector_of<S>>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || !same_bits(a[i].data(), b[i].data(), static_cast<std::size_t>(a[i].size())))
      return false;
  return true;
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

/// The message of rank r's exception of type E (fails the test on another outcome).
template <class E, class S>
std::string failure_of(const rank_result<S>& r) {
  return message_of<E>([&] {
    if (r.failure) std::rethrow_exception(r.failure);
  });
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
