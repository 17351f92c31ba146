// The implementations the benchmarks compare. Each factory builds a runner for one problem and
// throws std::runtime_error when it cannot handle it (e.g. a thread count it does not support);
// the benchmark then reports the message with SkipWithError.
#pragma once

#include <memory>

#include "common.hpp"

namespace gradavg_bench {

/// One Eigen pass per tower on Eigen::Map: out = g0; out += g1; ...; out *= 1/T (same for
/// squares with .square()). Single-threaded.
template <class S>
std::unique_ptr<runner> make_eigen_per_tower(const problem<S>& p);

/// eigen_per_tower applied to each variable of a model in turn.
template <class S>
std::unique_ptr<runner> make_eigen_per_tower_vars(const var_problem<S>& p);

/// The TensorFlow seed's way: copy the towers into one stacked row-major T x P Eigen::Tensor
/// (tf.stack / tf.concat), then .mean() (and .square().mean()) over the tower dimension.
/// Evaluated on Eigen::DefaultDevice for 1 thread, on an Eigen::ThreadPoolDevice otherwise.
template <class S>
std::unique_ptr<runner> make_stacked_tensor(const problem<S>& p);

#ifdef GRADAVG_BENCH_HAVE_ONEDNN
/// oneDNN's sum primitive with scales 1/T over T 1-D f32 memories. Squares: one eltwise_pow
/// (alpha 1/T, beta 2) per tower into scratch, then a second sum (not fused). float only.
std::unique_ptr<runner> make_onednn_sum(const problem<float>& p);
#endif

#ifndef GRADAVG_BENCH_NO_GRADAVG
/// gradavg::average_gradients_into over one variable per tower.
template <class S>
std::unique_ptr<runner> make_gradavg(const problem<S>& p);

/// gradavg::average_gradients_into over many variables per tower (see var_problem).
template <class S>
std::unique_ptr<runner> make_gradavg_vars(const var_problem<S>& p);
#endif

}  // namespace gradavg_bench
