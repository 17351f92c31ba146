// gradavg: the tensor customisation point.
//
// A gradient (or output) is any type T for which gradavg::tensor_traits<T> is specialised with:
//
//   using value_type = ...;                        // float, double, Eigen::half or Eigen::bfloat16
//   static const value_type* data(const T&);      // first element; elements are contiguous
//   static gradavg::shape shape(const T&);        // dimensions and storage order
// and, optionally:
//   static value_type* mutable_data(T&);          // makes T usable as an output
//   static bool contiguous(const T&);             // false rejects the tensor (default: true)
//   static bool present(const T&);                // false: no value, the seed's None, as a null
//                                                 // slot is (default: true); e.g. an undefined
//                                                 // framework tensor
//   using result_type = ...;                       // owning type the allocating API returns
//   static result_type make(const gradavg::shape&);  // allocate one of that shape
//   static constexpr bool view = true;             // T does not own its elements (a span, a
//                                                  // map): then it may be yielded by value (entry.hpp)
//   static std::string describe(const T&);         // how error messages name its shape, in the
//                                                  // words of T's own library (default: gradavg's
//                                                  // shape, "[3, 4] row-major"); called only to
//                                                  // build a message
//
// Run-time element types (a framework tensor whose dtype is a run-time property): instead of a
// fixed value_type,
//   using value_type = gradavg::dynamic_element;
//   static gradavg::element_type element(const T&);   // float32, float64, float16, bfloat16
//   static const void* data(const T&);
//   static void* mutable_data(T&);                     // optional, as above
//   static result_type make(const gradavg::shape&, gradavg::element_type);  // optional, as above
// One call reads every present gradient as one element type: all gradients of a call (every
// variable, every tower) must have the same element type, and every output that is written the
// gradients' type, or float32 for 16-bit gradients, as with fixed types (element_type_error,
// output_error, naming the variable and the towers). The call then runs the kernel of that type:
// nothing is converted and no extra pass is made.
//
// When the functions are called (the contract):
//   - Validation, on the calling thread, before anything is written: present(), then element(),
//     data(), shape() and contiguous() of every present gradient, and the same (with
//     mutable_data()) of every output of a variable that is averaged; some more than once (for
//     a message). variable_traits' same() and print() (entry.hpp) likewise.
//   - Across processes (gradavg::mpi), after validation and still on the calling thread:
//     present(), data(), shape() and contiguous() of every gradient once more, for the ranks'
//     agreement on presence and shapes.
//   - A call with a plan that holds its proof (plan.hpp) instead: present(), element(), data(),
//     shape() and contiguous() of every gradient, and of every output of an averaged variable,
//     once, on the calling thread; variable_traits not at all.
//   - make() (allocating API only) after validation, on the calling thread; the results it makes
//     are then read like outputs.
//   - The pass calls none of them: on whichever of the call's threads it runs, it reads the
//     pointers validation recorded. So the functions need not be thread-safe.
// Any of them may throw, and the exception propagates with nothing written; one that derives
// from gradavg::error and names no variable (variable_index() is npos) is re-raised as the same
// type, naming the variable and the tower (e.g. an adapter's "unsupported element type", or
// shape::from_dims's rank limit). Other exceptions reach the caller unchanged.
//
// Specialisations ship for std::vector, std::span and std::array (here), Eigen dense types
// (gradavg/eigen.hpp), Eigen's Tensor module (gradavg/eigen_tensor.hpp) and torch::Tensor
// (gradavg/torch.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "detail/isa.hpp"
#include "errors.hpp"

// The vocabulary of gradavg, shared by every instruction-set level (detail/isa.hpp): no element
// arithmetic, only shapes and element pointers.
namespace gradavg {

/// Order in which a multi-dimensional tensor lays out its elements.
enum class storage_order : std::uint8_t { row_major, col_major };

/// A gradient's element type, for tensor types whose element type is known at run time only.
enum class element_type : std::uint8_t { float32, float64, float16, bfloat16 };

/// "float32", "float64", "float16", "bfloat16".
[[nodiscard]] constexpr std::string_view element_name(element_type e) noexcept {
  switch (e) {
    case element_type::float32: return "float32";
    case element_type::float64: return "float64";
    case element_type::float16: return "float16";
    case element_type::bfloat16: return "bfloat16";
  }
  return "unknown";
}

/// tensor_traits<T>::value_type of a tensor type whose element type is a run-time property
/// (tensor_traits<T>::element(t)); see the file comment.
struct dynamic_element {};

/// Dimensions of a tensor (at most max_rank) and its storage order. Two tensors with equal
/// shapes hold their elements in the same order, so they can be combined element by element.
struct shape {
  static constexpr std::size_t max_rank = 8;

  std::array<std::int64_t, max_rank> dims{};
  std::size_t rank = 0;
  storage_order order = storage_order::row_major;

  /// Number of elements: the product of the dimensions (1 for rank 0).
  [[nodiscard]] constexpr std::size_t size() const noexcept {
    std::size_t n = 1;
    for (std::size_t d = 0; d < rank; ++d) n *= static_cast<std::size_t>(dims[d]);
    return n;
  }

  /// Equal dimensions; the storage order only counts where it changes the element order,
  /// i.e. where more than one dimension exceeds 1.
  friend constexpr bool operator==(const shape& a, const shape& b) noexcept {
    if (a.rank != b.rank) return false;
    for (std::size_t d = 0; d < a.rank; ++d)
      if (a.dims[d] != b.dims[d]) return false;
    if (a.order == b.order) return true;
    std::size_t non_trivial = 0;
    for (std::size_t d = 0; d < a.rank; ++d) non_trivial += a.dims[d] > 1 ? 1 : 0;
    return non_trivial <= 1;
  }

  /// The shape of dims (outermost first for row-major), for adapters of tensors of any rank.
  /// Throws shape_error when there are more than max_rank dimensions or one is negative;
  /// thrown from a tensor_traits function, it is re-raised naming the variable and the tower.
  [[nodiscard]] static shape from_dims(std::span<const std::int64_t> dims,
                                       storage_order order = storage_order::row_major) {
    if (dims.size() > max_rank)
      throw shape_error("a tensor of rank " + std::to_string(dims.size()) + "; gradavg reads tensors of rank " +
                        std::to_string(max_rank) + " (shape::max_rank) at most: pass a reshaped view");
    shape s;
    s.rank = dims.size();
    s.order = order;
    for (std::size_t d = 0; d < dims.size(); ++d) {
      if (dims[d] < 0)
        throw shape_error("a tensor with dimension " + std::to_string(d) + " of extent " + std::to_string(dims[d]));
      s.dims[d] = dims[d];
    }
    return s;
  }

  /// A rank-1 shape of n elements.
  [[nodiscard]] static constexpr shape vector(std::size_t n) noexcept {
    shape s;
    s.rank = 1;
    s.dims[0] = static_cast<std::int64_t>(n);
    return s;
  }

  /// A rank-2 shape of rows x cols elements in the given order.
  [[nodiscard]] static constexpr shape matrix(std::int64_t rows, std::int64_t cols,
                                              storage_order order = storage_order::row_major) noexcept {
    shape s;
    s.rank = 2;
    s.dims[0] = rows;
    s.dims[1] = cols;
    s.order = order;
    return s;
  }
};

/// Primary template: not a tensor. Specialise it (see the file comment) to plug a type in.
template <class T>
struct tensor_traits {};

/// T is readable as a gradient of a fixed element type: contiguous data and a shape.
template <class T>
concept static_tensor = requires(const T& t) {
  typename tensor_traits<T>::value_type;
  requires !std::same_as<typename tensor_traits<T>::value_type, dynamic_element>;
  { tensor_traits<T>::data(t) } -> std::convertible_to<const typename tensor_traits<T>::value_type*>;
  { tensor_traits<T>::shape(t) } -> std::same_as<shape>;
};

/// T is readable as a gradient whose element type is known at run time only.
template <class T>
concept dynamic_tensor = requires(const T& t) {
  requires std::same_as<typename tensor_traits<T>::value_type, dynamic_element>;
  { tensor_traits<T>::element(t) } -> std::same_as<element_type>;
  { tensor_traits<T>::data(t) } -> std::convertible_to<const void*>;
  { tensor_traits<T>::shape(t) } -> std::same_as<shape>;
};

/// T is readable as a gradient: contiguous data and a shape, through tensor_traits.
template <class T>
concept tensor = static_tensor<T> || dynamic_tensor<T>;

/// T refers to elements it does not own, which outlive it (tensor_traits<T>::view).
template <class T>
concept view_tensor = tensor<T> && requires { requires tensor_traits<T>::view; };

/// T can also be written to, so it can receive a mean or a mean of squares.
template <class T>
concept writable_tensor = (static_tensor<T> && requires(T& t) {
  { tensor_traits<T>::mutable_data(t) } -> std::same_as<typename tensor_traits<T>::value_type*>;
}) || (dynamic_tensor<T> && requires(T& t) {
  { tensor_traits<T>::mutable_data(t) } -> std::same_as<void*>;
});

/// T names an owning type that the allocating API can create with a given shape (and, for a
/// dynamic tensor, element type).
template <class T>
concept resultable_tensor = ((static_tensor<T> && requires(const shape& s) {
  typename tensor_traits<T>::result_type;
  { tensor_traits<T>::make(s) } -> std::same_as<typename tensor_traits<T>::result_type>;
}) || (dynamic_tensor<T> && requires(const shape& s, element_type e) {
  typename tensor_traits<T>::result_type;
  { tensor_traits<T>::make(s, e) } -> std::same_as<typename tensor_traits<T>::result_type>;
})) && writable_tensor<typename tensor_traits<T>::result_type>;

template <tensor T>
using tensor_value_t = typename tensor_traits<T>::value_type;

/// Whether t's elements are contiguous; types without a contiguous() member always are.
template <tensor T>
[[nodiscard]] constexpr bool is_contiguous(const T& t) noexcept {
  if constexpr (requires { { tensor_traits<T>::contiguous(t) } -> std::convertible_to<bool>; })
    return tensor_traits<T>::contiguous(t);
  else
    return true;
}

// ---- Standard containers: rank-1 tensors. --------------------------------------------------

template <class V, class Alloc>
  requires(!std::same_as<V, bool>)
struct tensor_traits<std::vector<V, Alloc>> {
  using value_type = V;
  using result_type = std::vector<V, Alloc>;
  static const V* data(const std::vector<V, Alloc>& v) noexcept { return v.data(); }
  static V* mutable_data(std::vector<V, Alloc>& v) noexcept { return v.data(); }
  static gradavg::shape shape(const std::vector<V, Alloc>& v) noexcept {
    return gradavg::shape::vector(v.size());
  }
  static result_type make(const gradavg::shape& s) { return result_type(s.size()); }
};

template <class V, std::size_t Extent>
struct tensor_traits<std::span<V, Extent>> {
  using value_type = std::remove_const_t<V>;
  using result_type = std::vector<value_type>;
  static constexpr bool view = true;
  static const value_type* data(const std::span<V, Extent>& v) noexcept { return v.data(); }
  static V* mutable_data(const std::span<V, Extent>& v) noexcept
    requires(!std::is_const_v<V>)
  {
    return v.data();
  }
  static gradavg::shape shape(const std::span<V, Extent>& v) noexcept {
    return gradavg::shape::vector(v.size());
  }
  static result_type make(const gradavg::shape& s) { return result_type(s.size()); }
};

template <class V, std::size_t N>
struct tensor_traits<std::array<V, N>> {
  using value_type = V;
  using result_type = std::array<V, N>;
  static const V* data(const std::array<V, N>& v) noexcept { return v.data(); }
  static V* mutable_data(std::array<V, N>& v) noexcept { return v.data(); }
  static gradavg::shape shape(const std::array<V, N>&) noexcept { return gradavg::shape::vector(N); }
  static result_type make(const gradavg::shape&) noexcept { return result_type{}; }
};

}  // namespace gradavg
