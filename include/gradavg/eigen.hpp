// gradavg: Eigen dense types as tensors — Matrix and Array (fixed and dynamic size), Map
// (aligned or not), Ref, and direct-access blocks, of float or double.
//
// Shape: [rows, cols] with the type's storage order, so a 6-vector and a 2x3 matrix differ.
// Strides: a tensor with an inner stride other than 1, or an outer stride other than its inner
// size, is rejected with shape_error (inputs) or output_error (outputs) rather than copied:
// pass a contiguous tensor. Results of the allocating API have type T::PlainObject.
#pragma once

#include <Eigen/Core>

#include <type_traits>

#include "detail/isa.hpp"
#include "tensor.hpp"

namespace gradavg {
namespace shared_detail {

/// An Eigen dense expression whose elements sit in memory (Matrix, Array, Map, Ref, Block).
template <class T>
concept eigen_direct_access = std::is_base_of_v<Eigen::DenseBase<T>, T> &&
                              (Eigen::internal::traits<T>::Flags & Eigen::DirectAccessBit) != 0;

template <class T>
struct is_const_eigen_ref : std::false_type {};
template <class Plain, int Options, class Stride>
struct is_const_eigen_ref<Eigen::Ref<const Plain, Options, Stride>> : std::true_type {};

}  // namespace shared_detail

template <shared_detail::eigen_direct_access T>
struct tensor_traits<T> {
  using value_type = std::remove_const_t<typename T::Scalar>;
  using result_type = typename T::PlainObject;
  /// Maps, blocks and non-const Refs refer to elements they do not own; Matrix and Array own
  /// theirs, and a Ref<const ...> may hold a copy.
  static constexpr bool view = !std::is_base_of_v<Eigen::PlainObjectBase<result_type>, T> &&
                               !shared_detail::is_const_eigen_ref<T>::value;

  static const value_type* data(const T& t) noexcept { return t.data(); }
  static value_type* mutable_data(T& t) noexcept
    requires std::is_same_v<decltype(std::declval<T&>().data()), value_type*>
  {
    return t.data();
  }
  static gradavg::shape shape(const T& t) noexcept {
    return gradavg::shape::matrix(static_cast<std::int64_t>(t.rows()), static_cast<std::int64_t>(t.cols()),
                                  T::IsRowMajor ? storage_order::row_major : storage_order::col_major);
  }
  static bool contiguous(const T& t) noexcept {
    return t.size() <= 1 || ((t.innerSize() <= 1 || t.innerStride() == 1) &&
                             (t.outerSize() <= 1 || t.outerStride() == t.innerSize()));
  }
  static result_type make(const gradavg::shape& s) {
    result_type r;
    r.resize(static_cast<Eigen::Index>(s.dims[0]), static_cast<Eigen::Index>(s.dims[1]));
    return r;
  }
};

}  // namespace gradavg
