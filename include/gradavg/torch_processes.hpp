// gradavg: libtorch across processes, whatever carries the bytes. The gradients of a
// torch::nn::Module's replicas averaged over every replica of every rank (in place), and root's
// parameters and buffers broadcast to every replica of every rank, over any group of processes
// that a transport header makes a process handle: an MPI communicator (torch_mpi.hpp,
// mpi_data_parallel) or a c10d::ProcessGroup (torch_c10d.hpp, c10d_data_parallel). A group
// (detail::process_group_traits<Handle>::type) gives the module helpers what they need beside
// the averaging call: its rank and size, in-place maxima and bitwise ors of 64-bit words, a
// broadcast of bytes, and whether its worker thread may call it.
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

#include "detail/processes/agreement.hpp"
#include "torch.hpp"
#include "torch_data_parallel.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// The group over which the module helpers run for a process handle: specialised by each
/// transport's header (MPI_Comm in torch_mpi.hpp, c10d::ProcessGroup in torch_c10d.hpp).
template <class Handle, class = void>
struct process_group_traits {};

template <class Handle>
using group_of_t = typename process_group_traits<std::remove_cvref_t<Handle>>::type;

}  // namespace detail

/// What the module helpers across processes take as their first argument: an MPI_Comm, a
/// c10d::ProcessGroup (with their transport's header included).
template <class Handle>
concept process_handle = requires { typename detail::group_of_t<Handle>; };

namespace detail {

/// Makes the replicas' presence that of every replica of every rank of group: one maximum over
/// six words (the maximum and minimum over ranks of absent_as_zeros, of the parameter count, or
/// a marker where a rank could not read its replicas, and of the fingerprint of the parameters'
/// dtypes), then, where every rank set absent_as_zeros and knows the same count and dtypes, one
/// bitwise or over the present and one over the absent bits. Allocates nothing between its
/// collectives, so every rank takes the same branch. absent_as_zeros set on some ranks only is
/// option_error on every rank. Counts or dtypes that differ (or a rank that could not read its
/// replicas) leave presence unknown everywhere: no zeros, one averaging call, whose own
/// agreement names the error.
template <class Group>
void agree_presence(const Group& group, presence& seen, const module_options& mopts) {
  group.check();
  constexpr std::uint64_t unknown = ~std::uint64_t{0} >> 1;
  const std::uint64_t flag = mopts.absent_as_zeros ? 1 : 0;
  const std::uint64_t count = seen.known ? seen.parameters : unknown;
  const std::uint64_t dtypes = seen.known ? seen.dtypes : 0;
  // Maxima, and minima through ~.
  std::uint64_t words[6] = {flag, ~flag, count, ~count, dtypes, ~dtypes};
  group.max_words(words, 6);
  if (words[0] != ~words[1])
    throw option_error("gradavg::libtorch: module_options::absent_as_zeros is set on some ranks but not on others; "
                       "every rank passes the same module_options");
  if (words[2] != ~words[3] || words[2] == unknown || words[4] != ~words[5]) {
    seen.known = false;
    return;
  }
  if (flag == 0) return;
  for (auto* bits : {&seen.present, &seen.absent}) group.or_words(bits->data(), bits->size());
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

/// Broadcasts root's replica 0's parameters or buffers to every replica of every rank of group:
/// the local checks (alike_states, at least one replica), then one maximum over five words that
/// every rank enters whatever its checks found (the lowest rank that failed, the maximum and
/// minimum of the fingerprints and of root), then, when all agree, one broadcast per defined
/// tensor of its bytes into replica 0, then the local copies.
template <class Group>
void broadcast_state(const Group& group, std::span<::torch::nn::Module* const> replicas, int root, state_kind kind) {
  group.check();
  const int rank = group.rank();
  const int ranks = group.ranks();
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
  // Maxima, and minima through ~; ~rank of a failed rank gives the lowest.
  std::uint64_t words[5] = {own ? ~static_cast<std::uint64_t>(rank) : 0, fingerprint, ~fingerprint, r, ~r};
  group.max_words(words, 5);
  if (own) std::rethrow_exception(own);
  if (words[0] != 0)
    throw remote_error("gradavg::libtorch: rank " + std::to_string(~words[0]) + " failed its own checks of its " +
                       "replicas' " + what + " (see the error thrown there); nothing was written on any rank");
  if (words[3] != ~words[4])
    throw option_error(std::string("gradavg::libtorch: the ranks pass different roots to the broadcast of ") + what +
                       "; every rank passes the same root");
  if (root < 0 || root >= ranks)
    throw option_error("gradavg::libtorch: root " + std::to_string(root) + " is not a rank of the group (" +
                       std::to_string(ranks) + " ranks)");
  if (words[1] != ~words[2])
    throw variable_mismatch_error(std::string("gradavg::libtorch: the ranks' replicas hold different ") + what +
                                  " (names, dtypes or sizes differ between ranks); every rank's replicas must be of "
                                  "one model; nothing was written on any rank");
  for (const auto& item : states[0]) {
    const at::Tensor& t = item.value();
    if (t.defined()) group.broadcast(static_cast<std::byte*>(t.data_ptr()), t.nbytes(), root);
  }
  copy_state_to_other_replicas(states);
}

/// The module helpers deliver every mean to the replicas: output_mode::sharded is refused, as a
/// failure that takes part in the first collective (every rank throws, none waits).
template <class Options>
std::exception_ptr refuse_sharded(const Options& opts, std::exception_ptr prior) {
  if (prior || opts.exchange.output == output_mode::replicated) return prior;
  return std::make_exception_ptr(option_error(
      "gradavg::libtorch: options.exchange.output is not replicated; the module helpers give every replica every "
      "mean. For a shard per rank, call average_gradients_into across processes with output_mode::sharded"));
}

}  // namespace detail

/// Broadcasts root's replica 0's buffers (named_buffers(), recursive: BatchNorm's running
/// statistics) to every replica of every rank of the group, in place, byte for byte, in
/// named_buffers() order. Collective: every rank calls it with the same root. The replicas of
/// every rank must hold the same buffers (names, dtypes, sizes and memory order): checked within
/// each rank as broadcast_buffers does and between ranks by a fingerprint, before anything is
/// written; a rank whose replicas differ gets the error of its own checks (or, between ranks,
/// variable_mismatch_error), every other rank remote_error or the same error: no rank is left
/// waiting. Different roots, or a root outside the group, are option_error on every rank.
template <process_handle H>
void broadcast_buffers(H&& handle, std::span<::torch::nn::Module* const> replicas, int root = 0) {
  detail::broadcast_state(detail::group_of_t<H>(handle), replicas, root, detail::state_kind::buffers);
}

/// The same for the parameters (named_parameters(), recursive, frozen ones included): every
/// replica of every rank starts from root's values, as DistributedDataParallel's construction
/// broadcasts rank 0's.
template <process_handle H>
void broadcast_parameters(H&& handle, std::span<::torch::nn::Module* const> replicas, int root = 0) {
  detail::broadcast_state(detail::group_of_t<H>(handle), replicas, root, detail::state_kind::parameters);
}

/// broadcast_buffers across ranks for any range of replicas.
template <process_handle H, replica_range R>
void broadcast_buffers(H&& handle, const R& replicas, int root = 0) {
  const auto modules = detail::modules_of(replicas);
  broadcast_buffers(handle, std::span<::torch::nn::Module* const>(modules), root);
}

/// broadcast_parameters across ranks for any range of replicas.
template <process_handle H, replica_range R>
void broadcast_parameters(H&& handle, const R& replicas, int root = 0) {
  const auto modules = detail::modules_of(replicas);
  broadcast_parameters(handle, std::span<::torch::nn::Module* const>(modules), root);
}

/// average_module_gradients across the ranks of the group: each rank passes its own replicas (one
/// or more; ranks may hold different numbers), and every replica of every rank receives the mean
/// over all of them, bitwise the same on every rank (the call across processes' order of
/// summation). The parameters are named and checked as in one process, and agreed between ranks
/// as average_gradients_into across processes agrees on variables: by name, presence and shape,
/// so a rank whose model differs gets the same error as every other rank, before anything is
/// written. Collective: every rank calls it with the same options (weights: one per local
/// replica) and the same module_options. With module_options::absent_as_zeros, presence is
/// agreed over every replica of every rank first (detail::agree_presence): a parameter with a
/// gradient on some replica of some rank is averaged with zeros for every replica of every rank
/// that lacks one, listed in zero_filled on every rank; one without a gradient anywhere is skipped.
template <process_handle H>
module_report average_module_gradients(H&& handle, std::span<::torch::nn::Module* const> replicas,
                                       const typename detail::group_of_t<H>::options_type& opts = {},
                                       const module_options& mopts = {}) {
  const detail::group_of_t<H> group(handle);
  // A rank whose replicas cannot be read takes part in the agreement with its error (prior).
  return detail::average_replicas(
      replicas, opts.local(), mopts,
      [&](detail::presence& seen, const module_options& m) { detail::agree_presence(group, seen, m); },
      [&](const auto& tg, auto& means, std::vector<at::Tensor>* squares, std::exception_ptr prior,
          std::span<variable_statistics> per_variable) {
        auto call = opts;
        call.compute.per_variable = per_variable;
        prior = detail::refuse_sharded(opts, prior);
        // The outputs are of the gradients' dtypes: only those kernels are compiled.
        if (squares) return group.template average<true>(tg, means, squares, call, prior);
        return group.template average<true>(tg, means, gradavg::detail::no_squares, call, prior);
      });
}

/// The same for any range of replicas (Module*, std::shared_ptr<M>, or a ModuleHolder).
template <process_handle H, replica_range R>
module_report average_module_gradients(H&& handle, const R& replicas,
                                       const typename detail::group_of_t<H>::options_type& opts = {},
                                       const module_options& mopts = {}) {
  const auto modules = detail::modules_of(replicas);
  return average_module_gradients(handle, std::span<::torch::nn::Module* const>(modules), opts, mopts);
}

namespace detail {

/// data_parallel across the ranks of a group (mpi_data_parallel, c10d_data_parallel): each rank's
/// replicas are averaged with every other rank's, bucket by bucket while backward runs, with
/// average_module_gradients(group, ...)'s results bit for bit (the call across processes sums in
/// rank order whatever the buckets). Every bucket runs on every rank in bucket order, as one
/// average_module_gradients(group, ...) over its parameters: the worker starts bucket b once b is
/// complete on this rank (its collective then waits for the other ranks) or finish() has been
/// called; finish() then averages the parameters no bucket holds the same way, and throws the
/// first error, the same on every rank. A rank whose backward threw calls finish() or abandon()
/// like the others, so that no rank is left waiting; its missing gradients are then every rank's
/// missing_gradient_error (or zeros with absent_as_zeros). Collective: construction (one maximum
/// over three words agreeing on the setup and the buckets: a rank that could not set up throws
/// its error, the others remote_error; buckets that differ are variable_mismatch_error
/// everywhere), finish(), abandon(). The worker thread calls the group: this rank's other threads
/// must not call it between the step's first backward and finish()'s return (with MPI: MPI
/// initialised with MPI_THREAD_SERIALIZED or more, option_error otherwise). Destroy it after
/// finish(), on every rank. Its averaging calls run one at a time and share one workspace
/// (opts.exchange.work, or the object's own): after the first step, steps allocate no buffers.
///
/// Error feedback (opts.exchange.feedback = error_feedback::kept, with a lossy
/// opts.exchange.compression; otherwise every averaging call is an option_error): the object
/// keeps a residual per averaging call of a step (each bucket's, and finish()'s of the parameters
/// no bucket held), 4 bytes per averaged gradient element, allocated at a call's first step; each
/// call adds it into this rank's contribution and keeps what the encoding dropped
/// (options.exchange.residual's meaning), and draws int8's rounding from opts.exchange.seed plus
/// its step count, so that runs repeat bit for bit. reset_feedback() (between finish() and the
/// next backward, on every rank) zeroes the residuals and restarts the step counts: on a
/// loss-scale change, on restart. opts.exchange.residual must be empty (the object holds them).
template <class Group>
class process_data_parallel final : public data_parallel {
 public:
  using options_type = typename Group::options_type;

  process_data_parallel(Group group, std::span<::torch::nn::Module* const> replicas, const options_type& opts = {},
                        const module_options& mopts = {}, const bucket_options& buckets = {})
      : process_data_parallel(group, replicas, opts, mopts, buckets, feedback_of(opts)) {}

  /// Any range of replicas: Module*, std::shared_ptr<M> or a ModuleHolder.
  template <replica_range R>
  process_data_parallel(Group group, const R& replicas, const options_type& opts = {},
                        const module_options& mopts = {}, const bucket_options& buckets = {})
      : process_data_parallel(group, std::span<::torch::nn::Module* const>(detail::modules_of(replicas)), opts,
                              mopts, buckets) {}

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
  static std::shared_ptr<feedback_state> feedback_of(const options_type& opts) {
    if (opts.exchange.feedback == error_feedback::off) return nullptr;
    auto state = std::make_shared<feedback_state>();
    if (opts.exchange.compression == compression::none || !opts.exchange.residual.empty())
      state->refused = std::make_exception_ptr(option_error(
          std::string(Group::data_parallel_name) +
          ": options.exchange.feedback is kept, which needs a lossy options.exchange.compression and an empty "
          "options.exchange.residual (the object holds the residuals)"));
    return state;
  }

  process_data_parallel(Group group, std::span<::torch::nn::Module* const> replicas, const options_type& opts,
                        const module_options& mopts, const bucket_options& buckets,
                        std::shared_ptr<feedback_state> feedback)
      : data_parallel(replicas, opts.local(), mopts, buckets, over(group, replicas, opts, mopts, feedback),
                      agreement_on(group)),
        feedback_(std::move(feedback)) {}

  /// The residual of one averaging call (keyed by its parameters, the bucket's mask, and its place
  /// in the step; sized by the elements it averages, tower 0's present gradients) in call's
  /// options, and its rounding's seed; an allocation's failure as prior.
  template <class TG>
  static void keep_feedback(feedback_state& feedback, const std::vector<std::uint64_t>& masked,
                            std::uint64_t call_in_step, const TG& tg, const options_type& opts, options_type& call,
                            std::exception_ptr& prior) {
    call.exchange.feedback = error_feedback::off;
    if (!prior) prior = feedback.refused;
    if (prior || tg.empty()) return;
    try {
      std::uint64_t key = 0xcbf29ce484222325ull ^ call_in_step;
      for (const std::uint64_t w : masked) key = (key ^ w) * 0x100000001b3ull;
      std::size_t elements = 0;
      for (const auto& entry : tg[0]) elements += entry.first.defined() ? static_cast<std::size_t>(entry.first.numel()) : 0;
      residual& r = feedback.of(key);
      if (r.values.size() != elements) r.values.assign(elements, 0.0f);
      call.exchange.residual = r.values;
      call.exchange.seed = opts.exchange.seed + r.steps++;
    } catch (...) {
      prior = std::current_exception();  // an allocation: every rank throws
    }
  }

  /// The transport's workspace type (options.exchange.work's).
  using workspace_type = std::remove_pointer_t<decltype(options_type{}.exchange.work)>;

  /// The averaging calls, one at a time (the worker's buckets, then finish()'s rest), share one
  /// workspace: opts.exchange.work, or one the call keeps, so that steps allocate no buffers.
  static masked_call over(Group group, std::span<::torch::nn::Module* const> replicas, options_type opts,
                          const module_options& mopts, std::shared_ptr<feedback_state> feedback) {
    std::shared_ptr<workspace_type> own;
    if (opts.exchange.work == nullptr) opts.exchange.work = (own = std::make_shared<workspace_type>()).get();
    return [group, modules = std::vector<::torch::nn::Module*>(replicas.begin(), replicas.end()), opts, mopts,
            feedback, own](const std::vector<std::uint64_t>& masked,
                      const std::vector<::torch::OrderedDict<std::string, at::Tensor>>& params) {
      std::uint64_t call_in_step = 0;  // several calls for parameters of several dtypes
      return detail::average_replicas(
          std::span<::torch::nn::Module* const>(modules), opts.local(), mopts,
          [&](detail::presence& seen, const module_options& m) { detail::agree_presence(group, seen, m); },
          [&](const auto& tg, auto& means, std::vector<at::Tensor>*, std::exception_ptr prior,
              std::span<variable_statistics>) {
            prior = detail::refuse_sharded(opts, prior);
            options_type call = opts;
            if (feedback) keep_feedback(*feedback, masked, call_in_step++, tg, opts, call, prior);
            return group.template average<false>(tg, means, gradavg::detail::no_squares, call, prior);
          },
          &masked, &params);
    };
  }

  static agreement agreement_on(Group group) {
    return [group](std::uint64_t fingerprint, std::exception_ptr failure) {
      group.check();
      if (!failure) failure = group.worker_failure();
      std::uint64_t words[3] = {failure ? 1u : 0u, fingerprint, ~fingerprint};
      group.max_words(words, 3);
      if (failure) std::rethrow_exception(failure);
      if (words[0] != 0)
        throw remote_error(std::string(Group::data_parallel_name) +
                           ": another rank could not set up its replicas (it throws the reason)");
      if (words[1] != ~words[2])
        throw variable_mismatch_error(std::string(Group::data_parallel_name) +
                                      ": the ranks' buckets differ (other models, other parameters requiring "
                                      "gradients, or other bucket_options)");
    };
  }
};

}  // namespace detail

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
