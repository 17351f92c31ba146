// gradavg: libtorch. torch::Tensor gradients and outputs, and the gradients of K replicas of a
// torch::nn::Module averaged in place (data parallelism with threads as replicas, which the C++
// frontend has no helper for on CPU). Link the CMake target gradavg::torch.
//
// torch::Tensor (at::Tensor) as a tensor (tensor.hpp), with a run-time element type:
//   - undefined (a parameter that took no part in the loss: grad() undefined) = absent;
//   - CPU, strided (dense) and contiguous, of dtype float, double, half or bfloat16 (at::kHalf is
//     read as Eigen::half, at::kBFloat16 as Eigen::bfloat16: the same bit layouts); outputs of
//     the gradients' dtype, or float for half and bfloat16;
//   - anything else is gradavg's error naming the variable and the tower: another dtype
//     (element_type_error), another device or a sparse tensor (unsupported_tensor_error), a
//     non-contiguous tensor (shape_error; output_error for an output), more than 8 dimensions
//     (shape_error). One call reads one dtype (tensor.hpp); mixing them is element_type_error.
//   - The allocating API returns CPU tensors of the gradients' dtype.
// torch::Tensor as a variable: the same TensorImpl on every tower (a shared parameter); printed
// as its dtype and sizes, never its elements. Replicas that hold parameters of their own are
// averaged through names: average_module_gradients below.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <ostream>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "average.hpp"
#include "detail/isa.hpp"
#include "entry.hpp"
#include "errors.hpp"
#include "options.hpp"
#include "statistics.hpp"
#include "tensor.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE

namespace torch_detail {

/// Throws unsupported_tensor_error unless t is a dense CPU tensor.
inline void check_readable(const at::Tensor& t) {
  if (!t.device().is_cpu())
    throw unsupported_tensor_error("a tensor on device " + t.device().str() +
                                   "; gradavg reads CPU tensors (copy it with .cpu(), or average on the device)");
  if (t.layout() != at::kStrided)
    throw unsupported_tensor_error("a sparse (non-strided) tensor; gradavg reads dense tensors (.to_dense())");
}

inline element_type element_of(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return element_type::float32;
    case at::kDouble: return element_type::float64;
    case at::kHalf: return element_type::float16;
    case at::kBFloat16: return element_type::bfloat16;
    default: break;
  }
  throw element_type_error(std::string("a tensor of dtype ") + c10::toString(s) +
                           "; gradavg reads Float, Double, Half and BFloat16 tensors");
}

inline at::ScalarType scalar_type_of(element_type e) noexcept {
  switch (e) {
    case element_type::float64: return at::kDouble;
    case element_type::float16: return at::kHalf;
    case element_type::bfloat16: return at::kBFloat16;
    case element_type::float32: break;
  }
  return at::kFloat;
}

}  // namespace torch_detail

template <>
struct tensor_traits<at::Tensor> {
  using value_type = dynamic_element;
  using result_type = at::Tensor;

  static bool present(const at::Tensor& t) noexcept { return t.defined(); }
  static element_type element(const at::Tensor& t) {
    torch_detail::check_readable(t);
    return torch_detail::element_of(t.scalar_type());
  }
  static const void* data(const at::Tensor& t) {
    torch_detail::check_readable(t);
    return t.data_ptr();
  }
  static void* mutable_data(at::Tensor& t) {
    torch_detail::check_readable(t);
    return t.data_ptr();
  }
  static gradavg::shape shape(const at::Tensor& t) {
    const auto sizes = t.sizes();
    return gradavg::shape::from_dims(std::span<const std::int64_t>(sizes.data(), sizes.size()));
  }
  static bool contiguous(const at::Tensor& t) { return t.is_contiguous(); }
  static result_type make(const gradavg::shape& s, element_type e) {
    return at::empty(at::IntArrayRef(s.dims.data(), s.rank), at::TensorOptions().dtype(torch_detail::scalar_type_of(e)));
  }
};

template <>
struct variable_traits<at::Tensor> {
  /// The same parameter: the same TensorImpl.
  static bool same(const at::Tensor& a, const at::Tensor& b) noexcept {
    return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
  }
  /// "Float[3, 4] at 0x5581c0a3e2f0" (its TensorImpl, what same() compares: two parameters of one
  /// dtype and shape print apart), "undefined tensor": never the elements.
  static void print(std::ostream& os, const at::Tensor& t) {
    if (!t.defined()) {
      os << "undefined tensor";
      return;
    }
    os << c10::toString(t.scalar_type()) << '[';
    for (std::int64_t d = 0; d < t.dim(); ++d) os << (d ? ", " : "") << t.size(d);
    os << "] at " << static_cast<const void*>(t.unsafeGetTensorImpl());
  }
};

namespace libtorch {

/// What average_module_gradients did.
struct module_report {
  /// Counts and fused statistics of the call (average.hpp). report.towers is the replica count.
  gradavg::summary report;
  /// Parameters left alone because no replica has a gradient for them: requires_grad false (frozen)
  /// or grad() undefined (took no part in the loss) on every replica. In named_parameters() order.
  std::vector<std::string> skipped;
};

namespace detail {

/// The module behind a Module*, a std::shared_ptr<Module> or a ModuleHolder (torch::nn::Linear).
template <class M>
::torch::nn::Module* module_of(const M& m) {
  if constexpr (std::is_pointer_v<M>)
    return m;
  else if constexpr (requires { m.ptr(); })
    return m.is_empty() ? nullptr : m.ptr().get();
  else
    return m.get();
}

/// The replicas' parameters as towers of (gradient, name) entries, averaged by
/// average(towers, means, prior) in place into replica 0's gradients, then copied to the other
/// replicas. prior: what gathering the entries threw (a null replica, an allocation), for the
/// averaging call to rethrow, after agreeing on it with the other processes where there are any.
template <class Average>
module_report average_replicas(std::span<::torch::nn::Module* const> replicas, Average&& average) {
  const std::size_t k_count = replicas.size();
  // named_parameters() holds the names; the entries view them.
  std::vector<::torch::OrderedDict<std::string, at::Tensor>> params;
  std::vector<std::vector<std::pair<at::Tensor, std::string_view>>> tg;
  std::vector<at::Tensor> means;
  std::exception_ptr prior;
  try {
    for (std::size_t k = 0; k < k_count; ++k)
      if (replicas[k] == nullptr) throw tower_error("gradavg: replica " + std::to_string(k) + " is null");
    params.reserve(k_count);
    for (auto* m : replicas) params.push_back(m->named_parameters(/*recurse=*/true));
    tg.resize(k_count);
    for (std::size_t k = 0; k < k_count; ++k) {
      tg[k].reserve(params[k].size());
      for (const auto& item : params[k]) {
        const at::Tensor& p = item.value();
        tg[k].emplace_back(p.requires_grad() ? p.grad() : at::Tensor(), std::string_view(item.key()));
      }
    }
    // In place: each mean is replica 0's gradient (undefined where the parameter is skipped).
    if (k_count > 0) {
      means.reserve(tg[0].size());
      for (const auto& e : tg[0]) means.push_back(e.first);
    }
  } catch (...) {
    prior = std::current_exception();
    tg.clear();
    means.clear();
  }
  module_report result;
  result.report = average(tg, means, prior);
  for (std::size_t i = 0; i < means.size(); ++i) {
    if (!means[i].defined()) {
      result.skipped.emplace_back(tg[0][i].second);
      continue;
    }
    for (std::size_t k = 1; k < k_count; ++k) tg[k][i].first.copy_(means[i]);
  }
  return result;
}

}  // namespace detail

/// Averages the gradients of K replicas of one model (each a clone() trained on its own slice of
/// the batch, on its own thread) into replica 0's .grad() tensors, in place, and copies the result
/// into every other replica's, so each replica's optimizer takes the same step.
///
/// Variables are the parameters in named_parameters() order (recursively), named in messages;
/// every replica must list the same names in the same order (variable_mismatch_error, or
/// tower_error for different counts: towers are replicas). A parameter whose requires_grad is
/// false counts as having no gradient. A parameter without a gradient on every replica is skipped
/// and listed in the report; without one on some replicas only, it is missing_gradient_error. The
/// gradients must be as torch::Tensor gradients (see the file comment): one dtype, CPU, contiguous,
/// the same shapes. Everything is checked before anything is written. options pass through
/// (threads, the fused statistics); options.per_variable, when given, has one entry per
/// parameter, skipped ones included. A null replica is a tower_error.
inline module_report average_module_gradients(std::span<::torch::nn::Module* const> replicas,
                                              const options& opts = {}) {
  return detail::average_replicas(replicas, [&](const auto& tg, auto& means, std::exception_ptr prior) {
    if (prior) std::rethrow_exception(prior);
    return average_gradients_into(tg, means, opts);
  });
}

/// The same for any range of replicas: Module*, std::shared_ptr<M> or a ModuleHolder (the
/// torch::nn::Linear-style handles TORCH_MODULE defines).
template <std::ranges::random_access_range R>
  requires(!std::is_convertible_v<const R&, std::span<::torch::nn::Module* const>>) &&
          requires(const std::ranges::range_value_t<R>& m) {
            { detail::module_of(m) } -> std::convertible_to<::torch::nn::Module*>;
          }
module_report average_module_gradients(const R& replicas, const options& opts = {}) {
  std::vector<::torch::nn::Module*> modules;
  for (const auto& m : replicas) modules.push_back(detail::module_of(m));
  return average_module_gradients(std::span<::torch::nn::Module* const>(modules), opts);
}

}  // namespace libtorch

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
