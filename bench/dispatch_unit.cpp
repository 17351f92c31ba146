// One unit of bench_dispatch (dispatch_unit.hpp), compiled once per GRADAVG_BENCH_UNIT: native
// (with -march=native), v3 (-march=x86-64-v3) or portable (no instruction-set flags).
#include "dispatch_unit.hpp"

#include <gradavg/gradavg.hpp>

namespace gradavg_bench::dispatch {
namespace {

template <class S>
double average(const tower_list<S>& towers, std::span<std::span<S>> means, std::span<std::span<S>> squares,
               const gradavg::options& opts) {
  const gradavg::summary s = squares.empty() ? gradavg::average_gradients_into(towers, means, opts)
                                             : gradavg::average_gradients_into(towers, means, squares, opts);
  return opts.compute.statistics ? s.sum_mean_squared : 0.0;
}

gradavg::simd_level level_in_use() { return gradavg::simd_level_in_use(); }

}  // namespace

#define GRADAVG_BENCH_CAT_(a, b) a##b
#define GRADAVG_BENCH_CAT(a, b) GRADAVG_BENCH_CAT_(a, b)
unit GRADAVG_BENCH_CAT(GRADAVG_BENCH_UNIT, _unit)() {
  return {&average<float>, &average<Eigen::half>, &average<Eigen::bfloat16>, &level_in_use};
}

}  // namespace gradavg_bench::dispatch
