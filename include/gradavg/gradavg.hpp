// gradavg: averages gradients across towers (data-parallel replicas) for training code.
// The umbrella header: the whole public API is in the headers it includes.
#pragma once

#include "version.hpp"   // GRADAVG_VERSION_*
#include "errors.hpp"    // gradavg::error and its subclasses
#include "options.hpp"   // gradavg::options
#include "statistics.hpp"  // summary, variable_statistics, noise_estimate
#include "plan.hpp"      // plan: one call's checks kept for the next steps
#include "timeline.hpp"  // timeline: a Chrome trace of the calls, call_profile
#include "log.hpp"       // logger: what the calls chose, at a log_level
#include "executor.hpp"  // threads: executor, thread_pool
#include "simd.hpp"      // simd_level_in_use, force_simd_level: the kernel's instruction-set level
#include "tensor.hpp"    // tensor_traits, shape; std::vector / std::span / std::array support
#include "entry.hpp"     // (gradient, variable) entries, absent gradients, variable_traits
#include "average.hpp"   // average_gradients, average_gradients_into
#include "eigen.hpp"     // Eigen Matrix, Array, Map, Ref
#include "eigen_tensor.hpp"  // Eigen::Tensor, Eigen::TensorMap
#if defined(_OPENMP)
#include "openmp.hpp"    // openmp_executor: only where compiled with OpenMP
#endif
