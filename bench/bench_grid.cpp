// The grid benchmark: every peer over towers T x elements per tower P x {mean, mean_sq} x
// threads {1, all cores}, plus the bandwidth limits (copy, copy_nt, memcpy, read-only sum) over
// the same P and thread counts, in one binary.
//
// Names: <family>/<type>/<impl>/T:<T>/P:<P>/threads:<n>, family in {mean, mean_sq, limit};
// limits have no T. bench/run_grid.py parses these names.
#include <cmath>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.hpp"
#include "harness.hpp"
#include "limits.hpp"
#include "parallel.hpp"
#include "peers.hpp"
#include "towers.hpp"

#ifndef GRADAVG_BENCH_NO_GRADAVG
#include <gradavg/version.hpp>
#endif

namespace gradavg_bench {
namespace {

std::string grid_suffix(std::size_t elements, int threads) {
  return "/P:" + std::to_string(elements) + "/threads:" + std::to_string(threads);
}

// ---- Peers. ------------------------------------------------------------------------------

struct grid_point {
  op what;
  std::size_t towers;
  std::size_t elements;
  int threads;
};

/// Builds `make`'s runner for grid point g, runs it once and checks it against the reference.
template <class S>
void build_peer(prepared& p, const grid_point& g, peer_factory<S> make) {
  const auto& towers = p.hold<std::vector<const S*>>(towers_cache().get<S>(g.towers, g.elements));
  checked_runner c = checked_peer<S>(p, g.what, towers, g.elements, g.threads, make);
  p.kernel = std::move(c.kernel);
  p.error = std::move(c.error);
  p.sink = c.sink;
}

template <class S>
void register_peer(const char* impl, const grid_point& g, peer_factory<S> make) {
  const std::string name = std::string(op_name(g.what)) + "/" + type_name<S>() + "/" + impl +
                           "/T:" + std::to_string(g.towers) + grid_suffix(g.elements, g.threads);
  register_prepared(name, credited_bytes<S>(g.what, g.towers, g.elements),
                    [g, make](prepared& p) { build_peer<S>(p, g, make); });
}

// ---- Limits: what the memory system gives a trivially simple kernel. ------------------------

/// Registers the limits at P = elements on `threads` threads: each kernel of limits.hpp runs on
/// contiguous chunks (multiples of 64 elements) of [0, P), one per thread of a chunk_pool built
/// with the benchmark's state.
template <class S>
void register_limits(std::size_t elements, int threads) {
  const std::string prefix = std::string("limit/") + type_name<S>() + "/";
  const std::string suffix = grid_suffix(elements, threads);
  const double bytes = static_cast<double>(elements) * sizeof(S);

  // copy (ordinary stores), copy_nt (non-temporal stores), memcpy: 2*P*sizeof credited.
  const limits::named_copy<S> copies[] = {
      {"copy", &limits::copy<S>}, {"copy_nt", &limits::copy_nt<S>}, {"memcpy", &limits::memcpy<S>}};
  for (const limits::named_copy<S>& k : copies) {
    register_prepared(prefix + k.name + suffix, 2 * bytes, [=](prepared& p) {
      const S* src = towers_cache().get<S>(1, elements)[0];
      S* dst = p.hold<aligned_buffer<S>>(elements).data();
      p.sink = dst;
      p.kernel = make_copy_runner(k, dst, src, elements, p.hold<chunk_pool>(threads));
      p.error = run_and_check_copy(*p.kernel, k.name, dst, src, elements);
    });
  }

  // sum: read-only reduction, one partial sum per chunk, added in chunk order. P*sizeof credited.
  register_prepared(prefix + "sum" + suffix, bytes, [=](prepared& p) {
    const S* src = towers_cache().get<S>(1, elements)[0];
    auto& pool = p.hold<chunk_pool>(threads);
    auto& partial = p.hold<std::vector<S>>(pool.threads(), S(0));
    S* result = &p.hold<S>();
    p.sink = result;
    p.kernel = make_fn_runner([=, &pool, &partial] {
      pool.for_chunks(elements, [&](std::size_t c, std::size_t b, std::size_t e) {
        partial[c] = limits::sum(src + b, e - b);
      });
      S total = 0;
      for (S x : partial) total += x;
      *result = total;
    });
    p.kernel->run();
    double want = 0, abs_sum = 0;
    for (std::size_t i = 0; i < elements; ++i) {
      want += static_cast<double>(src[i]);
      abs_sum += std::abs(static_cast<double>(src[i]));
    }
    // Reassociated float partial sums: a loose bound relative to sum |x|.
    if (!(std::abs(static_cast<double>(*result) - want) <= 1e-4 * abs_sum)) p.error = "sum mismatch";
  });
}

// ---- The grid. ---------------------------------------------------------------------------

/// Registers limits and peers in (P, threads, T, op, impl) order, so that benchmarks sharing a
/// (type, P) set of towers run one after the other.
template <class S>
void register_grid(const std::vector<std::size_t>& tower_counts,
                   const std::vector<std::size_t>& sizes, const std::vector<int>& threads) {
  for (std::size_t elements : sizes) {
    for (int n : threads) {
      register_limits<S>(elements, n);
      for (std::size_t towers : tower_counts) {
        for (op what : {op::mean, op::mean_sq}) {
          const grid_point g{what, towers, elements, n};
#ifndef GRADAVG_BENCH_NO_GRADAVG
          register_peer<S>("gradavg", g, &make_gradavg<S>);
          register_peer<S>("gradavg_nt", g, &make_gradavg_nt<S>);
#endif
          register_peer<S>("eigen_per_tower", g, &make_eigen_per_tower<S>);
          register_peer<S>("stacked_tensor", g, &make_stacked_tensor<S>);
#ifdef GRADAVG_BENCH_HAVE_ONEDNN
          if constexpr (std::is_same_v<S, float>) register_peer<S>("onednn_sum", g, &make_onednn_sum);
#endif
        }
      }
    }
  }
}

}  // namespace
}  // namespace gradavg_bench

int main(int argc, char** argv) {
  using namespace gradavg_bench;
  // 64Ki (256 KiB of floats per tower: cache), 1Mi, 16Mi (DRAM).
  const std::vector<std::size_t> sizes{std::size_t{1} << 16, std::size_t{1} << 20,
                                       std::size_t{1} << 24};
  // 1 thread and all cores (std::thread::hardware_concurrency()).
  const std::vector<int> threads = thread_counts();
  register_grid<float>({2, 4, 8, 16}, sizes, threads);
  register_grid<double>({8}, sizes, threads);

#ifdef GRADAVG_BENCH_NO_GRADAVG
  benchmark::AddCustomContext("gradavg", "not built (GRADAVG_BENCH_NO_GRADAVG)");
#else
  benchmark::AddCustomContext("gradavg", std::to_string(gradavg::version_major) + "." +
                                             std::to_string(gradavg::version_minor) + "." +
                                             std::to_string(gradavg::version_patch));
#endif
#ifdef GRADAVG_BENCH_HAVE_ONEDNN
  benchmark::AddCustomContext("onednn", "built");
#else
  benchmark::AddCustomContext("onednn", "not found at configure time");
#endif
  std::string thread_list;
  for (int n : threads) {
    if (!thread_list.empty()) thread_list += ',';
    thread_list += std::to_string(n);
  }
  benchmark::AddCustomContext("threads", thread_list);
  benchmark::AddCustomContext("copy_nt_store", limits::streaming_store_name<float>());
  benchmark::AddCustomContext("bytes_credited",
                              "STREAM-style: mean (T+1)*P*sizeof, mean_sq (T+2)*P*sizeof, "
                              "copy 2*P*sizeof, sum P*sizeof");

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
