// gradavg internals: the bodies of data_parallel's hook, worker and step machinery
// (<gradavg/torch_data_parallel.hpp> declares them with their contracts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE

inline void data_parallel::add_hooks() {
  try {
    for (std::size_t k = 0; k < replicas_.size(); ++k)
      for (std::size_t b = 0; b < buckets_.size(); ++b)
        for (const std::size_t i : buckets_[b].parameters) {
          const at::Tensor& p = params_[k][i].value();
          if (!p.requires_grad())
            throw variable_mismatch_error("gradavg::libtorch::data_parallel: parameter #" + std::to_string(i) + " '" +
                                              params_[0][i].key() + "' requires a gradient on replica 0 but not on replica " +
                                              std::to_string(k),
                                          i);
          auto accumulator = ::torch::autograd::impl::grad_accumulator(p);
          const std::uintptr_t key = accumulator->add_post_hook(std::make_unique<ready_hook>(*this, k, i, b));
          hooks_.push_back({std::move(accumulator), key});
        }
  } catch (...) {
    remove_hooks();
    throw;
  }
}

inline void data_parallel::work_in_order() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] {
      return stop_ || (in_order_next_ < buckets_.size() && (buckets_[in_order_next_].queued || backward_ended_));
    });
    if (stop_) return;
    bucket& bk = buckets_[in_order_next_];
    lock.unlock();
    try {
      const shared_detail::traced_span span(opts_.run.timeline, "average bucket", &bk - buckets_.data());
      bk.report = over_(bk.masked, params_);
    } catch (...) {
      bk.failure = std::current_exception();
    }
    lock.lock();
    ++in_order_next_;
    idle_.notify_all();
  }
}

inline module_report data_parallel::finish_in_order() {
  std::unique_lock<std::mutex> lock(mutex_);
  backward_ended_ = true;
  wake_.notify_all();
  idle_.wait(lock, [&] { return in_order_next_ == buckets_.size(); });
  lock.unlock();
  step_reset reset{*this};
  std::exception_ptr failure;
  std::vector<const module_report*> reports;
  std::size_t masked_total = 0;
  overlapped_ = 0;
  for (const bucket& bk : buckets_) {
    overlapped_ += bk.queued ? 1 : 0;
    failure = detail::earlier_in_parameter_order(failure, bk.failure);
    reports.push_back(&bk.report);
    masked_total += parameter_count_ - bk.parameters.size();
  }
  module_report rest;
  if (!rest_mask_.empty()) {
    try {
      rest = over_(rest_mask_, params_);
    } catch (...) {
      failure = detail::earlier_in_parameter_order(failure, std::current_exception());
    }
    reports.push_back(&rest);
    masked_total += bucketed_count_;
  }
  if (failure) std::rethrow_exception(failure);
  check_produced_once();
  return merged(reports, masked_total);
}

inline void data_parallel::check_produced_once() const {
  for (std::size_t k = 0; k < replicas_.size(); ++k)
    for (std::size_t i = 0; i < parameter_count_; ++i)
      if (produced_[k * parameter_count_ + i].load(std::memory_order_relaxed) > 1)
        throw error("gradavg::libtorch::data_parallel: replica " + std::to_string(k) + " produced the gradient of " +
                        "parameter #" + std::to_string(i) + " '" + params_[0][i].key() +
                        "' more than once since the last finish(); run one backward per replica per step, or "
                        "accumulate micro-batches under no_sync()",
                    i);
}

inline void data_parallel::assign_masks() {
  const std::size_t words = (parameter_count_ + 63) / 64;
  std::vector<std::uint64_t> bucketed(words, 0);
  for (bucket& b : buckets_) {
    b.masked.assign(words, 0);
    for (std::size_t i = 0; i < parameter_count_; ++i) detail::presence::set(b.masked, i);
    for (const std::size_t i : b.parameters) {
      b.masked[i / 64] &= ~(std::uint64_t{1} << (i % 64));
      detail::presence::set(bucketed, i);
      ++bucketed_count_;
    }
  }
  if (bucketed_count_ < parameter_count_) rest_mask_ = std::move(bucketed);
}

inline void data_parallel::average_bucket(bucket& bk, scratch& s) noexcept {
  const shared_detail::traced_span span(opts_.run.timeline, "average bucket", &bk - buckets_.data());
  try {
    s.towers.resize(replicas_.size());
    for (std::size_t k = 0; k < replicas_.size(); ++k) {
      auto& tower = s.towers[k];
      tower.clear();
      for (const std::size_t i : bk.parameters)
        tower.emplace_back(params_[k][i].value().grad(), std::string_view(params_[k][i].key()));
    }
    s.means.clear();
    for (const auto& e : s.towers[0]) s.means.push_back(e.first);
    bk.report.report = detail::average_into_own_dtypes(s.towers, s.means, nullptr, opts_);
    const shared_detail::traced_span copies(opts_.run.timeline, "copies", &bk - buckets_.data());
    detail::copy_to_replicas(s.towers, s.means, 1, detail::receiving_replicas(mopts_, replicas_.size()), opts_);
  } catch (...) {
    bk.failure = std::current_exception();
  }
}

inline void data_parallel::reset_step() noexcept {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    ready_.clear();
    next_ = 0;
    finished_ = 0;
    in_order_next_ = 0;
    backward_ended_ = false;
  }
  for (std::size_t i = 0; i < replicas_.size() * parameter_count_; ++i) produced_[i].store(0);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].queued = false;
    buckets_[b].failure = nullptr;
    buckets_[b].report = module_report{};
    pending_[b].store(replicas_.size() * buckets_[b].parameters.size());
  }
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
