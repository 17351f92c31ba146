// gradavg: torch::Tensor (at::Tensor) as a tensor and as a variable of gradavg's calls (the
// vocabulary, shared by every instruction-set level). <gradavg/torch.hpp> includes it, with the
// module helpers; link the CMake target gradavg::torch.
//
// torch::Tensor (at::Tensor) as a tensor (tensor.hpp), with a run-time element type:
//   - undefined (a parameter that took no part in the loss: grad() undefined) = absent;
//   - CPU, strided layout, non-overlapping and dense (is_non_overlapping_and_dense(): contiguous,
//     channels_last, or any other permutation of the dimensions), of dtype float, double, half or
//     bfloat16 (at::kHalf is read as Eigen::half, at::kBFloat16 as Eigen::bfloat16: the same bit
//     layouts); outputs of the gradients' dtype, or float for half and bfloat16;
//   - read as the dense array its memory holds: data() is data_ptr(), the lowest address (libtorch
//     has no negative strides), and the shape is its memory-order shape (memory_order_shape
//     below): a channels_last NCHW tensor reads as row-major [N, H, W, C]. Tensors of one memory
//     order agree with each other; a gradient or output of another memory order is a shape_error
//     (output_error) naming both memory-order shapes: its elements lie in another order;
//   - messages name a tensor's shape by its sizes, and by its strides and memory-order shape
//     where it is not contiguous (tensor_traits<at::Tensor>::describe);
//   - anything else is gradavg's error naming the variable and the tower: another dtype
//     (element_type_error), another device or a sparse tensor (unsupported_tensor_error), a
//     strided tensor with gaps or overlaps (shape_error "not contiguous (strided)"; output_error
//     for an output), more than 8 dimensions (shape_error). One call reads one dtype (tensor.hpp);
//     mixing them is element_type_error (the module helpers group parameters by dtype instead).
//   - The allocating API returns contiguous CPU tensors of the gradients' dtype and memory-order
//     shape (a channels_last gradient's mean as [N, H, W, C]).
// torch::Tensor as a variable: the same TensorImpl on every tower (a shared parameter); printed
// as its dtype and sizes, never its elements.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>

#include "entry.hpp"
#include "errors.hpp"
#include "tensor.hpp"

namespace gradavg {

namespace shared_detail {

/// Throws unsupported_tensor_error unless t is a dense CPU tensor.
inline void check_readable(const at::Tensor& t) {
  if (!t.device().is_cpu())
    throw unsupported_tensor_error("a tensor on device " + t.device().str() +
                                   "; gradavg reads CPU tensors (copy it with .cpu(), or average on the device)");
  if (t.layout() != at::kStrided)
    throw unsupported_tensor_error(
        "a sparse (non-strided) tensor; gradavg reads dense tensors here (.to_dense()), and row-sparse ones with "
        "gradavg::libtorch::average_sparse_gradients_into (gradavg/torch_sparse.hpp)");
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

/// The sizes of t in the order its elements lie in memory, as gradavg compares and copies them:
/// t's own sizes when t is contiguous, or when it is not dense (the tensor is then rejected as
/// strided) or empty; otherwise its dimensions of extent 1 (whose strides say nothing) in their
/// order, then the others by decreasing stride. So two dense tensors of the same sizes have the
/// same memory-order shape exactly when their elements lie in the same order. Throws shape_error
/// for more than shape::max_rank dimensions.
inline shape memory_order_shape(const at::Tensor& t) {
  const auto sizes = t.sizes();
  shape s = shape::from_dims(std::span<const std::int64_t>(sizes.data(), sizes.size()));
  if (t.numel() == 0 || t.is_contiguous() || !t.is_non_overlapping_and_dense()) return s;
  const auto strides = t.strides();
  std::array<std::size_t, shape::max_rank> order{};
  for (std::size_t d = 0; d < s.rank; ++d) order[d] = d;
  const auto first = order.begin();
  std::stable_sort(first, first + static_cast<std::ptrdiff_t>(s.rank), [&](std::size_t a, std::size_t b) {
    if ((sizes[a] == 1) != (sizes[b] == 1)) return sizes[a] == 1;
    return sizes[a] != 1 && strides[a] > strides[b];
  });
  for (std::size_t d = 0; d < s.rank; ++d) s.dims[d] = sizes[order[d]];
  return s;
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

}  // namespace shared_detail

template <>
struct tensor_traits<at::Tensor> {
  using value_type = dynamic_element;
  using result_type = at::Tensor;

  static bool present(const at::Tensor& t) noexcept { return t.defined(); }
  static element_type element(const at::Tensor& t) {
    shared_detail::check_readable(t);
    return shared_detail::element_of(t.scalar_type());
  }
  static const void* data(const at::Tensor& t) {
    shared_detail::check_readable(t);
    return t.data_ptr();
  }
  static void* mutable_data(at::Tensor& t) {
    shared_detail::check_readable(t);
    return t.data_ptr();
  }
  /// The memory-order shape (shared_detail::memory_order_shape).
  static gradavg::shape shape(const at::Tensor& t) { return shared_detail::memory_order_shape(t); }
  /// Dense: no gaps, no overlaps, in any memory order.
  static bool contiguous(const at::Tensor& t) { return t.is_non_overlapping_and_dense(); }
  /// How messages name t's shape: its sizes, as libtorch prints them, then, when they are not the
  /// contiguous ones, its strides and the memory-order shape gradavg reads ("[32, 8] with strides
  /// [1, 32], memory order [8, 32]").
  static std::string describe(const at::Tensor& t) {
    std::string s = c10::str(t.sizes());
    if (t.is_contiguous()) return s;
    const gradavg::shape m = shared_detail::memory_order_shape(t);
    return s + " with strides " + c10::str(t.strides()) + ", memory order " +
           c10::str(at::IntArrayRef(m.dims.data(), m.rank));
  }
  static result_type make(const gradavg::shape& s, element_type e) {
    return at::empty(at::IntArrayRef(s.dims.data(), s.rank), at::TensorOptions().dtype(shared_detail::scalar_type_of(e)));
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

}  // namespace gradavg
