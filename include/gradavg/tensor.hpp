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
//
// Specialisations ship for std::vector, std::span and std::array (here), Eigen dense types
// (gradavg/eigen.hpp) and Eigen's Tensor module (gradavg/eigen_tensor.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "detail/isa.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE

/// Order in which a multi-dimensional tensor lays out its elements.
enum class storage_order : std::uint8_t { row_major, col_major };

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

/// T is readable as a gradient: contiguous data and a shape, through tensor_traits.
template <class T>
concept tensor = requires(const T& t) {
  typename tensor_traits<T>::value_type;
  { tensor_traits<T>::data(t) } -> std::convertible_to<const typename tensor_traits<T>::value_type*>;
  { tensor_traits<T>::shape(t) } -> std::same_as<shape>;
};

/// T refers to elements it does not own, which outlive it (tensor_traits<T>::view).
template <class T>
concept view_tensor = tensor<T> && requires { requires tensor_traits<T>::view; };

/// T can also be written to, so it can receive a mean or a mean of squares.
template <class T>
concept writable_tensor = tensor<T> && requires(T& t) {
  { tensor_traits<T>::mutable_data(t) } -> std::same_as<typename tensor_traits<T>::value_type*>;
};

/// T names an owning type that the allocating API can create with a given shape.
template <class T>
concept resultable_tensor = tensor<T> && requires(const shape& s) {
  typename tensor_traits<T>::result_type;
  { tensor_traits<T>::make(s) } -> std::same_as<typename tensor_traits<T>::result_type>;
} && writable_tensor<typename tensor_traits<T>::result_type>;

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

GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
