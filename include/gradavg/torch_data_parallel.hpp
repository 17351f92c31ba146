// gradavg: libtorch, averaging while backward runs. data_parallel borrows K replicas of one
// torch::nn::Module (each on its own thread, each with its own slice of the batch) and averages
// their gradients in buckets: as soon as every replica's backward has produced every gradient of a
// bucket, a worker thread averages it (the same call as average_module_gradients, over the
// bucket's parameters), while the backward passes go on with earlier layers. When the last
// backward returns, finish() averages the buckets still waiting beside the worker, then what no
// bucket covered. The weight of an Embedding or EmbeddingBag built with sparse(true) is in no
// bucket: finish() averages its sparse gradients as average_module_gradients does (a coalesced
// sparse mean in every replica's grad()). Across processes (process_data_parallel) such an
// embedding is refused at construction (unsupported_tensor_error on every process).
// Link the CMake target gradavg::torch.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "detail/torch_buckets.hpp"
#include "detail/trace.hpp"
#include "torch.hpp"

namespace gradavg::libtorch {

/// How data_parallel groups parameters into buckets.
struct bucket_options {
  /// A bucket holds consecutive parameters of one dtype, in reverse named_parameters() order (the
  /// order in which backward usually produces them), until their gradients reach this many bytes
  /// on one replica; a larger parameter is a bucket of its own. Smaller buckets start averaging
  /// sooner after their gradients are produced; larger ones cost fewer calls.
  std::size_t bytes = std::size_t{1} << 20;
};

GRADAVG_BEGIN_ISA_NAMESPACE

/// Averages the gradients of K replicas of one model while their backward passes run, with the
/// results of average_module_gradients(replicas, opts, mopts), bit for bit, in every replica's
/// .grad(). Hooks on each parameter's gradient accumulator (the node that writes .grad()) count
/// the gradients produced; the worker thread this object owns averages a bucket once all K
/// replicas have produced all of it. Use, per step:
///
///   zero the gradients; run forward and backward on every replica (each on its own thread);
///   once every backward has returned: const module_report r = dp.finish(); step the optimizers.
///
/// finish() waits for the buckets in flight, then averages every parameter no completed bucket
/// covered (a parameter that took no part in the loss on some replica, a frozen one, or every
/// parameter after a replica's backward threw) through average_module_gradients' rules: skipped
/// when absent on every replica, missing_gradient_error or zeros (module_options::absent_as_zeros)
/// when absent on some. Its report is that of the one-shot call. Buckets cover the parameters that
/// require a gradient when the object is built; the replicas must be alike then (broadcast's
/// checks: names, dtypes, shapes), and must not be rebuilt, moved or re-registered while it lives.
///
/// options.compute.statistics: each bucket's call computes its parameters' sums, and the report
/// adds them up in bucket order, then the rest's (report.global_norm(), clip_coefficient(),
/// noise()): the same bits for any thread count and from step to step for the same averaged values,
/// within rounding of the one-shot call's sums (which add the same terms in another order); across
/// processes the same bits on every rank. module_options::include_square, per_variable and range
/// (results per element or per parameter over one pass of every parameter) are option_error here:
/// use average_module_gradients for them. weights, scale, accumulate, on_nonfinite (counted in the
/// report), threads, pool and stores apply to every bucket.
///
/// Errors: validation runs per bucket, so an error in one bucket (gradients of other memory orders
/// on two replicas, a missing gradient) leaves that bucket's gradients as they were, while buckets
/// averaged before keep their means; finish() throws the failed buckets' error naming the
/// earliest parameter (the rest is then not averaged), else the rest's error, after the step's
/// state is reset (the object stays usable). A gradient produced
/// twice by one replica since the last finish() (two backward passes without no_sync) is an error
/// naming the parameter and the replica. If a replica's backward throws, call abandon() (or
/// finish(), which then reports its missing gradients where they are undefined); nothing waits for
/// a gradient that never comes, so no call hangs.
///
/// Thread-safety: the hooks may run on any thread; construction, finish(), abandon(), no_sync()
/// and destruction run on one thread while no backward of these replicas runs. The destructor
/// removes every hook and joins the worker.
///
/// Across processes: mpi_data_parallel (torch_mpi.hpp), built on the protected constructor below.
class data_parallel {
 public:
  data_parallel(std::span<::torch::nn::Module* const> replicas, const options& opts = {},
                const module_options& mopts = {}, const bucket_options& buckets = {})
      : data_parallel(replicas, opts, mopts, buckets, {}, {}) {}

  /// Any range of replicas: Module*, std::shared_ptr<M> or a ModuleHolder.
  template <replica_range R>
  explicit data_parallel(const R& replicas, const options& opts = {}, const module_options& mopts = {},
                         const bucket_options& buckets = {})
      : data_parallel(std::span<::torch::nn::Module* const>(detail::modules_of(replicas)), opts, mopts, buckets) {}

  data_parallel(const data_parallel&) = delete;
  data_parallel& operator=(const data_parallel&) = delete;

  virtual ~data_parallel() {
    remove_hooks();
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  /// Waits for the buckets in flight, averages the parameters no completed bucket covered, and
  /// returns the report average_module_gradients would (counts, skipped and zero-filled names).
  /// Resets the step's state, on success and on error.
  module_report finish() {
    if (over_) return finish_in_order();
    wait_in_flight();
    step_reset reset{*this};
    check_produced_once();
    std::vector<std::uint64_t> done((parameter_count_ + 63) / 64, 0);
    std::size_t done_count = 0;
    std::vector<const module_report*> reports;
    overlapped_ = 0;
    std::exception_ptr failure;
    for (const bucket& bk : buckets_) {
      overlapped_ += bk.queued ? 1 : 0;
      failure = detail::earlier_in_parameter_order(failure, bk.failure);
    }
    if (failure) std::rethrow_exception(failure);
    for (const bucket& bk : buckets_) {
      if (!bk.queued) continue;
      reports.push_back(&bk.report);
      for (const std::size_t i : bk.parameters) {
        detail::presence::set(done, i);
        ++done_count;
      }
    }
    if (done_count == parameter_count_ && done_count > 0) return merged(reports, 0);
    const auto rest_of = [&](const std::vector<std::uint64_t>& masked) {
      return detail::average_replicas(
          replicas_, opts_, mopts_, [](detail::presence&, const module_options&) {},
          [&](const auto& tg, auto& means, std::vector<at::Tensor>*, std::exception_ptr prior,
              std::span<variable_statistics>) {
            if (prior) std::rethrow_exception(prior);
            return detail::average_into_own_dtypes(tg, means, nullptr, opts_);
          },
          &masked, &params_);
    };
    // Sparse gradients (an Embedding with sparse(true)) among the rest: averaged by the row-sparse
    // call, as average_module_gradients does.
    const std::vector<std::size_t> sparse = detail::sparse_parameters(params_, &done);
    const module_report rest =
        sparse.empty() ? rest_of(done)
                       : detail::average_with_sparse(replicas_, params_, sparse, opts_, mopts_,
                                                     [&](const std::vector<std::uint64_t>* sparse_done) {
                                                       std::vector<std::uint64_t> masked = done;
                                                       for (std::size_t w = 0; w < masked.size(); ++w)
                                                         masked[w] |= (*sparse_done)[w];
                                                       return rest_of(masked);
                                                     });
    reports.push_back(&rest);
    return merged(reports, done_count);
  }

  /// Forgets the step: waits for the buckets in flight (which keep their means) and resets, so
  /// that the next backward starts a new step. For a step whose backward threw on some replica.
  /// Across processes every process's calls must match, so it runs finish() and drops its error.
  void abandon() {
    if (over_) {
      try {
        finish_in_order();
      } catch (const std::exception&) {
        // abandoned: the step's errors are not reported
      }
      return;
    }
    wait_in_flight();
    reset_step();
  }

  /// While a no_sync_scope lives, the hooks count nothing: backward passes accumulate into
  /// .grad() (micro-batches), and the first backward after the scope averages the sums.
  class no_sync_scope {
   public:
    explicit no_sync_scope(data_parallel& owner) noexcept : owner_(&owner) { owner_->sync_.store(false); }
    no_sync_scope(const no_sync_scope&) = delete;
    no_sync_scope& operator=(const no_sync_scope&) = delete;
    ~no_sync_scope() { owner_->sync_.store(true); }

   private:
    data_parallel* owner_;
  };
  [[nodiscard]] no_sync_scope no_sync() noexcept { return no_sync_scope(*this); }

  /// The buckets, each a list of parameter indices (named_parameters() order), in the order the
  /// worker expects them: the first holds the last parameters.
  [[nodiscard]] std::vector<std::vector<std::size_t>> buckets() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.parameters);
    return out;
  }

  /// Buckets of the last finish()ed step that the hooks handed to the worker while backward ran
  /// (the others were averaged by finish()).
  [[nodiscard]] std::size_t overlapped_buckets() const noexcept { return overlapped_; }

 protected:
  /// One call of the module helper over every parameter but the masked ones (bits as
  /// detail::presence's), given the replicas' named_parameters(): across processes, a collective
  /// call.
  using masked_call = std::function<module_report(const std::vector<std::uint64_t>& masked,
                                                  const std::vector<::torch::OrderedDict<std::string, at::Tensor>>&)>;
  /// Called on every process once the buckets are assigned (or assigning them failed), before
  /// any hook: throws on every process when one failed or the processes' buckets differ.
  using agreement = std::function<void(std::uint64_t buckets_fingerprint, std::exception_ptr failure)>;

  /// With over: every bucket, complete or not, runs through over() in bucket order (the order
  /// every process keeps), the worker waiting for each until it is complete or finish() is
  /// called; then, in finish(), the parameters no bucket holds.
  data_parallel(std::span<::torch::nn::Module* const> replicas, const options& opts, const module_options& mopts,
                const bucket_options& buckets, masked_call over, const agreement& agree)
      : replicas_(replicas.begin(), replicas.end()), opts_(opts), mopts_(mopts), over_(std::move(over)) {
    std::exception_ptr failure;
    try {
      detail::check_bucket_options(opts_, mopts_);
      params_ = detail::alike_states(replicas_, detail::state_kind::parameters);
      parameter_count_ = params_.empty() ? 0 : params_[0].size();
      // On threads, a sparse embedding's weight stays out of the buckets: finish() averages it.
      // Across processes, sparse gradients are not averaged yet: refused here, on every process.
      std::vector<std::uint64_t> sparse;
      if (!params_.empty()) sparse = detail::sparse_weights(*replicas_[0], params_[0]);
      for (std::size_t i = 0; over_ && i < parameter_count_; ++i)
        if (detail::presence::has(sparse, i))
          throw unsupported_tensor_error("gradavg::libtorch: parameter #" + std::to_string(i) + " '" + params_[0][i].key() +
                                             "' is the weight of an embedding built with sparse(true), whose gradients "
                                             "are sparse; across processes gradavg averages dense gradients only "
                                             "(build it with sparse(false))",
                                         i);
      if (!params_.empty())
        for (auto& parameters : detail::assign_buckets(params_[0], buckets.bytes, &sparse)) {
          buckets_.emplace_back();
          buckets_.back().parameters = std::move(parameters);
        }
    } catch (...) {
      failure = std::current_exception();
    }
    if (agree) agree(detail::buckets_fingerprint(parameter_count_, this->buckets()), failure);
    if (failure) std::rethrow_exception(failure);
    for (auto& b : buckets_) max_bucket_ = std::max(max_bucket_, b.parameters.size());
    for (scratch* s : {&worker_scratch_, &caller_scratch_}) {
      s->towers.resize(replicas_.size());
      for (auto& t : s->towers) t.reserve(max_bucket_);
      s->means.reserve(max_bucket_);
    }
    if (over_) assign_masks();
    ready_.reserve(buckets_.size());
    produced_ = std::make_unique<std::atomic<std::uint8_t>[]>(replicas_.size() * parameter_count_);
    pending_ = std::make_unique<std::atomic<std::size_t>[]>(buckets_.size());
    reset_step();
    add_hooks();
    worker_ = std::thread([this] { work(); });
  }

 private:
  struct bucket {
    std::vector<std::size_t> parameters;
    bool queued = false;
    std::exception_ptr failure;
    module_report report;                // the bucket's call's report
    std::vector<std::uint64_t> masked;   // across processes: every parameter but this bucket's
  };

  /// Called by the hook of replica k's parameter i once its .grad() holds this backward's sum.
  class ready_hook final : public ::torch::autograd::FunctionPostHook {
   public:
    ready_hook(data_parallel& owner, std::size_t replica, std::size_t parameter, std::size_t bucket) noexcept
        : owner_(&owner), replica_(replica), parameter_(parameter), bucket_(bucket) {}
    ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                                const ::torch::autograd::variable_list&) override {
      owner_->produced(replica_, parameter_, bucket_);
      return outputs;
    }

   private:
    data_parallel* owner_;
    std::size_t replica_, parameter_, bucket_;
  };

  /// The towers and outputs of one bucket's call, kept from call to call.
  struct scratch {
    std::vector<std::vector<std::pair<at::Tensor, std::string_view>>> towers;
    std::vector<at::Tensor> means;
  };

  struct hook_handle {
    std::shared_ptr<::torch::autograd::Node> accumulator;
    std::uintptr_t key;
  };

  /// Resets the step's state when finish() returns or throws.
  struct step_reset {
    data_parallel& owner;
    ~step_reset() { owner.reset_step(); }
  };

  void add_hooks();

  void remove_hooks() noexcept {
    for (auto& h : hooks_) h.accumulator->del_post_hook(h.key);
    hooks_.clear();
  }

  void produced(std::size_t replica, std::size_t parameter, std::size_t b) {
    if (!sync_.load()) return;
    std::atomic<std::uint8_t>& seen = produced_[replica * parameter_count_ + parameter];
    if (seen.exchange(1) != 0) {  // a second backward: finish() reports it
      seen.store(2);
      return;
    }
    if (pending_[b].fetch_sub(1) != 1) return;
    if (timeline* const line = opts_.run.timeline) {
      // The moment backward completed the bucket (an event of no duration, on the hook's thread).
      const std::uint64_t now = timeline::now();
      line->record(lane::other, "bucket ready", now, now, static_cast<std::int64_t>(b));
    }
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      buckets_[b].queued = true;
      ready_.push_back(b);  // reserved for every bucket: no allocation
    }
    wake_.notify_all();
  }

  void work() {
    if (over_) return work_in_order();
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || next_ < ready_.size(); });
      if (next_ < ready_.size()) {
        average_next(lock, worker_scratch_);
        continue;
      }
      if (stop_) return;
    }
  }

  /// Across processes: bucket after bucket in bucket order, each once it is complete here or
  /// backward has ended (finish()), through over().
  void work_in_order();

  /// finish() across processes: every bucket through over() (the worker), then the parameters no
  /// bucket holds (here), then the reports merged in named_parameters() order; the first error
  /// thrown once every call has run, so that every process runs the same calls.
  module_report finish_in_order();

  /// detail::merged_report over this object's parameters and options.
  module_report merged(const std::vector<const module_report*>& reports, std::size_t masked) const {
    return detail::merged_report(reports, masked, opts_.compute.statistics, params_.empty() ? nullptr : &params_[0]);
  }

  /// Throws for a gradient that a replica produced more than once since the last finish().
  void check_produced_once() const;

  /// Across processes: each bucket's mask (every parameter but its own), and the mask of the
  /// parameters no bucket holds (empty when every parameter is in a bucket).
  void assign_masks();

  /// Takes the next ready bucket (lock held on entry and on return) and averages it unlocked.
  void average_next(std::unique_lock<std::mutex>& lock, scratch& s) {
    const std::size_t b = ready_[next_++];
    lock.unlock();
    average_bucket(buckets_[b], s);
    lock.lock();
    ++finished_;
    idle_.notify_all();
  }

  /// The bucket's parameters averaged as average_module_gradients averages them: in place into
  /// replica 0's gradients, then copied into the other replicas' (as module_options::means_to says).
  void average_bucket(bucket& bk, scratch& s) noexcept;

  /// Returns once every bucket handed to the worker is averaged; the calling thread averages
  /// buckets that still wait, beside the worker.
  void wait_in_flight() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (next_ < ready_.size()) average_next(lock, caller_scratch_);
    idle_.wait(lock, [&] { return finished_ == ready_.size(); });
  }

  void reset_step() noexcept;

  std::vector<::torch::nn::Module*> replicas_;
  options opts_;
  module_options mopts_;
  std::vector<::torch::OrderedDict<std::string, at::Tensor>> params_;
  std::size_t parameter_count_ = 0;
  std::vector<bucket> buckets_;
  std::size_t max_bucket_ = 0;
  std::vector<hook_handle> hooks_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> produced_;
  std::unique_ptr<std::atomic<std::size_t>[]> pending_;
  std::atomic<bool> sync_{true};
  std::size_t overlapped_ = 0;
  masked_call over_;
  std::vector<std::uint64_t> rest_mask_;
  std::size_t bucketed_count_ = 0;

  // The worker's queue: ready_[next_..) waits, ready_[..finished_) is done.
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::vector<std::size_t> ready_;
  std::size_t next_ = 0, finished_ = 0;
  std::size_t in_order_next_ = 0;  // across processes: the next bucket in bucket order
  bool backward_ended_ = false;    // across processes: finish() called
  bool stop_ = false;
  std::thread worker_;
  scratch worker_scratch_, caller_scratch_;
};

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch

#include "detail/data_parallel_inl.hpp"
