// The grid benchmark: every peer over towers T x elements per tower P x {mean, mean_sq}, plus
// the bandwidth limits (copy, memcpy, read-only sum) over the same P, in one binary.
//
// Names: <family>/<type>/<impl>/T:<T>/P:<P>/threads:<n>, family in {mean, mean_sq, limit};
// limits have no T. bench/run_grid.py parses these names.
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <typeindex>
#include <variant>
#include <vector>

#include <Eigen/Core>

#include "common.hpp"
#include "harness.hpp"
#include "peers.hpp"

#ifndef GRADAVG_BENCH_NO_GRADAVG
#include <gradavg/version.hpp>
#endif

namespace gradavg_bench {
namespace {

// ---- Tower data: one set of towers at a time, regenerated when the type or P changes. -------

/// Tower t always holds the same values for a given (type, P), whatever T a benchmark uses, so
/// the T-sweep reads a prefix of one set. Registration order keeps (type, P) runs contiguous.
/// Pointers returned stay valid until a call with another type or P.
class tower_cache {
 public:
  template <class S>
  std::vector<const S*> get(std::size_t towers, std::size_t elements) {
    if (type_ != std::type_index(typeid(S)) || elements_ != elements) {
      data_ = std::monostate{};  // free the old set before allocating the new one
      data_ = std::vector<aligned_buffer<S>>{};
      type_ = std::type_index(typeid(S));
      elements_ = elements;
    }
    auto& set = std::get<std::vector<aligned_buffer<S>>>(data_);
    while (set.size() < towers) {
      set.emplace_back(elements);
      fill_uniform(set.back().span(), static_cast<std::uint32_t>(1000 + set.size()));
    }
    std::vector<const S*> out;
    for (std::size_t t = 0; t < towers; ++t) out.push_back(set[t].data());
    return out;
  }

 private:
  std::type_index type_ = std::type_index(typeid(void));
  std::size_t elements_ = 0;
  std::variant<std::monostate, std::vector<aligned_buffer<float>>,
               std::vector<aligned_buffer<double>>>
      data_;
};

tower_cache& towers_cache() {
  static tower_cache c;
  return c;
}

std::string grid_suffix(std::size_t elements, int threads) {
  return "/P:" + std::to_string(elements) + "/threads:" + std::to_string(threads);
}

// ---- Peers. ------------------------------------------------------------------------------

template <class S>
using factory = std::unique_ptr<runner> (*)(const problem<S>&);

struct grid_point {
  op what;
  std::size_t towers;
  std::size_t elements;
  int threads;
};

/// Builds `make`'s runner for grid point g, runs it once and checks it against the reference.
template <class S>
void build_peer(prepared& p, const grid_point& g, factory<S> make) {
  const auto& towers = p.hold<std::vector<const S*>>(towers_cache().get<S>(g.towers, g.elements));
  auto& mean = p.hold<aligned_buffer<S>>(g.elements);
  S* sq = g.what == op::mean_sq ? p.hold<aligned_buffer<S>>(g.elements).data() : nullptr;

  problem<S> pr;
  pr.towers = towers;
  pr.elements = g.elements;
  pr.mean = mean.data();
  pr.sq = sq;
  pr.threads = g.threads;
  p.kernel = make(pr);
  p.sink = mean.data();

  // One untimed call: checks the result and touches every page before timing starts.
  poison(mean.span());
  if (sq != nullptr) poison(std::span<S>(sq, g.elements));
  p.kernel->run();
  p.error = check_against_reference<S>(towers, 0, g.elements, mean.data(), sq);
}

template <class S>
void register_peer(const char* impl, const grid_point& g, factory<S> make) {
  const std::string name = std::string(op_name(g.what)) + "/" + type_name<S>() + "/" + impl +
                           "/T:" + std::to_string(g.towers) + grid_suffix(g.elements, g.threads);
  register_prepared(name, credited_bytes<S>(g.what, g.towers, g.elements),
                    [g, make](prepared& p) { build_peer<S>(p, g, make); });
}

// ---- Limits: what the memory system gives a trivially simple kernel. ------------------------

template <class S>
void register_limits(std::size_t elements) {
  using vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
  using map = Eigen::Map<vec, Eigen::Aligned64>;
  using cmap = Eigen::Map<const vec, Eigen::Aligned64>;
  const auto n = static_cast<Eigen::Index>(elements);
  const std::string prefix = std::string("limit/") + type_name<S>() + "/";
  const std::string suffix = grid_suffix(elements, 1);
  const double bytes = static_cast<double>(elements) * sizeof(S);

  // copy: dst = src with Eigen's packet loop (ordinary stores). 2*P*sizeof credited.
  register_prepared(prefix + "copy" + suffix, 2 * bytes, [=](prepared& p) {
    const S* src = towers_cache().get<S>(1, elements)[0];
    S* dst = p.hold<aligned_buffer<S>>(elements).data();
    p.sink = dst;
    p.kernel = make_fn_runner([=] { map(dst, n) = cmap(src, n); });
    p.kernel->run();
    if (std::memcmp(src, dst, elements * sizeof(S)) != 0) p.error = "copy mismatch";
  });

  // memcpy: the C library's copy, which may use non-temporal stores at large sizes.
  register_prepared(prefix + "memcpy" + suffix, 2 * bytes, [=](prepared& p) {
    const S* src = towers_cache().get<S>(1, elements)[0];
    S* dst = p.hold<aligned_buffer<S>>(elements).data();
    p.sink = dst;
    p.kernel = make_fn_runner([=] { std::memcpy(dst, src, elements * sizeof(S)); });
    p.kernel->run();
    if (std::memcmp(src, dst, elements * sizeof(S)) != 0) p.error = "memcpy mismatch";
  });

  // sum: read-only reduction with Eigen's vectorised redux. P*sizeof credited.
  register_prepared(prefix + "sum" + suffix, bytes, [=](prepared& p) {
    const S* src = towers_cache().get<S>(1, elements)[0];
    S* result = &p.hold<S>();
    p.sink = result;
    p.kernel = make_fn_runner([=] { *result = cmap(src, n).sum(); });
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

/// Registers limits and peers in (P, T, op, impl) order; `threads` is the peers' thread count.
template <class S>
void register_grid(const std::vector<std::size_t>& tower_counts,
                   const std::vector<std::size_t>& sizes, int threads) {
  for (std::size_t elements : sizes) {
    register_limits<S>(elements);
    for (std::size_t towers : tower_counts) {
      for (op what : {op::mean, op::mean_sq}) {
        const grid_point g{what, towers, elements, threads};
#ifndef GRADAVG_BENCH_NO_GRADAVG
        register_peer<S>("gradavg", g, &make_gradavg<S>);
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

}  // namespace
}  // namespace gradavg_bench

int main(int argc, char** argv) {
  using namespace gradavg_bench;
  // 64Ki (256 KiB of floats per tower: cache), 1Mi, 16Mi (DRAM).
  const std::vector<std::size_t> sizes{std::size_t{1} << 16, std::size_t{1} << 20,
                                       std::size_t{1} << 24};
  register_grid<float>({2, 4, 8, 16}, sizes, 1);
  register_grid<double>({8}, sizes, 1);

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
  benchmark::AddCustomContext("bytes_credited",
                              "STREAM-style: mean (T+1)*P*sizeof, mean_sq (T+2)*P*sizeof, "
                              "copy 2*P*sizeof, sum P*sizeof");

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
