// A transport whose ranks are threads of one process (detail/processes/exchange.hpp's concept),
// and the runs of one call on every rank: the tests of the call across processes that need no MPI.
#pragma once

#include <gradavg/gradavg.hpp>
#include <gradavg/detail/processes/average.hpp>
#include <gradavg/detail/processes/gather.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <barrier>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support.hpp"

namespace gradavg_test {

namespace processes = gradavg::detail::processes;

/// The options a call across processes takes: gradavg::options' groups and the bucket size.
struct thread_options {
  gradavg::compute_options compute = {};
  gradavg::run_options run = {};
  gradavg::check_options check = {};
  struct {
    std::size_t fusion_bytes = 0;
    gradavg::compression compression = gradavg::compression::none;
    gradavg::output_mode output = gradavg::output_mode::replicated;
    std::span<float> residual = {};
    std::uint64_t seed = 0;
    gradavg::error_feedback feedback = gradavg::error_feedback::off;
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

/// The variables of the threads' tests: their sizes (one element, a few, partial and whole SIMD
/// steps, several blocks of 256).
inline const std::vector<std::size_t> sizes = {1, 7, 300, 4097, 33, 64};

/// Outputs of those sizes holding the sentinel (support.hpp).
template <class S>
std::vector<vector_of<S>> sentinel_outputs() {
  std::vector<vector_of<S>> out;
  for (std::size_t n : sizes) out.push_back(vector_of<S>::Constant(static_cast<Eigen::Index>(n), sentinel<S>));
  return out;
}

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

/// One tower per rank, of the variables of `sizes`: random values (seeded by `seed`, the rank and
/// the variable), each element x at index j of its variable made value(j, x).
template <class S, class Value>
std::vector<towers_of<S>> one_tower_per_rank(int ranks, std::uint32_t seed, const Value& value) {
  std::vector<towers_of<S>> all(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& tower = all[static_cast<std::size_t>(r)].emplace_back();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const S* values = random_slice<S>(sizes[i], seed + static_cast<std::uint32_t>(100 * r + i));
      vector_of<S> v(static_cast<Eigen::Index>(sizes[i]));
      for (Eigen::Index j = 0; j < v.size(); ++j) v[j] = value(j, values[j]);
      tower.emplace_back(std::move(v), "w" + std::to_string(i));
    }
  }
  return all;
}

/// Whether two lists of outputs hold the same variables' sizes and bits.
template <class S>
bool same_outputs(const std::vector<vector_of<S>>& a, const std::vector<vector_of<S>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || !same_bits(a[i].data(), b[i].data(), static_cast<std::size_t>(a[i].size())))
      return false;
  return true;
}

/// The variables' values end to end.
template <class S>
std::vector<S> flat(const std::vector<vector_of<S>>& variables) {
  std::vector<S> out;
  for (const auto& v : variables) out.insert(out.end(), v.data(), v.data() + v.size());
  return out;
}

/// Each rank's values (its one tower's variables) in flat order.
template <class S>
std::vector<std::vector<S>> flat_values(const std::vector<towers_of<S>>& towers) {
  std::vector<std::vector<S>> values;
  for (const auto& rank : towers) {
    std::vector<vector_of<S>> v;
    for (const auto& pair : rank[0]) v.push_back(pair.first);
    values.push_back(flat(v));
  }
  return values;
}

/// The message of rank r's exception of type E (fails the test on another outcome).
template <class E, class S>
std::string failure_of(const rank_result<S>& r) {
  return message_of<E>([&] {
    if (r.failure) std::rethrow_exception(r.failure);
  });
}

}  // namespace gradavg_test
