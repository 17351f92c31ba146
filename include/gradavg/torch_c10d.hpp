// gradavg: libtorch across the ranks of a c10d::ProcessGroup (gradavg::c10d, gloo): the module
// helpers of torch_processes.hpp (broadcast_buffers, broadcast_parameters,
// average_module_gradients, and c10d_data_parallel) with a process group as their first argument.
// Link the CMake target gradavg::c10d.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <type_traits>
#include <vector>

#include "c10d.hpp"
#include "torch_processes.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// A process group as the module helpers' group: its allreduce (MAX, BOR) and broadcast, and the
/// call of gradavg::c10d. Its worker thread may call the group (this rank's other threads must not
/// meanwhile).
struct c10d_group {
  ::c10d::ProcessGroup* group;

  using options_type = gradavg::c10d::options;
  static constexpr const char* data_parallel_name = "gradavg::libtorch::c10d_data_parallel";

  c10d_group(::c10d::ProcessGroup& g) noexcept : group(&g) {}  // NOLINT(google-explicit-constructor)

  void check() const noexcept {}
  [[nodiscard]] int rank() const { return group->getRank(); }
  [[nodiscard]] int ranks() const { return group->getSize(); }
  void max_words(std::uint64_t* words, std::size_t n) const {
    gradavg::c10d::detail::reduce_words(*group, words, n, ::c10d::ReduceOp::MAX);
  }
  void or_words(std::uint64_t* words, std::size_t n) const {
    gradavg::c10d::detail::reduce_words(*group, words, n, ::c10d::ReduceOp::BOR);
  }
  void broadcast(std::byte* bytes, std::size_t n, int root) const {
    gradavg::c10d::shared_detail::guarded("broadcast", [&] {
      std::vector<at::Tensor> tensors{gradavg::c10d::detail::bytes_tensor(bytes, n)};
      ::c10d::BroadcastOptions how;
      how.rootRank = root;
      group->broadcast(tensors, how)->wait();
    });
  }
  [[nodiscard]] std::exception_ptr worker_failure() const noexcept { return nullptr; }
  template <bool SameElements, class TG, class Means, class Squares>
  summary average(const TG& tg, Means& means, Squares* squares, const options_type& opts,
                  std::exception_ptr prior) const {
    return gradavg::c10d::detail::average_into<SameElements>(*group, tg, means, squares, opts, prior);
  }
};

/// Every process group: c10d::ProcessGroup and its backends (ProcessGroupGloo, ...).
template <class G>
struct process_group_traits<G, std::enable_if_t<std::is_base_of_v<::c10d::ProcessGroup, G>>> {
  using type = c10d_group;
};

}  // namespace detail

/// data_parallel across the ranks of a process group (torch_processes.hpp's
/// process_data_parallel): c10d_data_parallel(group, replicas, gradavg::c10d::options,
/// module_options, bucket_options).
using c10d_data_parallel = detail::process_data_parallel<detail::c10d_group>;

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
