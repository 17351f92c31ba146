// The implementations the benchmarks compare. Each factory builds a runner for one problem and
// throws std::runtime_error when it cannot handle it (e.g. a thread count it does not support);
// the benchmark then reports the message with SkipWithError.
#pragma once

#include <memory>
#include <string>

#include <Eigen/Core>

#include "common.hpp"

namespace gradavg_bench {

/// One Eigen pass per tower on Eigen::Map: out = g0; out += g1; ...; out *= 1/T (same for
/// squares with .square()). With n threads, [0, P) is split into n contiguous chunks (multiples
/// of 64 elements) and each thread runs those passes on its chunk, on a persistent pool.
template <class S>
std::unique_ptr<runner> make_eigen_per_tower(const problem<S>& p);

/// eigen_per_tower applied to each variable of a model in turn. With n threads, all variables'
/// elements form one flat range split into n contiguous chunks, as gradavg splits them; each
/// thread runs the per-tower passes on the pieces of the variables its chunk covers.
template <class S>
std::unique_ptr<runner> make_eigen_per_tower_vars(const var_problem<S>& p);

/// The TensorFlow seed's way: copy the towers into one stacked row-major T x P Eigen::Tensor
/// (tf.stack / tf.concat), then .mean() (and .square().mean()) over the tower dimension.
/// Evaluated on Eigen::DefaultDevice for 1 thread, otherwise on an Eigen::ThreadPoolDevice with
/// n threads (the stacking copies and the reductions alike).
template <class S>
std::unique_ptr<runner> make_stacked_tensor(const problem<S>& p);

#ifdef GRADAVG_BENCH_HAVE_ONEDNN
/// oneDNN's sum primitive with scales 1/T over T 1-D f32 memories. Squares: one eltwise_pow
/// (alpha 1/T, beta 2) per tower into scratch, then a second sum (not fused). float only.
/// Threads: oneDNN's OpenMP runtime, set with omp_set_num_threads at construction.
std::unique_ptr<runner> make_onednn_sum(const problem<float>& p);

/// The same sum over T 1-D bf16 memories into a bf16 destination (oneDNN accumulates in f32).
/// Means only. Throws dnnl::error where oneDNN has no bf16 sum on this CPU.
std::unique_ptr<runner> make_onednn_sum_bf16(const problem<Eigen::bfloat16>& p);

/// The name of oneDNN's implementation of that bf16 sum on this CPU ("simple:any", "ref:any",
/// ...), or empty when oneDNN has none.
std::string onednn_bf16_sum_implementation(std::size_t towers, std::size_t elements);
#endif

#ifndef GRADAVG_BENCH_NO_GRADAVG
/// gradavg::average_gradients_into over one variable per tower, default options but for
/// threads and stores: options{.run = {.threads = n, .stores = store_policy::regular, .pool = &pool}} with
/// a gradavg::thread_pool(n) that the runner owns (created once, at construction).
template <class S>
std::unique_ptr<runner> make_gradavg(const problem<S>& p);

/// As make_gradavg, with options.run.stores = store_policy::streaming (non-temporal stores).
template <class S>
std::unique_ptr<runner> make_gradavg_nt(const problem<S>& p);

/// gradavg::average_gradients_into over many variables per tower (see var_problem).
template <class S>
std::unique_ptr<runner> make_gradavg_vars(const var_problem<S>& p);

/// As make_gradavg_vars, with options.run.stores = store_policy::streaming.
template <class S>
std::unique_ptr<runner> make_gradavg_nt_vars(const var_problem<S>& p);
#endif

}  // namespace gradavg_bench
