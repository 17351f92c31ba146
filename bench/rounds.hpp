// Paired measurement, shared by the binaries that measure ratios by alternation
// (bench_paired.cpp, bench_fused.cpp): the contenders of one comparison point are run in rounds,
// every contender once per round (several calls when one call is short), the round's start
// rotating, each timed alone with a steady clock; ratios are medians over rounds of per-round
// ratios, so that bandwidth drifting between rounds moves every contender of a ratio alike.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common.hpp"
#include "harness.hpp"
#include "limits.hpp"
#include "parallel.hpp"

namespace gradavg_bench {

/// One call shorter than this is repeated within a round, so that the clock's resolution and
/// the round's fixed costs stay small against what is measured.
inline constexpr double min_call_seconds = 2e-3;

/// One implementation in a comparison, with its timings.
struct contender {
  contender(std::string name_, std::unique_ptr<runner> kernel_, double bytes_)
      : name(std::move(name_)), kernel(std::move(kernel_)), bytes(bytes_) {}

  std::string name;
  std::unique_ptr<runner> kernel;
  double bytes = 0;           ///< credited per call
  std::size_t calls = 1;      ///< calls per round
  std::vector<double> times;  ///< seconds per call, one value per round
};

/// The contenders of one comparison point. hold() keeps the storage they point into; as the
/// base, it is destroyed after them.
struct comparison : holder {
  std::vector<contender> contenders;

  [[nodiscard]] const contender* find(std::string_view name) const {
    for (const contender& c : contenders)
      if (c.name == name) return &c;
    return nullptr;
  }
};

inline double seconds_of(runner& r, std::size_t calls) {
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t k = 0; k < calls; ++k) r.run();
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(stop - start).count();
}

/// Sets c.calls from the time of one call, made after the checking call (pages touched).
inline void calibrate(contender& c) {
  const double once = seconds_of(*c.kernel, 1);
  c.calls = once >= min_call_seconds ? 1 : static_cast<std::size_t>(min_call_seconds / std::max(once, 1e-9)) + 1;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  if (v.size() % 2 == 1) return *mid;
  return (*mid + *std::max_element(v.begin(), mid)) / 2;
}

/// Median over rounds of f(a.times[r], b.times[r]).
template <class F>
inline double median_ratio(const contender& a, const contender& b, F f) {
  std::vector<double> r;
  for (std::size_t i = 0; i < std::min(a.times.size(), b.times.size()); ++i) r.push_back(f(a.times[i], b.times[i]));
  return median(r);
}

/// Median over rounds of t(a) / t(b).
inline double time_ratio(const contender& a, const contender& b) {
  return median_ratio(a, b, [](double x, double y) { return x / y; });
}

/// Median over rounds of bandwidth(a) / bandwidth(b).
inline double bandwidth_ratio(const contender& a, const contender& b) {
  return median_ratio(a, b, [&](double x, double y) { return (a.bytes / x) / (b.bytes / y); });
}

/// The rounds: every iteration of the state is one round over all contenders.
inline void run_rounds(benchmark::State& state, comparison& cmp) {
  const std::size_t n = cmp.contenders.size();
  for (contender& c : cmp.contenders) {
    calibrate(c);
    c.times.reserve(static_cast<std::size_t>(state.max_iterations));
  }
  std::size_t round = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < n; ++i) {
      contender& c = cmp.contenders[(i + round) % n];
      c.times.push_back(seconds_of(*c.kernel, c.calls) / static_cast<double>(c.calls));
      benchmark::ClobberMemory();
    }
    ++round;
  }
  for (const contender& c : cmp.contenders) state.counters["GBps." + c.name] = c.bytes / median(c.times) / 1e9;
}

/// Reports an error from building (a factory that throws, a failed check) and skips.
inline bool skip_on_error(benchmark::State& state, const std::string& error) {
  if (error.empty()) return false;
  state.SkipWithError(error.c_str());
  return true;
}

/// Adds the copy limits of tower 0 on a chunk_pool: ordinary and non-temporal stores.
template <class S>
std::string add_copies(comparison& cmp, const S* src, std::size_t elements, int threads) {
  auto& pool = cmp.hold<chunk_pool>(threads);
  const limits::named_copy<S> copies[] = {{"copy", &limits::copy<S>}, {"copy_nt", &limits::copy_nt<S>}};
  for (const limits::named_copy<S>& k : copies) {
    S* dst = cmp.hold<aligned_buffer<S>>(elements).data();
    contender c{k.name, make_copy_runner(k, dst, src, elements, pool), 2.0 * static_cast<double>(elements) * sizeof(S)};
    if (std::string error = run_and_check_copy(*c.kernel, k.name, dst, src, elements); !error.empty()) return error;
    cmp.contenders.push_back(std::move(c));
  }
  return {};
}

/// Adds `read`: the read limit (limits::read_fold) over towers[0, T), elements values of S each,
/// on a chunk_pool, credited with `bytes` (a mean's: its bandwidth is then what the mean would
/// reach if writing its output cost nothing). Checked against a scalar xor of the same words.
template <class S>
std::string add_read(comparison& cmp, std::span<const S* const> towers, std::size_t elements, int threads,
                     double bytes) {
  auto& pool = cmp.hold<chunk_pool>(threads);
  auto& ranges = cmp.hold<std::vector<const std::byte*>>();
  for (const S* t : towers) ranges.push_back(reinterpret_cast<const std::byte*>(t));
  auto& partial = cmp.hold<std::vector<std::uint64_t>>(pool.threads());
  auto r = make_fn_runner([&pool, &ranges, &partial, elements] {
    pool.for_chunks(elements, [&](std::size_t c, std::size_t b, std::size_t e) {
      partial[c] = limits::read_fold(ranges, b * sizeof(S), e * sizeof(S));
    });
  });
  std::fill(partial.begin(), partial.end(), ~std::uint64_t{0});
  r->run();
  std::uint64_t got = 0, want = 0;
  for (std::uint64_t p : partial) got ^= p;
  for (const std::byte* t : ranges)
    for (std::size_t i = 0; i < elements * sizeof(S); i += 8) {
      std::uint64_t word = 0;
      std::memcpy(&word, t + i, std::min<std::size_t>(8, elements * sizeof(S) - i));
      want ^= word;
    }
  if (got != want) return "read mismatch";
  cmp.contenders.emplace_back("read", std::move(r), bytes);
  return {};
}

/// Removes every argument `flag`<count> (flag ends with '=') from argv and returns the last
/// count given (at least 1), or `fallback` when none is.
inline std::size_t take_count_flag(int& argc, char** argv, std::string_view flag, std::size_t fallback) {
  std::size_t count = fallback;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with(flag))
      count = static_cast<std::size_t>(std::max(1L, std::strtol(argv[i] + flag.size(), nullptr, 10)));
    else
      argv[out++] = argv[i];
  }
  argc = out;
  return count;
}

}  // namespace gradavg_bench
