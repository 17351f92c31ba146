// gradavg: libtorch across processes. The gradients of a torch::nn::Module's replicas averaged
// over every replica of every rank of an MPI communicator (gradavg::mpi), in place, and root's
// parameters and buffers broadcast to every replica of every rank. Link the CMake targets
// gradavg::torch and gradavg::mpi.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mpi.hpp"
#include "torch.hpp"
#include "torch_data_parallel.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// Makes the replicas' presence that of every replica of every rank of comm: one MPI_Allreduce of
/// six words (the maximum and minimum over ranks of absent_as_zeros, of the parameter count, or a
/// marker where a rank could not read its replicas, and of the fingerprint of the parameters'
/// dtypes), then, where every rank set absent_as_zeros and knows the same count and dtypes, one
/// MPI_BOR over the present and one over the absent bits. Allocates nothing between its
/// collectives, so every rank takes the same branch. absent_as_zeros set on some ranks only is
/// option_error on every rank. Counts or dtypes that differ (or a rank that could not read its
/// replicas) leave presence unknown everywhere: no zeros, one averaging call, whose own
/// agreement names the error.
inline void agree_presence(MPI_Comm comm, presence& seen, const module_options& mopts) {
  using gradavg::mpi::detail::check;
  gradavg::mpi::detail::check_communicator(comm);
  constexpr std::uint64_t unknown = ~std::uint64_t{0} >> 1;
  const std::uint64_t flag = mopts.absent_as_zeros ? 1 : 0;
  const std::uint64_t count = seen.known ? seen.parameters : unknown;
  const std::uint64_t dtypes = seen.known ? seen.dtypes : 0;
  // MPI_MAX: maxima, and minima through ~.
  std::uint64_t words[6] = {flag, ~flag, count, ~count, dtypes, ~dtypes};
  check(MPI_Allreduce(MPI_IN_PLACE, words, 6, MPI_UINT64_T, MPI_MAX, comm), "MPI_Allreduce");
  if (words[0] != ~words[1])
    throw option_error("gradavg::libtorch: module_options::absent_as_zeros is set on some ranks but not on others; "
                       "every rank passes the same module_options");
  if (words[2] != ~words[3] || words[2] == unknown || words[4] != ~words[5]) {
    seen.known = false;
    return;
  }
  if (flag == 0) return;
  for (auto* bits : {&seen.present, &seen.absent})
    check(MPI_Allreduce(MPI_IN_PLACE, bits->data(), static_cast<int>(bits->size()), MPI_UINT64_T, MPI_BOR, comm),
          "MPI_Allreduce");
}

/// FNV-1a of a replica's parameters or buffers as every rank must hold them: names, whether
/// defined, dtypes, sizes and memory-order shapes.
inline std::uint64_t state_fingerprint(const ::torch::OrderedDict<std::string, at::Tensor>& state) {
  using gradavg::detail::processes::fnv;
  std::uint64_t h = fnv("gradavg state", 13);
  for (const auto& item : state) {
    h = fnv(item.key().data(), item.key().size() + 1, h);  // with its terminating null
    const at::Tensor& t = item.value();
    const std::int64_t d[2] = {t.defined() ? 1 : 0, t.defined() ? static_cast<std::int64_t>(t.scalar_type()) : -1};
    h = fnv(d, sizeof d, h);
    if (!t.defined()) continue;
    const shape s = gradavg::shared_detail::memory_order_shape(t);
    const std::int64_t rank = t.dim();
    h = fnv(&rank, sizeof rank, h);
    h = fnv(t.sizes().data(), t.sizes().size() * sizeof(std::int64_t), h);
    h = fnv(s.dims.data(), s.rank * sizeof(std::int64_t), h);
  }
  return h;
}

/// Broadcasts root's replica 0's parameters or buffers to every replica of every rank of comm:
/// the local checks (alike_states, at least one replica), then one MPI_Allreduce of five words
/// that every rank enters whatever its checks found (the lowest rank that failed, the maximum and
/// minimum of the fingerprints and of root), then, when all agree, one MPI_Bcast per defined
/// tensor of its bytes (in pieces of at most 1 GiB) into replica 0, then the local copies.
inline void broadcast_state(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas, int root,
                            state_kind kind) {
  using gradavg::mpi::detail::check;
  gradavg::mpi::detail::check_communicator(comm);
  const int rank = gradavg::mpi::detail::comm_rank(comm);
  const int ranks = gradavg::mpi::detail::comm_size(comm);
  const char* what = kind == state_kind::parameters ? "parameters" : "buffers";
  std::vector<::torch::OrderedDict<std::string, at::Tensor>> states;
  std::uint64_t fingerprint = 0;
  std::exception_ptr own;
  try {
    if (replicas.empty())
      throw tower_error("gradavg: no replicas on rank " + std::to_string(rank) + "; every rank passes at least one");
    states = alike_states(replicas, kind);
    fingerprint = state_fingerprint(states[0]);
  } catch (...) {
    own = std::current_exception();
  }
  const auto r = static_cast<std::uint64_t>(static_cast<std::uint32_t>(root));
  // MPI_MAX: the maxima, and the minima through ~; ~rank of a failed rank gives the lowest.
  std::uint64_t words[5] = {own ? ~static_cast<std::uint64_t>(rank) : 0, fingerprint, ~fingerprint, r, ~r};
  check(MPI_Allreduce(MPI_IN_PLACE, words, 5, MPI_UINT64_T, MPI_MAX, comm), "MPI_Allreduce");
  if (own) std::rethrow_exception(own);
  if (words[0] != 0)
    throw remote_error("gradavg::libtorch: rank " + std::to_string(~words[0]) + " failed its own checks of its " +
                       "replicas' " + what + " (see the error thrown there); nothing was written on any rank");
  if (words[3] != ~words[4])
    throw option_error(std::string("gradavg::libtorch: the ranks pass different roots to the broadcast of ") + what +
                       "; every rank passes the same root");
  if (root < 0 || root >= ranks)
    throw option_error("gradavg::libtorch: root " + std::to_string(root) + " is not a rank of the communicator (" +
                       std::to_string(ranks) + " ranks)");
  if (words[1] != ~words[2])
    throw variable_mismatch_error(std::string("gradavg::libtorch: the ranks' replicas hold different ") + what +
                                  " (names, dtypes or sizes differ between ranks); every rank's replicas must be of "
                                  "one model; nothing was written on any rank");
  constexpr std::size_t piece = std::size_t{1} << 30;
  for (const auto& item : states[0]) {
    const at::Tensor& t = item.value();
    if (!t.defined()) continue;
    auto* bytes = static_cast<std::byte*>(t.data_ptr());
    for (std::size_t at = 0; at < t.nbytes(); at += piece)
      check(MPI_Bcast(bytes + at, static_cast<int>(std::min(piece, t.nbytes() - at)), MPI_BYTE, root, comm),
            "MPI_Bcast");
  }
  copy_state_to_other_replicas(states);
}

}  // namespace detail

/// Broadcasts root's replica 0's buffers (named_buffers(), recursive: BatchNorm's running
/// statistics) to every replica of every rank of comm, in place, byte for byte, in
/// named_buffers() order. Collective: every rank calls it with the same root. The replicas of
/// every rank must hold the same buffers (names, dtypes, sizes and memory order): checked within
/// each rank as broadcast_buffers does and between ranks by a fingerprint, before anything is
/// written; a rank whose replicas differ gets the error of its own checks (or, between ranks,
/// variable_mismatch_error), every other rank remote_error or the same error: no rank is left
/// waiting. Different roots, or a root outside comm, are option_error on every rank.
inline void broadcast_buffers(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas, int root = 0) {
  detail::broadcast_state(comm, replicas, root, detail::state_kind::buffers);
}

/// The same for the parameters (named_parameters(), recursive, frozen ones included): every
/// replica of every rank starts from root's values, as DistributedDataParallel's construction
/// broadcasts rank 0's.
inline void broadcast_parameters(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas, int root = 0) {
  detail::broadcast_state(comm, replicas, root, detail::state_kind::parameters);
}

/// broadcast_buffers across ranks for any range of replicas.
template <replica_range R>
void broadcast_buffers(MPI_Comm comm, const R& replicas, int root = 0) {
  const auto modules = detail::modules_of(replicas);
  broadcast_buffers(comm, std::span<::torch::nn::Module* const>(modules), root);
}

/// broadcast_parameters across ranks for any range of replicas.
template <replica_range R>
void broadcast_parameters(MPI_Comm comm, const R& replicas, int root = 0) {
  const auto modules = detail::modules_of(replicas);
  broadcast_parameters(comm, std::span<::torch::nn::Module* const>(modules), root);
}

/// average_module_gradients across the ranks of comm: each rank passes its own replicas (one or
/// more; ranks may hold different numbers), and every replica of every rank receives the mean
/// over all of them, bitwise the same on every rank (gradavg::mpi's order of summation). The
/// parameters are named and checked as in one process, and agreed between ranks as
/// gradavg::mpi::average_gradients_into agrees on variables: by name, presence and shape, so a
/// rank whose model differs gets the same error as every other rank, before anything is written.
/// Collective: every rank of comm calls it with the same options (weights: one per local replica)
/// and the same module_options. With module_options::absent_as_zeros, presence is agreed over
/// every replica of every rank first (detail::agree_presence): a parameter with a gradient on
/// some replica of some rank is averaged with zeros for every replica of every rank that lacks
/// one, listed in zero_filled on every rank; one without a gradient anywhere is skipped.
namespace detail {

/// The module helpers deliver every mean to the replicas: output_mode::sharded is refused, as a
/// failure that takes part in the first collective (every rank throws, none waits).
inline std::exception_ptr refuse_sharded(const gradavg::mpi::options& opts, std::exception_ptr prior) {
  if (prior || opts.exchange.output == output_mode::replicated) return prior;
  return std::make_exception_ptr(option_error(
      "gradavg::libtorch: options.exchange.output is not replicated; the module helpers give every replica every "
      "mean. For a shard per rank, call gradavg::mpi::average_gradients_into with output_mode::sharded"));
}

}  // namespace detail

inline module_report average_module_gradients(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas,
                                              const gradavg::mpi::options& opts = {},
                                              const module_options& mopts = {}) {
  // A rank whose replicas cannot be read takes part in the agreement with its error (prior).
  return detail::average_replicas(
      replicas, opts.local(), mopts,
      [&](detail::presence& seen, const module_options& m) { detail::agree_presence(comm, seen, m); },
      [&](const auto& tg, auto& means, std::vector<at::Tensor>* squares, std::exception_ptr prior,
          std::span<variable_statistics> per_variable) {
        gradavg::mpi::options call = opts;
        call.compute.per_variable = per_variable;
        prior = detail::refuse_sharded(opts, prior);
        // The outputs are of the gradients' dtypes: only those kernels are compiled.
        if (squares) return gradavg::mpi::detail::average_into<true>(comm, tg, means, squares, call, prior);
        return gradavg::mpi::detail::average_into<true>(comm, tg, means, gradavg::detail::no_squares,
                                                        call, prior);
      });
}

/// The same for any range of replicas (Module*, std::shared_ptr<M>, or a ModuleHolder).
template <std::ranges::random_access_range R>
  requires(!std::is_convertible_v<const R&, std::span<::torch::nn::Module* const>>) &&
          requires(const std::ranges::range_value_t<R>& m) {
            { detail::module_of(m) } -> std::convertible_to<::torch::nn::Module*>;
          }
module_report average_module_gradients(MPI_Comm comm, const R& replicas, const gradavg::mpi::options& opts = {},
                                       const module_options& mopts = {}) {
  std::vector<::torch::nn::Module*> modules;
  for (const auto& m : replicas) modules.push_back(detail::module_of(m));
  return average_module_gradients(comm, std::span<::torch::nn::Module* const>(modules), opts, mopts);
}

/// data_parallel across the ranks of comm: each rank's replicas are averaged with every other
/// rank's, bucket by bucket while backward runs, with average_module_gradients(comm, ...)'s
/// results bit for bit (gradavg::mpi sums in rank order whatever the buckets). Every bucket runs
/// on every rank in bucket order, as one average_module_gradients(comm, ...) over its parameters:
/// the worker starts bucket b once b is complete on this rank (its collective then waits for the
/// other ranks) or finish() has been called; finish() then averages the parameters no bucket holds
/// the same way, and throws the first error, the same on every rank. A rank whose backward threw
/// calls finish() or abandon() like the others, so that no rank is left waiting; its missing
/// gradients are then every rank's missing_gradient_error (or zeros with absent_as_zeros).
/// Collective: construction (one MPI_Allreduce agreeing on the setup and the buckets: a rank that
/// could not set up throws its error, the others remote_error; buckets that differ are
/// variable_mismatch_error everywhere), finish(), abandon(). The worker thread calls MPI: MPI must
/// be initialised with MPI_THREAD_SERIALIZED or more (option_error otherwise), and this rank's
/// other threads must not call MPI on comm between the step's first backward and finish()'s
/// return. Destroy it after finish(), on every rank.
///
/// Error feedback (opts.exchange.feedback = error_feedback::kept, with a lossy
/// opts.exchange.compression; otherwise every averaging call is an option_error): the object
/// keeps a residual per averaging call of a step (each bucket's, and finish()'s of the parameters
/// no bucket held), 4 bytes per averaged gradient element, allocated at a call's first step; each
/// call adds it into this rank's contribution and keeps what the encoding dropped
/// (options.exchange.residual's meaning), and draws int8's rounding from opts.exchange.seed plus
/// its step count, so that runs repeat bit for bit. reset_feedback() (between finish() and the next backward, on every rank)
/// zeroes the residuals and restarts the step counts: on a loss-scale change, on restart.
/// opts.exchange.residual must be empty (the object holds them).
class mpi_data_parallel final : public data_parallel {
 public:
  mpi_data_parallel(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas,
                    const gradavg::mpi::options& opts = {}, const module_options& mopts = {},
                    const bucket_options& buckets = {})
      : mpi_data_parallel(comm, replicas, opts, mopts, buckets, feedback_of(opts)) {}

  /// Any range of replicas: Module*, std::shared_ptr<M> or a ModuleHolder.
  template <replica_range R>
  mpi_data_parallel(MPI_Comm comm, const R& replicas, const gradavg::mpi::options& opts = {},
                    const module_options& mopts = {}, const bucket_options& buckets = {})
      : mpi_data_parallel(comm, std::span<::torch::nn::Module* const>(detail::modules_of(replicas)), opts, mopts,
                          buckets) {}

  /// Zeroes every residual and restarts the rounding's step counts (error_feedback::kept; nothing
  /// otherwise). Between finish() and the next backward, on every rank.
  void reset_feedback() noexcept {
    if (!feedback_) return;
    for (auto& [key, r] : feedback_->residuals) {
      std::fill(r.values.begin(), r.values.end(), 0.0f);
      r.steps = 0;
    }
  }

 private:
  /// error_feedback::kept's state, shared with the averaging calls: per call of a step (keyed by
  /// the parameters it averages), its residual and its step count.
  struct residual {
    std::vector<float> values;
    std::uint64_t steps = 0;
  };
  struct feedback_state {
    std::exception_ptr refused;  // kept with options it needs otherwise: every call's error
    std::vector<std::pair<std::uint64_t, residual>> residuals;
    residual& of(std::uint64_t key) {
      for (auto& [k, r] : residuals)
        if (k == key) return r;
      return residuals.emplace_back(key, residual{}).second;
    }
  };
  std::shared_ptr<feedback_state> feedback_;

  /// The state error_feedback::kept needs, or null. Kept without a lossy format or with a
  /// residual of the caller's: an option_error that every averaging call passes to its first
  /// collective (so that every rank throws, whatever the others passed).
  static std::shared_ptr<feedback_state> feedback_of(const gradavg::mpi::options& opts) {
    if (opts.exchange.feedback == gradavg::mpi::error_feedback::off) return nullptr;
    auto state = std::make_shared<feedback_state>();
    if (opts.exchange.compression == compression::none || !opts.exchange.residual.empty())
      state->refused = std::make_exception_ptr(option_error(
          "gradavg::libtorch::mpi_data_parallel: options.exchange.feedback is kept, which needs a lossy "
          "options.exchange.compression and an empty options.exchange.residual (the object holds the residuals)"));
    return state;
  }

  mpi_data_parallel(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas, const gradavg::mpi::options& opts,
                    const module_options& mopts, const bucket_options& buckets,
                    std::shared_ptr<feedback_state> feedback)
      : data_parallel(replicas, opts.local(), mopts, buckets, over(comm, replicas, opts, mopts, feedback),
                      agreement_on(comm)),
        feedback_(std::move(feedback)) {}

  static masked_call over(MPI_Comm comm, std::span<::torch::nn::Module* const> replicas,
                          const gradavg::mpi::options& opts, const module_options& mopts,
                          std::shared_ptr<feedback_state> feedback) {
    return [comm, modules = std::vector<::torch::nn::Module*>(replicas.begin(), replicas.end()), opts, mopts,
            feedback](const std::vector<std::uint64_t>& masked,
                      const std::vector<::torch::OrderedDict<std::string, at::Tensor>>& params) {
      std::uint64_t call_in_step = 0;  // several calls for parameters of several dtypes
      return detail::average_replicas(
          std::span<::torch::nn::Module* const>(modules), opts.local(), mopts,
          [&](detail::presence& seen, const module_options& m) { detail::agree_presence(comm, seen, m); },
          [&](const auto& tg, auto& means, std::vector<at::Tensor>*, std::exception_ptr prior,
              std::span<variable_statistics>) {
            prior = detail::refuse_sharded(opts, prior);
            if (!feedback)
              return gradavg::mpi::detail::average_into(comm, tg, means, gradavg::detail::no_squares, opts, prior);
            // This call's residual: keyed by its parameters (the bucket's mask) and its place in
            // the step, sized by the elements it averages (tower 0's present gradients).
            gradavg::mpi::options call = opts;
            call.exchange.feedback = gradavg::mpi::error_feedback::off;
            if (!prior) prior = feedback->refused;
            if (!prior && !tg.empty()) {
              try {
                std::uint64_t key = 0xcbf29ce484222325ull ^ call_in_step++;
                for (const std::uint64_t w : masked) key = (key ^ w) * 0x100000001b3ull;
                std::size_t elements = 0;
                for (const auto& entry : tg[0])
                  elements += entry.first.defined() ? static_cast<std::size_t>(entry.first.numel()) : 0;
                residual& r = feedback->of(key);
                if (r.values.size() != elements) r.values.assign(elements, 0.0f);
                call.exchange.residual = r.values;
                call.exchange.seed = opts.exchange.seed + r.steps++;
              } catch (...) {
                prior = std::current_exception();  // an allocation: every rank throws
              }
            }
            return gradavg::mpi::detail::average_into(comm, tg, means, gradavg::detail::no_squares, call, prior);
          },
          &masked, &params);
    };
  }

  static agreement agreement_on(MPI_Comm comm) {
    return [comm](std::uint64_t fingerprint, std::exception_ptr failure) {
      using gradavg::mpi::detail::check;
      gradavg::mpi::detail::check_communicator(comm);
      int level = MPI_THREAD_SINGLE;
      check(MPI_Query_thread(&level), "MPI_Query_thread");
      if (!failure && level < MPI_THREAD_SERIALIZED)
        failure = std::make_exception_ptr(option_error(
            "gradavg::libtorch::mpi_data_parallel: its worker thread calls MPI, so MPI must be initialised with "
            "MPI_Init_thread and MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE"));
      std::uint64_t words[3] = {failure ? 1u : 0u, fingerprint, ~fingerprint};
      check(MPI_Allreduce(MPI_IN_PLACE, words, 3, MPI_UINT64_T, MPI_MAX, comm), "MPI_Allreduce");
      if (failure) std::rethrow_exception(failure);
      if (words[0] != 0)
        throw remote_error("gradavg::libtorch::mpi_data_parallel: another rank could not set up its "
                                         "replicas (it throws the reason)");
      if (words[1] != ~words[2])
        throw variable_mismatch_error("gradavg::libtorch::mpi_data_parallel: the ranks' buckets differ (other models, "
                                      "other parameters requiring gradients, or other bucket_options)");
    };
  }
};

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
