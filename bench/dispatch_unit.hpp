// bench_dispatch.cpp's translation units: dispatch_unit.cpp compiled three times into one program:
// with -march=native (gradavg's kernel for this machine's level alone), with -march=x86-64-v3
// (AVX2 and up), and without instruction-set flags (every x86-64 level, chosen at run time), so
// that their calls can be timed side by side in one run. The interface holds only types shared by every level.
#pragma once

#include <Eigen/Core>

#include <span>
#include <utility>
#include <vector>

#include <gradavg/options.hpp>
#include <gradavg/simd.hpp>

namespace gradavg_bench::dispatch {

/// One (gradient, variable) list per tower.
template <class S>
using tower_list = std::vector<std::vector<std::pair<std::span<const S>, int>>>;

/// average_gradients_into over towers into means (and squares unless empty); returns the
/// summary's sum of mean^2 with options.compute.statistics, else 0.
template <class S>
using average_fn = double (*)(const tower_list<S>&, std::span<std::span<S>> means, std::span<std::span<S>> squares,
                              const gradavg::options&);

/// One translation unit's entry points.
struct unit {
  average_fn<float> average_float;
  average_fn<Eigen::half> average_half;
  average_fn<Eigen::bfloat16> average_bfloat16;
  gradavg::simd_level (*level_in_use)();  ///< simd_level_in_use() as that unit sees it
};

unit native_unit();    ///< compiled with -march=native
unit v3_unit();        ///< compiled with -march=x86-64-v3 (the flags of an AVX2 machine's build)
unit portable_unit();  ///< compiled without instruction-set flags

}  // namespace gradavg_bench::dispatch
