// gradavg::c10d's vocabulary (included by <gradavg/c10d.hpp>): its exception, options and
// workspace, shared by every instruction-set level.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "detail/processes/workspace.hpp"
#include "errors.hpp"
#include "options.hpp"

namespace gradavg {

/// A process group cannot be made (a torchrun variable missing or malformed, a store or peer out
/// of reach within the timeout), or one of its operations failed or timed out (a peer that died
/// or stopped calling): the message names the variable, the operation, or the engine's own words.
/// After one from a call, the process group is in an unknown state: end the job (as with gloo and
/// NCCL in PyTorch), do not call it again.
class c10d_error : public error {
  using error::error;
};

namespace c10d {

/// Bytes of one bucket's fusion buffer when options.exchange.fusion_bytes is 0 (the default), on a
/// group of `ranks` processes: gradavg::mpi's choice, 1 MiB or 256 KiB per rank where that is more,
/// at most 16 MiB. Measured by gradavg_bench_c10d (ResNet-50, 2 ranks): on an emulated 1 or
/// 2.5 Gbit link, 1 MiB buckets keep the exchange within 1-6% of gloo's allreduce where 4 or
/// 16 MiB take 3-18%; on one host, where every gloo operation's latency of about a hundred
/// microseconds weighs, 16 MiB buckets take half the time of 1 MiB ones: pass fusion_bytes there.
constexpr std::size_t automatic_fusion_bytes(int ranks) noexcept {
  const std::size_t per_rank = (std::size_t{256} << 10) * static_cast<std::size_t>(ranks > 0 ? ranks : 1);
  return std::min(std::max(std::size_t{1} << 20, per_rank), std::size_t{16} << 20);
}

class workspace;

namespace shared_detail {

/// What a workspace keeps: the calls' tables and fusion buffers, and per bucket in flight the
/// process group's operations under way (detail/c10d/transport.hpp).
struct buffers : gradavg::shared_detail::process_buffers {
  std::vector<std::vector<c10::intrusive_ptr<::c10d::Work>>> pending;
};

/// c10d_error naming the operation and the engine's own words (a c10::Error's message without its
/// C++ backtrace).
[[noreturn]] inline void rethrow_as_c10d_error(std::string_view operation, std::exception_ptr failure) {
  std::string words;
  try {
    std::rethrow_exception(failure);
  } catch (const ::c10::Error& e) {
    words = e.what_without_backtrace();
  } catch (const std::exception& e) {
    words = e.what();
  } catch (...) {
    words = "an exception that is not a std::exception";
  }
  std::string message = "gradavg::c10d: ";
  message.append(operation).append(" failed: ").append(words);
  throw c10d_error(message);
}

/// Runs f, a process group operation that may throw, as c10d_error.
template <class F>
decltype(auto) guarded(std::string_view operation, F&& f) {
  try {
    return f();
  } catch (...) {
    rethrow_as_c10d_error(operation, std::current_exception());
  }
}

/// The calls' way in (every level's).
struct access {
  static buffers& of(workspace& w) noexcept;
};

}  // namespace shared_detail

/// Buffers reused from call to call (no growth once they have a layout's size; the process
/// group still allocates a Work object per operation).
class workspace {
 public:
  workspace() = default;

 private:
  friend struct shared_detail::access;
  shared_detail::buffers held;
};

inline shared_detail::buffers& shared_detail::access::of(workspace& w) noexcept { return w.held; }

/// How the buckets move between the ranks: gradavg::mpi::exchange_options' fields of the same
/// names, with the same meaning (mpi_options.hpp). The moves are the group's send / recv, tags
/// 0x474100 to 0x4741ff (code that receives on the group from any source while the call runs must
/// give gradavg a group of its own).
struct exchange_options {
  std::size_t fusion_bytes = 0;
  gradavg::compression compression = gradavg::compression::none;
  gradavg::output_mode output = gradavg::output_mode::replicated;
  /// How row-sparse gradients travel (gradavg::sparse_wire): rows or dense, by their bytes.
  gradavg::sparse_wire sparse = gradavg::sparse_wire::automatic;
  std::span<float> residual = {};
  std::uint64_t seed = 0;
  /// Error feedback kept by libtorch::c10d_data_parallel (gradavg::error_feedback); off for a
  /// direct call.
  error_feedback feedback = error_feedback::off;
  /// Buffers kept between calls; not owned. Null: the call allocates its own.
  workspace* work = nullptr;
};

/// gradavg::options' groups and exchange_options (gradavg::process_options).
using options = gradavg::process_options<exchange_options>;

}  // namespace c10d
}  // namespace gradavg
