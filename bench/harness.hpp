// The timing harness shared by the benchmark binaries. Setup (data, allocation, the one
// verifying call) happens once per benchmark, outside the timed loop: Google Benchmark calls a
// benchmark function several times while it picks an iteration count, so the prepared state is
// kept in a one-slot cache keyed by the benchmark's name.
#pragma once

#include <benchmark/benchmark.h>

#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "limits.hpp"
#include "parallel.hpp"

namespace gradavg_bench {

/// A runner around any callable.
template <class F>
class fn_runner final : public runner {
 public:
  explicit fn_runner(F f) : f_(std::move(f)) {}
  void run() override { f_(); }

 private:
  F f_;
};

template <class F>
std::unique_ptr<runner> make_fn_runner(F f) {
  return std::make_unique<fn_runner<F>>(std::move(f));
}

/// Storage that runners point into: objects allocated with hold() live as long as the holder.
struct holder {
  std::vector<std::shared_ptr<void>> keep;

  /// Allocates an object that lives as long as this holder, and returns it.
  template <class T, class... Args>
  T& hold(Args&&... args) {
    auto p = std::make_shared<T>(std::forward<Args>(args)...);
    T& ref = *p;
    keep.push_back(std::move(p));
    return ref;
  }
};

/// A copy limit as a runner: k.fn copies src[0, n) to dst, one contiguous chunk per thread of
/// pool (which must outlive the runner).
template <class S>
std::unique_ptr<runner> make_copy_runner(const limits::named_copy<S>& k, S* dst, const S* src, std::size_t n,
                                         chunk_pool& pool) {
  return make_fn_runner([=, fn = k.fn, &pool] {
    pool.for_chunks(n, [=](std::size_t, std::size_t b, std::size_t e) { fn(dst + b, src + b, e - b); });
  });
}

/// Poisons dst[0, n) (so that what an earlier run left there cannot pass), runs r once and
/// compares dst with src bitwise. Returns "<name> mismatch", or empty on success.
template <class S>
std::string run_and_check_copy(runner& r, const char* name, S* dst, const S* src, std::size_t n) {
  poison(std::span<S>(dst, n));
  r.run();
  return std::memcmp(src, dst, n * sizeof(S)) == 0 ? std::string() : std::string(name) + " mismatch";
}

/// make's runner for `what` over towers (elements values each), writing outputs that h holds.
/// One untimed call into poisoned outputs checks it against the double reference and touches
/// every page before timing starts.
template <class S>
checked_runner checked_peer(holder& h, op what, std::span<const S* const> towers, std::size_t elements, int threads,
                            peer_factory<S> make) {
  S* mean = h.hold<aligned_buffer<S>>(elements).data();
  S* sq = what == op::mean_sq ? h.hold<aligned_buffer<S>>(elements).data() : nullptr;
  problem<S> pr;
  pr.towers = towers;
  pr.elements = elements;
  pr.mean = mean;
  pr.sq = sq;
  pr.threads = threads;
  checked_runner c{make(pr), {}, mean};
  poison(std::span<S>(mean, elements));
  if (sq != nullptr) poison(std::span<S>(sq, elements));
  c.kernel->run();
  c.error = check_against_reference<S>(towers, 0, elements, mean, sq);
  return c;
}

/// Everything a benchmark's timed loop needs, built (and verified) once. The holder's storage
/// is declared before the kernel, so it outlives it.
struct prepared : holder {
  std::string error;               ///< non-empty: skip the benchmark with this message
  std::unique_ptr<runner> kernel;  ///< the timed call
  const void* sink = nullptr;      ///< an output, handed to DoNotOptimize
};

/// Returns the prepared state for `key`, building it with `build` if the slot holds another.
/// The previous occupant is destroyed first, so at most one benchmark's buffers are alive.
/// An exception from `build` becomes the state's error.
inline prepared& prepare(const std::string& key, const std::function<void(prepared&)>& build) {
  static std::string slot_key;
  static std::unique_ptr<prepared> slot;
  if (slot_key != key || !slot) {
    slot.reset();
    slot_key = key;
    slot = std::make_unique<prepared>();
    try {
      build(*slot);
      if (slot->error.empty() && !slot->kernel) slot->error = "no kernel built";
    } catch (const std::exception& e) {
      slot->error = e.what();
    }
  }
  return *slot;
}

/// Runs the timed loop of a prepared benchmark and credits `bytes` per iteration as the
/// bytes_per_second counter.
inline void time_loop(benchmark::State& state, prepared& p, double bytes) {
  if (!p.error.empty()) {
    state.SkipWithError(p.error.c_str());
    return;
  }
  for (auto _ : state) {
    p.kernel->run();
    benchmark::DoNotOptimize(p.sink);
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_second"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

/// Registers a benchmark whose state `build` prepares; every iteration credits `bytes`.
/// Wall-clock time, so that threaded runs are measured fairly (Google Benchmark's CPU time is
/// the benchmark thread's only).
inline benchmark::internal::Benchmark* register_prepared(const std::string& name, double bytes,
                                                         std::function<void(prepared&)> build) {
  return benchmark::RegisterBenchmark(name.c_str(),
                                      [name, bytes, build](benchmark::State& state) {
                                        time_loop(state, prepare(name, build), bytes);
                                      })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace gradavg_bench
